"""Per-pod prediction error over a window (core.drift)."""

from __future__ import annotations

import pytest

from disaggpool.core.drift import DriftTracker


def test_the_median_ignores_a_few_outliers_and_needs_enough_samples() -> None:
    d = DriftTracker(window=8, min_samples=4)
    for observed in (1.0, 1.0, 1.0):
        d.observe("a", "ttft", 1.1, observed)
    assert d.error("a") is None  # three samples: not enough to say
    d.observe("a", "ttft", 1.0, 0.2)  # one wild request (error 4.0)
    assert d.error("a") == pytest.approx(0.1)
    assert d.errors() == {"a": pytest.approx(0.1)}


def test_the_window_slides_and_the_worse_quantity_counts() -> None:
    d = DriftTracker(window=4, min_samples=2)
    for _ in range(4):
        d.observe("a", "ttft", 1.0, 1.0)
    for _ in range(4):  # a slowed pod: predicted 1 s, took 2 s
        d.observe("a", "ttft", 1.0, 2.0)
    assert d.error("a") == pytest.approx(0.5)  # the older, accurate ones slid out
    d.observe("a", "tpot", 0.01, 0.04)
    assert d.error("a") == pytest.approx(0.5)  # one TPOT sample is below min_samples
    d.observe("a", "tpot", 0.01, 0.04)
    assert d.error("a") == pytest.approx(0.75)


def test_a_new_profile_starts_the_pods_window_over() -> None:
    d = DriftTracker(window=4, min_samples=1)
    d.observe("a", "ttft", 1.0, 2.0)
    d.observe("b", "ttft", 1.0, 2.0)
    d.profile_changed("a")
    assert d.error("a") is None and d.error("b") == pytest.approx(0.5)
    d.observe("a", "ttft", 1.0, 0.0)  # no observation to compare with
    assert d.error("a") is None


def test_bad_windows_are_refused() -> None:
    with pytest.raises(ValueError, match="min_samples"):
        DriftTracker(window=4, min_samples=5)


def test_the_watch_reports_a_pod_once_when_its_error_first_exceeds_the_threshold() -> None:
    d = DriftTracker(window=4, min_samples=2)
    seen: list[tuple[str, float]] = []
    d.watch(0.5, lambda pod, error: seen.append((pod, error)))
    d.observe("a", "tpot", 1.0, 4.0)  # error 0.75, one sample: below min_samples
    assert seen == []
    d.observe("b", "tpot", 1.0, 1.1)
    d.observe("b", "tpot", 1.0, 1.1)  # b within the threshold
    d.observe("a", "tpot", 1.0, 4.0)
    assert seen == [("a", pytest.approx(0.75))]
    for _ in range(4):
        d.observe("a", "tpot", 1.0, 4.0)
    assert len(seen) == 1  # once per window, not per request
    d.profile_changed("a")  # a new profile: a fresh window, watched again
    d.observe("a", "ttft", 1.0, 0.5)
    d.observe("a", "ttft", 1.0, 0.5)  # error 1.0: the TTFT counts as much as the TPOT
    assert seen[1:] == [("a", pytest.approx(1.0))]


def test_the_watch_reports_the_pods_error_not_the_quantitys() -> None:
    """The error the watch reports is `error(pod)`: the larger of its quantities' medians."""
    d = DriftTracker(window=4, min_samples=1)
    seen: list[float] = []
    d.observe("a", "ttft", 1.0, 0.25)  # error 3.0, before the watch
    d.watch(0.5, lambda pod, error: seen.append(error))
    d.observe("a", "tpot", 1.0, 0.5)  # error 1.0 crosses
    assert seen == [pytest.approx(3.0)]


def test_a_median_at_the_threshold_or_a_zero_threshold_reports_nothing() -> None:
    d = DriftTracker(window=4, min_samples=1)
    seen: list[str] = []
    d.watch(0.5, lambda pod, error: seen.append(pod))
    d.observe("a", "tpot", 1.0, 2.0)  # exactly 0.5: not beyond it
    d.watch(0.0, lambda pod, error: seen.append(pod))  # off
    d.observe("a", "tpot", 1.0, 10.0)
    assert seen == []
    with pytest.raises(ValueError, match="threshold"):
        d.watch(float("nan"), lambda pod, error: None)
