"""The window of recent traffic an autoscaler reads (core.demand)."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from autoscale_kit import demand
from disaggpool.core.demand import Demand, DemandWindow


def feed(window: DemandWindow, times: list[float]) -> None:
    for t in times:
        window.arrived(t)


def poisson(rate_at, start: float, end: float, seed: int) -> list[float]:  # type: ignore[no-untyped-def]
    """Arrivals of a Poisson process of rate `rate_at(t)` (<= 50) by thinning."""
    rng = random.Random(seed)
    out, t = [], start
    while True:
        t += rng.expovariate(50.0)
        if t >= end:
            return out
        if rng.random() < rate_at(t) / 50.0:
            out.append(t)


def test_rate_and_trend_of_a_steady_ramp() -> None:
    w = DemandWindow(window_s=60.0, bin_s=5.0)
    # Exactly k + 1 arrivals in bin k of the last minute: the rate rises 1/5 req/s every 5 s.
    times = [k * 5.0 + 5.0 * j / (k + 1) for k in range(12) for j in range(k + 1)]
    feed(w, times)
    d = w.demand(60.0)
    assert d.arrival_rps == pytest.approx(sum(range(1, 13)) / 60.0)
    assert d.rate_slope == pytest.approx(0.2 / 5.0)
    # Poisson counts of mean 6.5 per 5 s bin; sxx = 25 x sum((k - 5.5)^2) = 3,575.
    assert d.rate_slope_se == pytest.approx(math.sqrt(6.5 / 25.0 / 3575.0))
    assert d.window_s == 60.0


def _demands_every_5_s(times: list[float], end: float) -> list[Demand]:
    """A window fed `times` as they come, read every 5 s from its first minute to `end`."""
    w = DemandWindow(window_s=60.0, bin_s=5.0)
    out, i = [], 0
    for now in range(60, int(end) + 1, 5):
        while i < len(times) and times[i] < now:
            w.arrived(times[i])
            i += 1
        out.append(w.demand(float(now)))
    return out


def test_a_steady_rate_rises_within_its_noise_and_a_ramp_beyond_it() -> None:
    z = 2.326  # the 99% quantile
    steady = _demands_every_5_s(poisson(lambda t: 6.0, 0.0, 900.0, seed=4), 900.0)
    # Every minute of steady traffic has a slope; the largest of many is two errors or more...
    assert max(d.rate_slope / d.rate_slope_se for d in steady) > 2.0
    # ...and about 1% of them pass z errors: what is left of the slope asks for nothing.
    assert sum(d.significant_rise(z) > 0 for d in steady) <= 0.03 * len(steady)
    # 6 to 40 req/s over two minutes, 0.28 req/s per s: most of it significant within 30 s.
    ramp = _demands_every_5_s(poisson(lambda t: 6.0 + 34.0 * t / 120.0, 0.0, 120.0, 5), 120.0)
    assert all(d.significant_rise(z) > 0.1 for d in ramp[6:])


def test_bursty_counts_widen_the_error_of_the_slope() -> None:
    d = demand(rate_slope=0.1, rate_slope_se=0.02)
    assert d.significant_rise(2.0) == pytest.approx(0.06)
    assert d.significant_rise(2.0) == dataclasses.replace(d, dispersion=0.5).significant_rise(2.0)
    assert dataclasses.replace(d, dispersion=9.0).significant_rise(2.0) == 0.0  # 0.1 - 2 x 0.06


def test_a_young_window_divides_by_what_it_has_seen() -> None:
    w = DemandWindow(window_s=60.0, bin_s=5.0)
    feed(w, [0.0] + [1.0 + 0.5 * i for i in range(38)])  # 39 arrivals over the first 20 s
    d = w.demand(20.0)
    assert d.window_s == 20.0
    assert d.arrival_rps == pytest.approx(39 / 20.0)
    assert not d.bursts_known


def test_poisson_arrivals_have_dispersion_near_one_even_under_a_daily_swing() -> None:
    w = DemandWindow(window_s=60.0, bin_s=5.0, burst_window_s=600.0, trend_s=120.0)
    feed(w, poisson(lambda t: 20.0, 0.0, 600.0, seed=1))
    assert 0.7 < w.demand(600.0).dispersion < 1.3
    swing = DemandWindow(window_s=60.0, bin_s=5.0, burst_window_s=600.0, trend_s=120.0)
    feed(swing, poisson(lambda t: 20.0 + 15.0 * math.sin(2 * math.pi * t / 1200.0), 0, 600, 2))
    d = swing.demand(601.0)
    assert 0.6 < d.dispersion < 1.6 and d.bursts_known


def test_bursts_faster_than_the_trend_show_as_dispersion() -> None:
    w = DemandWindow(window_s=60.0, bin_s=5.0, burst_window_s=600.0, trend_s=120.0)
    feed(w, poisson(lambda t: 40.0 if t % 300 >= 240 else 12.0, 0.0, 600.0, seed=3))
    assert w.demand(600.0).dispersion > 5.0


def test_mix_comes_from_the_last_finished_requests_and_slo_ratios_from_the_window() -> None:
    w = DemandWindow(window_s=60.0, bin_s=5.0, mix_requests=4)
    for i, (p, o) in enumerate([(9999, 9999), (100, 10), (300, 30), (100, 10), (300, 30)]):
        w.finished(float(i), p, o, ttft_ratio=0.1 * (i + 1), tpot_ratio=0.5)
    d = w.demand(10.0)
    assert d.mean_prompt == 200.0 and d.mean_output == 20.0  # the oldest fell out of the mix
    assert d.work_cv == pytest.approx(0.5)  # works 110, 330, 110, 330
    assert d.ttft_ratio_p90 == pytest.approx(0.5) and d.finished == 5
    later = w.demand(200.0)  # nothing finished in the window: the mix stays, the ratios go
    assert later.mean_output == 20.0 and later.finished == 0 and later.ttft_ratio_p90 == 0.0


def test_a_decode_slot_sees_the_mix_weighted_by_how_long_each_request_stays() -> None:
    w = DemandWindow(mix_requests=8)
    # A chat (prompt 1,000, 200 out) and a code completion (prompt 2,000, 20 out): contexts
    # 1,100 and 2,010 over their lives, held 200 and 20 steps.
    w.finished(1.0, 1000, 200, 0.5, 0.5)
    w.finished(2.0, 2000, 20, 0.5, 0.5)
    d = w.demand(3.0)
    mean = (200 * 1100 + 20 * 2010) / 220
    assert d.slot_context == pytest.approx(mean)  # 1,182.7, where the request mean is 1,555
    sd = math.sqrt((200 * (1100 - mean) ** 2 + 20 * (2010 - mean) ** 2) / 220)
    assert d.slot_cv == pytest.approx(sd / mean)
    assert d.slot_cv < d.work_cv  # the long prompt counts for its 20 steps only
    # Nothing generated still took a step; one request has no spread.
    one = DemandWindow()
    one.finished(1.0, 500, 0, 0.5, 0.5)
    assert (one.demand(2.0).slot_context, one.demand(2.0).slot_cv) == (500.0, 0.0)
    assert (DemandWindow().demand(1.0).slot_context, DemandWindow().demand(1.0).slot_cv) == (0, 0)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(window_s=5.0, bin_s=5.0),
        dict(bin_s=0.0),
        dict(window_s=120.0, burst_window_s=60.0),
        dict(trend_s=900.0),
        dict(mix_requests=1),
    ],
)
def test_bad_windows_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        DemandWindow(**kwargs)  # type: ignore[arg-type]


def test_a_window_that_has_seen_nothing_says_so() -> None:
    d = DemandWindow().demand(100.0)
    assert d.arrival_rps == 0.0 and d.window_s < 60.0 and not d.bursts_known and d.finished == 0
