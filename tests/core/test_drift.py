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
