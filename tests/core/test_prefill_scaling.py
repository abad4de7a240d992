"""The prefill autoscaler (core.prefill_scaling) on hand-computed queues, and the prefill
counterparts of the other projects' autoscalers (core.autoscaling_baselines)."""

from __future__ import annotations

import dataclasses
import heapq
import math
import random

import pytest

from autoscale_kit import PROFILE, demand
from disaggpool.core.autoscaling import Bounds, PoolState
from disaggpool.core.autoscaling_baselines import (
    AUTOSCALERS,
    DynamoPrefillPlanner,
    LlmdSlo,
    LlmdTokenPrefill,
    make_prefill_autoscaler,
)
from disaggpool.core.hardware import builtin_profile
from disaggpool.core.prefill_scaling import (
    PARKED_KV_SHARE,
    PrefillScaler,
    erlang_c,
    miss_share,
    prefill_service,
)
from disaggpool.formats.embedded import azure_services
from disaggpool.sim.capacity import slo_targets

BOUNDS = Bounds(1, 16, startup_s=0.0, stabilization_s=60.0)


def test_erlang_c_on_known_values() -> None:
    # M/M/1: the probability of waiting is the utilisation.
    assert erlang_c(1, 0.6) == pytest.approx(0.6)
    # M/M/2 at a = 1: C = a^2 / (2 + a) / (1 - rho + ...) = 1/3.
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)
    assert erlang_c(3, 3.0) == 1.0  # no stable queue


def test_service_times_from_the_calibrated_constants() -> None:
    # S(n) = 0.01 + 1e-4 n: 1,000 and 3,000 tokens -> 0.11 and 0.31 s.
    mean, scv = prefill_service(PROFILE, [1000, 3000])
    assert mean == pytest.approx(0.21)
    assert scv == pytest.approx((0.11**2 + 0.31**2) / 2 / 0.21**2 - 1)


def scaler(**kw: object) -> PrefillScaler:
    return PrefillScaler(BOUNDS, [PROFILE], 0.5, 0.9, **kw)  # type: ignore[arg-type]


def test_pods_for_the_offered_load_and_the_ttft_tail() -> None:
    # 10 req/s of 1,000-token prompts: 0.11 s each, a = 1.1 busy pods, slack 0.5 - 0.11 - 0.003.
    d = demand(prompts=(1000,) * 50)
    n, why = scaler().wish(d)
    a, slack = 1.1, 0.5 - 0.11 - 0.003
    expect = next(
        c for c in range(2, 20) if erlang_c(c, a) * math.exp(-2 * (c - a) * slack / 0.11) <= 0.1
    )
    assert n == expect and "busy" in why


def test_a_rise_within_the_noise_adds_no_pod() -> None:
    d = demand(prompts=(1000,) * 50)
    flat = scaler().wish(d)[0]
    # 0.05 req/s per s, 1.25 standard errors: noise at the 90% target's z of 1.28, no pod.
    assert scaler().wish(dataclasses.replace(d, rate_slope=0.05, rate_slope_se=0.04))[0] == flat
    # 0.5 req/s per s is significant: 30 s ahead (startup 0 + half the window), 23.5 req/s.
    rising = scaler().wish(dataclasses.replace(d, rate_slope=0.5, rate_slope_se=0.04))[0]
    assert rising > flat


@pytest.mark.parametrize(("servers", "load"), [(1, 0.3), (1, 0.55), (1, 0.75), (2, 1.5), (2, 1.8)])
def test_the_miss_share_it_sizes_by_matches_a_simulated_queue(servers: int, load: float) -> None:
    """The Allen-Cunneen tail the scaler sizes by (`miss_share`), against a first-come-first-
    served queue of `servers` pods fed Poisson arrivals of the embedded chat trace's prompts on
    the autoscaling study's profile: the share of prompts that wait past their slack (TTFT
    target less their own prefill and KV transfer), within 30% or 0.003 (a third of the 1% the
    study targets)."""
    profile = builtin_profile("a40-qwen2.5-3b")
    services = azure_services()
    prompts = [r.prompt_tokens for r in services["chat"]]
    # The tightest TTFT target of `sim autoscale`, by which it sizes prefill (0.77 s).
    mix = [r for rs in services.values() for r in rs]
    ttft = min(c.ttft_s for c in slo_targets(profile, mix).values())
    rng = random.Random(7)
    sample = rng.sample(prompts, 400)
    mean_s, scv = prefill_service(profile, sample)
    slacks = [ttft - profile.prefill.prompt_time(n) - profile.kv_transfer.time(n) for n in sample]
    predicted = miss_share(servers, load, 1.0 + scv, mean_s, slacks)  # Poisson: ca^2 = 1
    free, now, late, counted = [0.0] * servers, 0.0, 0, 0
    for _ in range(100_000):
        now += rng.expovariate(load / mean_s)
        n = rng.choice(prompts)
        service = profile.prefill.prompt_time(n)
        slack = ttft - service - profile.kv_transfer.time(n)
        start = max(now, heapq.heappop(free))
        heapq.heappush(free, start + service)
        if slack > 0:
            counted += 1
            late += start - now > slack
    simulated = late / counted
    assert abs(predicted - simulated) <= max(0.3 * simulated, 0.003), (predicted, simulated)


def test_longer_prompts_and_a_wider_spread_need_more_pods() -> None:
    base = scaler().wish(demand(prompts=(1000,) * 50))[0]
    assert scaler().wish(demand(prompts=(4000,) * 50))[0] > base
    # Same mean work, three prompts of 100 tokens to one of 3,700: a longer tail, cs^2 2.
    spread = scaler().wish(demand(prompts=(100, 100, 100, 3700) * 25, arrival_rps=30.0))[0]
    even = scaler().wish(demand(prompts=(1000,) * 50, arrival_rps=30.0))[0]
    assert spread > even


def test_bursts_a_queue_and_the_floor_add_pods() -> None:
    d = demand(prompts=(1000,) * 50, arrival_rps=40.0)
    base = scaler().wish(d)[0]
    assert scaler().wish(dataclasses.replace(d, dispersion=9.0))[0] > base
    # 100 prompts queued need 100 x 0.11 / 0.5 = 22 pods' worth to go within one target.
    assert scaler().wish(d, waiting=100)[0] >= base + 22
    assert scaler(min_headroom=1.0).wish(d)[0] >= math.ceil(2 * 40 * 0.11)


def test_each_prompt_is_sized_for_its_own_slack() -> None:
    # 90% short prompts (0.02 s, slack 0.48 s) and 10% long (0.41 s, slack 0.09 s) at 30 req/s:
    # sizing every prompt for the long ones' slack asks for more pods than the mix needs.
    prompts = (100,) * 45 + (4000,) * 5
    d = demand(prompts=prompts, arrival_rps=30.0)
    mean, scv = prefill_service(PROFILE, prompts)
    a, v = 30.0 * mean, 1.0 + scv

    def first(slacks: list[float]) -> int:
        return next(
            c
            for c in range(1, 50)
            if c > a
            and sum(erlang_c(c, a) * math.exp(-2 * (c - a) * t / (v * mean)) for t in slacks)
            / len(slacks)
            <= 0.1
        )

    slack = {
        n: 0.5 - PROFILE.prefill.prompt_time(n) - PROFILE.kv_transfer.time(n) for n in (100, 4000)
    }
    own = first([slack[n] for n in prompts])
    tail = first([slack[4000]] * len(prompts))
    assert scaler().wish(d)[0] == own < tail


def test_prompts_that_miss_on_any_pool_do_not_ask_for_every_pod() -> None:
    # 6,000 tokens take 0.61 s, over the 0.5 s target: no pool helps them; the others are sized.
    d = demand(prompts=(6000,) * 10 + (1000,) * 40, arrival_rps=10.0)
    assert scaler().wish(d)[0] < 10


def test_a_backlog_within_the_headroom_adds_no_pod() -> None:
    d = demand(prompts=(1000,) * 50, arrival_rps=40.0)
    assert scaler().wish(d, waiting=1)[0] == scaler().wish(d)[0]


def test_kv_parked_for_decode_holds_prefill_pods() -> None:
    d = demand(prompts=(1000,) * 50, arrival_rps=1.0)
    assert scaler().wish(d)[0] == 1
    # 1.5 pods' worth of KV in use, at most a quarter of the pool's cache: 6 pods.
    assert scaler().wish(d, kv_usage=1.5)[0] == math.ceil(1.5 / PARKED_KV_SHARE) == 6
    held = scaler().decide(d, PoolState(4, 0, kv_usage=1.0))
    assert held.replicas == 4  # not scaled down while decode has not taken its KV
    # No prompts routed in the window, KV still parked: not "no traffic".
    assert scaler().wish(demand(arrival_rps=0.0, prompts=()), kv_usage=0.5)[0] == 2


def test_no_traffic_and_bad_arguments() -> None:
    s = scaler()
    assert s.wish(demand(arrival_rps=0.0, prompts=()))[0] == 0
    # One pod fewer per step, as for decode.
    assert s.decide(demand(arrival_rps=0.0, prompts=()), PoolState(3, 0)).replicas == 2
    with pytest.raises(ValueError, match="ttft_s"):
        PrefillScaler(BOUNDS, [PROFILE], 0.0)
    with pytest.raises(ValueError, match="profile"):
        PrefillScaler(BOUNDS, [], 0.5)


def test_prefill_counterparts_of_the_baselines() -> None:
    for name in AUTOSCALERS:
        assert make_prefill_autoscaler(name, BOUNDS, [PROFILE], 0.5).name == name
    with pytest.raises(ValueError, match="unknown autoscaler"):
        make_prefill_autoscaler("hpa", BOUNDS, [PROFILE], 0.5)
    ours = make_prefill_autoscaler("disaggpool", BOUNDS, [PROFILE], 0.5, min_headroom=0.5)
    assert isinstance(ours, PrefillScaler) and ours.min_headroom == 0.5
    # llm-d: 1,000-token prompts at 0.11 s are 9,091 tokens/s; 30,000 tokens queued = 3.3 s of
    # backlog over 1.5 s per pod -> 3.
    t = LlmdTokenPrefill(BOUNDS, [PROFILE])
    got = t.decide(
        dataclasses.replace(demand(mean_prompt=1000.0), now=0.0),
        PoolState(1, 0, queued_tokens=30_000),
    )
    assert got.replicas == 2  # one pod per 180 s
    slo = LlmdSlo(BOUNDS, ttft_only=True)
    assert slo.decide(demand(ttft_ratio_p90=0.3, tpot_ratio_p90=0.9), PoolState(3, 0)).replicas == 2
    # Dynamo: 10 req/s x 0.11 s = 1.1 busy -> 2; its fast loop adds one over the TTFT target.
    dyn = DynamoPrefillPlanner(BOUNDS, [PROFILE], 0.5)
    assert dyn.decide(demand(mean_prompt=1000.0), PoolState(4, 0)).replicas == 2
    queued = PoolState(2, 0, queued_tokens=20_000)  # 20,000 x 0.11 ms / 2 pods = 1.1 s > 0.5
    assert dyn.decide(demand(mean_prompt=1000.0), queued).replicas == 3
