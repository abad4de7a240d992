"""The decode autoscaler's view of the work admitted (core.autoscaling: the occupancy trend, the
mix as routed, prefill kept on decode, the headroom floor) and the window's routed requests
(core.demand.DemandWindow.admitted), on hand-computed cases."""

from __future__ import annotations

import dataclasses
import math

import pytest

from autoscale_kit import PROFILE, demand
from disaggpool.core.autoscaling import Bounds, HeterogeneityScaler, Occupancy, PoolState
from disaggpool.core.demand import DemandWindow


def scaler(**kw: object) -> HeterogeneityScaler:
    bounds = Bounds(1, 20, startup_s=60.0, stabilization_s=60.0)
    return HeterogeneityScaler(bounds, [PROFILE], 0.03, 0.9, **kw)  # type: ignore[arg-type]


def test_a_steady_occupancy_projects_nothing_and_a_rising_one_its_significant_trend() -> None:
    occ = Occupancy(span_s=30.0)
    for t in range(0, 35, 5):
        occ.add(float(t), 20.0 + (1 if t % 10 else -1), 20_000.0)
    held, seqs, kv = occ.ahead(60.0, 1.28)
    assert held == 19.0 and seqs == 19.0 and kv == 20_000.0  # noise is no trend
    rising = Occupancy(span_s=30.0)
    for t in range(0, 35, 5):
        rising.add(float(t), 10.0 + 2.0 * t, 1000.0 * (10.0 + 2.0 * t))
    held, seqs, kv = rising.ahead(60.0, 1.28)
    # slope 2/s; a count's error at mean 40 over Sxx 700: sqrt(40 / 700) = 0.239.
    assert held == 70.0
    assert seqs == pytest.approx(70.0 + 60.0 * (2.0 - 1.28 * math.sqrt(40.0 / 700.0)))
    assert kv > 70_000.0


def test_too_few_points_make_no_trend() -> None:
    occ = Occupancy()
    occ.add(0.0, 5.0, 5000.0)
    occ.add(5.0, 50.0, 50_000.0)
    assert occ.ahead(60.0, 1.28) == (50.0, 50.0, 50_000.0)


def test_outputs_growing_at_a_constant_rate_raise_the_wish_within_a_few_ticks() -> None:
    # 10 req/s of 200 output tokens: (60 + 1.28 sqrt(60)) / 20 -> 4 pods. Then the pool fills
    # at 5 sequences a second, as when outputs turn long, the rate unchanged.
    s = scaler()
    steady = [
        s.decide(dataclasses.replace(demand(), now=float(t)), PoolState(4, 0, running=60))
        for t in range(0, 30, 5)
    ]
    assert {d.replicas for d in steady} == {4}
    grown = []
    for k, t in enumerate(range(30, 50, 5)):
        running = 60 + 25 * (k + 1)
        pool = PoolState(4, 0, running=running, kv_usage=running * 1000 / 30_000)
        grown.append(s.decide(dataclasses.replace(demand(), now=float(t)), pool))
    assert grown[-1].replicas > 4 and "heading for" in grown[-1].reason
    # The rate and the finished mix alone still say 4.
    assert s.wish(demand())[0] == 4


def test_a_pool_filling_up_to_what_the_mix_accounts_for_asks_for_nothing_more() -> None:
    s = scaler()
    for k, t in enumerate(range(0, 30, 5)):  # filling from 0 to 60 sequences: a start
        pool = PoolState(4, 0, running=10 * (k + 1), kv_usage=10 * (k + 1) * 1000 / 30_000)
        d = s.decide(dataclasses.replace(demand(), now=float(t)), pool)
    assert d.replicas == 4


def test_sequences_waiting_for_their_kv_count_in_the_context_the_pool_holds() -> None:
    """A pool starting up: 3 sequences of 3,000-token prompts held, one decoding and two still
    receiving their KV (vLLM counts those waiting, reason "deferred", their blocks taken). The
    pool heads for 6 sequences of 3,000 tokens: 18,000 of 30,000 KV tokens, one pod, however
    the 3 split. (Per running sequence, the context looked 9,000 tokens deep: 2 pods.)"""
    wishes = {}
    for running, waiting in ((3, 0), (1, 2)):
        s = scaler()
        for t in range(0, 30, 5):  # empty, then 3 held at the last tick: a significant rise
            s.occupancy.add(float(t), 0.0, 0.0)
        s.occupancy.add(30.0, 3.0, 9000.0)
        pool = PoolState(
            1, 0, waiting=waiting, deferred=waiting, running=running, kv_usage=9000 / 30_000
        )
        wishes[running] = s.held_wish(demand(mean_prompt=3000.0), pool, expected=0.0)
    assert "heading for" in wishes[3][1] and wishes[3][0] == 1
    assert wishes[1] == wishes[3]


def test_longer_predicted_outputs_as_routed_raise_the_wish_before_any_finishes() -> None:
    s = scaler()
    # Routed requests predicted at 400 tokens, finished ones at 200: residence doubles.
    assert s.wish(demand(admitted_output=400.0))[0] > s.wish(demand())[0]
    # Shorter predictions do not lower it (the finished mix still holds).
    assert s.wish(demand(admitted_output=100.0))[0] == s.wish(demand())[0]


def test_prefill_kept_on_decode_adds_the_pod_seconds_it_takes() -> None:
    s = scaler()
    base = s.wish(demand())[0]
    # Half of 10 req/s prefilled locally, 1,000-token prompts: 0.01 + 0.1 = 0.11 s each ->
    # 0.55 pods of prefill on top of 3.5 pods of decode -> 5.
    local = demand(local_share=0.5, prompts=(1000,) * 10)
    assert s.wish(local)[0] == base + 1
    assert "prefilling locally" in s.wish(local)[1]


def test_the_headroom_floor_is_the_users() -> None:
    # L = 60 slots: the quantile asks 69.9 (4 pods of 20); a 50% floor asks 90 (5).
    assert scaler().wish(demand())[0] == 4
    assert scaler(min_headroom=0.5).wish(demand())[0] == 5
    with pytest.raises(ValueError, match="min_headroom"):
        scaler(min_headroom=-0.1)


def test_the_window_keeps_what_was_routed() -> None:
    w = DemandWindow(window_s=60.0, mix_requests=4)
    for i in range(6):
        w.arrived(float(i))
        w.admitted(float(i), 100 * (i + 1), 50.0 * (i + 1), local=i % 2 == 0)
    d = w.demand(6.0)
    assert d.admitted_output == pytest.approx(175.0)
    assert d.local_share == pytest.approx(0.5)
    assert d.prompts == (300, 400, 500, 600)  # the last mix_requests
    # Routed requests leave the window's mean after window_s; the prompts stay (last N).
    later = w.demand(100.0)
    assert later.admitted_output == 0.0 and later.local_share == 0.0
    assert later.prompts == (300, 400, 500, 600)
