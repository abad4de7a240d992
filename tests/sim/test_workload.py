"""Tests of disaggpool.sim.workload: arrival processes, length generators and trace transforms."""

from __future__ import annotations

import itertools
import math
import random
import statistics

import pytest

from disaggpool.formats.traces import TraceRequest
from disaggpool.sim.workload import (
    clip_lengths,
    gamma_arrivals,
    lognormal_lengths,
    merge,
    onoff_arrivals,
    poisson_arrivals,
    rescale,
    trace_stats,
    window,
    with_arrivals,
)

N = 20000


def _rate(times: list[float]) -> float:
    return (len(times) - 1) / (times[-1] - times[0])


def _gap_cv(times: list[float]) -> float:
    gaps = [b - a for a, b in itertools.pairwise(times)]
    return statistics.pstdev(gaps) / statistics.fmean(gaps)


def _is_sorted(times: list[float]) -> bool:
    return all(a <= b for a, b in itertools.pairwise(times))


def _at(*times: float, prompt: int = 1) -> list[TraceRequest]:
    return [TraceRequest(t, prompt, 1) for t in times]


# --- arrival processes -------------------------------------------------------------------------


def test_poisson_rate_cv_and_shape() -> None:
    times = poisson_arrivals(8.0, N, random.Random(1))
    assert len(times) == N and times[0] == 0.0 and _is_sorted(times)
    assert _rate(times) == pytest.approx(8.0, rel=0.03)
    assert _gap_cv(times) == pytest.approx(1.0, rel=0.05)


@pytest.mark.parametrize("cv", [1.0, 2.0, 4.0])
def test_gamma_rate_and_cv(cv: float) -> None:
    times = gamma_arrivals(5.0, cv, N, random.Random(2))
    assert len(times) == N and times[0] == 0.0 and _is_sorted(times)
    # The rate estimate's relative error grows with cv (std ~ cv / sqrt(N) ~ 3% at cv 4).
    assert _rate(times) == pytest.approx(5.0, rel=0.03 * max(1.0, cv))
    assert _gap_cv(times) == pytest.approx(cv, rel=0.10)


def test_gamma_cv_zero_is_regular() -> None:
    assert gamma_arrivals(4.0, 0.0, 5, random.Random(0)) == [0.0, 0.25, 0.5, 0.75, 1.0]


@pytest.mark.parametrize("burst", [1.0, 4.0, math.inf])
def test_onoff_long_run_rate(burst: float) -> None:
    times = onoff_arrivals(10.0, N, random.Random(3), on_s=1.0, off_s=2.0, burst_factor=burst)
    assert len(times) == N and times[0] == 0.0 and _is_sorted(times)
    assert _rate(times) == pytest.approx(10.0, rel=0.05)
    if burst == 1.0:
        assert _gap_cv(times) == pytest.approx(1.0, rel=0.05)
    else:
        assert _gap_cv(times) > 1.2  # the modulation makes the gaps burstier than Poisson


@pytest.mark.parametrize(
    "make",
    [
        lambda rng: poisson_arrivals(3.0, 500, rng),
        lambda rng: gamma_arrivals(3.0, 2.5, 500, rng),
        lambda rng: onoff_arrivals(3.0, 500, rng, on_s=2.0, off_s=5.0, burst_factor=6.0),
        lambda rng: lognormal_lengths(
            500, rng, prompt_mean=100, output_mean=20, sigma=1.0, slo_classes=[("a", 1), ("b", 3)]
        ),
    ],
)
def test_deterministic_given_seed(make) -> None:  # type: ignore[no-untyped-def]
    assert make(random.Random(42)) == make(random.Random(42))
    assert make(random.Random(42)) != make(random.Random(43))


def test_empty_and_invalid_arguments() -> None:
    rng = random.Random(0)
    assert poisson_arrivals(1.0, 0, rng) == []
    assert gamma_arrivals(1.0, 2.0, 0, rng) == []
    assert onoff_arrivals(1.0, 0, rng, on_s=1, off_s=1, burst_factor=2) == []
    assert poisson_arrivals(1.0, 1, rng) == [0.0]
    for bad in (
        lambda: poisson_arrivals(0.0, 5, rng),
        lambda: poisson_arrivals(math.inf, 5, rng),
        lambda: poisson_arrivals(1.0, -1, rng),
        lambda: gamma_arrivals(1.0, -0.5, 5, rng),
        lambda: onoff_arrivals(1.0, 5, rng, on_s=1, off_s=1, burst_factor=0.5),
        lambda: onoff_arrivals(1.0, 5, rng, on_s=0, off_s=1, burst_factor=2),
    ):
        with pytest.raises(ValueError):
            bad()


# --- lengths -----------------------------------------------------------------------------------


def test_lognormal_means_and_class_weights() -> None:
    reqs = lognormal_lengths(
        N,
        random.Random(5),
        prompt_mean=1000,
        output_mean=200,
        sigma=1.0,
        slo_classes=[("interactive", 1.0), ("batch", 3.0)],
    )
    assert len(reqs) == N
    assert statistics.fmean(r.prompt_tokens for r in reqs) == pytest.approx(1000, rel=0.04)
    assert statistics.fmean(r.output_tokens for r in reqs) == pytest.approx(200, rel=0.04)
    assert all(r.arrival_s == 0.0 and r.prompt_tokens >= 1 for r in reqs)
    share = sum(r.slo_class == "interactive" for r in reqs) / N
    assert share == pytest.approx(0.25, abs=0.02)


def test_lognormal_sigma_zero_is_constant() -> None:
    reqs = lognormal_lengths(10, random.Random(0), prompt_mean=512.4, output_mean=64, sigma=0.0)
    assert {(r.prompt_tokens, r.output_tokens, r.slo_class) for r in reqs} == {(512, 64, "")}


def test_lognormal_rejects_bad_weights() -> None:
    with pytest.raises(ValueError):
        lognormal_lengths(
            3, random.Random(0), prompt_mean=10, output_mean=10, sigma=1, slo_classes=[("a", 0)]
        )


# --- transforms --------------------------------------------------------------------------------


def test_rescale_hits_target_rate_and_keeps_shape() -> None:
    trace = _at(10.0, 11.0, 11.5, 14.0)
    out = rescale(trace, 6.0)
    assert out[0].arrival_s == 0.0
    assert trace_stats(out)["rate"] == pytest.approx(6.0)
    # Gaps 1, 0.5, 2.5 keep their proportions.
    gaps = [b.arrival_s - a.arrival_s for a, b in itertools.pairwise(out)]
    assert [g / gaps[0] for g in gaps] == pytest.approx([1.0, 0.5, 2.5])
    assert trace_stats(out)["interarrival_cv"] == pytest.approx(
        trace_stats(trace)["interarrival_cv"]
    )


def test_rescale_edge_cases() -> None:
    assert rescale([], 1.0) == []
    assert rescale(_at(7.0), 2.0) == _at(0.0)
    with pytest.raises(ValueError):
        rescale(_at(3.0, 3.0), 1.0)


def test_window_rebases_to_window_start() -> None:
    trace = _at(0.0, 1.0, 2.5, 3.0, 4.0)
    assert window(trace, 2.0, 2.0) == _at(0.5, 1.0)
    assert window(trace, 10.0, 5.0) == []
    assert window(trace, 0.0, math.inf) == trace


def test_merge_orders_by_time_and_breaks_ties_by_input_order() -> None:
    a = [TraceRequest(0.0, 1, 1, "a"), TraceRequest(2.0, 2, 1, "a")]
    b = [TraceRequest(1.0, 3, 1, "b"), TraceRequest(2.0, 4, 1, "b")]
    c = [TraceRequest(2.0, 5, 1, "c")]
    merged = merge(a, b, c)
    assert [r.prompt_tokens for r in merged] == [1, 3, 2, 4, 5]
    assert [r.prompt_tokens for r in merge(c, b, a)] == [1, 3, 5, 4, 2]
    assert merge() == []


def test_clip_lengths() -> None:
    trace = [TraceRequest(0.0, 5000, 10), TraceRequest(1.0, 100, 3000)]
    out = clip_lengths(trace, max_prompt=4096, max_output=1024)
    assert out == [TraceRequest(0.0, 4096, 10), TraceRequest(1.0, 100, 1024)]
    assert clip_lengths(out, 4096, 1024)[0] is out[0]  # unchanged requests are reused
    with pytest.raises(ValueError):
        clip_lengths(trace, 0, 10)


def test_with_arrivals() -> None:
    lengths = [TraceRequest(0.0, 10, 1, "x"), TraceRequest(0.0, 20, 2)]
    assert with_arrivals(lengths, [0.5, 0.75]) == [
        TraceRequest(0.5, 10, 1, "x"),
        TraceRequest(0.75, 20, 2),
    ]
    with pytest.raises(ValueError):
        with_arrivals(lengths, [1.0])
    with pytest.raises(ValueError):
        with_arrivals(lengths, [1.0, 0.5])


def test_trace_stats() -> None:
    trace = [TraceRequest(float(i), i + 1, 2 * (i + 1)) for i in range(101)]
    stats = trace_stats(trace)
    assert stats["n"] == 101
    assert stats["duration_s"] == 100.0
    assert stats["rate"] == pytest.approx(1.0)
    assert stats["interarrival_cv"] == pytest.approx(0.0)
    assert stats["prompt_mean"] == pytest.approx(51.0)
    assert (stats["prompt_p50"], stats["prompt_p90"], stats["prompt_p99"]) == (51, 91, 100)
    assert stats["output_p99"] == 200
    empty = trace_stats([])
    assert empty["n"] == 0 and math.isnan(empty["rate"]) and math.isnan(empty["prompt_p50"])
    assert math.isnan(trace_stats(_at(1.0))["rate"])
