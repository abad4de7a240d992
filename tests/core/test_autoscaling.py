"""The decode autoscaler and its rules, on hand-computed cases (core.autoscaling), and the other
projects' autoscalers, each on the rule its documentation states (core.autoscaling_baselines)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from autoscale_kit import PROFILE, Z90, demand
from disaggpool.core.autoscaling import (
    Bounds,
    HeterogeneityScaler,
    PoolState,
    Stabilizer,
    decode_capacity,
    slots_needed,
)
from disaggpool.core.autoscaling_baselines import (
    AUTOSCALERS,
    DynamoPlanner,
    KedaQueue,
    LlmdSlo,
    LlmdToken,
    StaticPeak,
    make_autoscaler,
)


def test_capacity_is_the_largest_batch_meeting_the_tpot_target_and_the_kv() -> None:
    # context 900 + 100 = 1000: step 0.01 + 0.001 b <= 0.03 -> b <= 20; KV b * 1100 <= 30000.
    cap = decode_capacity(PROFILE, 900, 200, 0.03)
    assert cap.batch == 20
    assert cap.step_s == pytest.approx(0.03)
    assert cap.rps == pytest.approx(20 / (200 * 0.03))
    # A KV budget of 11,000 tokens holds 10 sequences of 1,100 before the TPOT target binds.
    small = dataclasses.replace(PROFILE, kv_capacity_tokens=11_000)
    assert decode_capacity(small, 900, 200, 0.03).batch == 10


def test_capacity_at_the_context_a_decode_slot_holds() -> None:
    # Half code: the request mean prompt 1,400 overstates what a slot holds (context 700 here).
    # step 0.01 + 1e-6 * b * 700 <= 0.03 -> b <= 28; KV b * (700 + 100) <= 30000 -> b <= 37.
    cap = decode_capacity(PROFILE, 1400, 200, 0.03, context=700.0)
    assert cap.batch == 28
    assert cap.batch > decode_capacity(PROFILE, 1400, 200, 0.03).batch  # 13 at context 1,500
    # The final KV still binds: 11,000 tokens hold 13 sequences of 700 + 100.
    small = dataclasses.replace(PROFILE, kv_capacity_tokens=11_000)
    assert decode_capacity(small, 1400, 200, 0.03, context=700.0).batch == 13


def test_headroom_grows_with_heterogeneity_and_burstiness() -> None:
    # L = 10 req/s * 6 s = 60 slots; S = L + z sqrt(D L (1 + cv^2)).
    assert slots_needed(demand(), 6.0, Z90, 0.0) == pytest.approx(60 + Z90 * math.sqrt(60))
    assert slots_needed(demand(slot_cv=1.0), 6.0, Z90, 0.0) == pytest.approx(
        60 + Z90 * math.sqrt(120)
    )
    assert slots_needed(demand(slot_cv=1.0, dispersion=4.0), 6.0, Z90, 0.0) == pytest.approx(
        60 + Z90 * math.sqrt(480)
    )
    # The per-request spread is not what a decode slot sees: it does not move the headroom.
    assert slots_needed(demand(work_cv=3.0), 6.0, Z90, 0.0) == slots_needed(demand(), 6.0, Z90, 0.0)
    # Under-dispersed counts never shrink the headroom below Poisson's.
    assert slots_needed(demand(dispersion=0.3), 6.0, Z90, 0.0) == slots_needed(
        demand(), 6.0, Z90, 0.0
    )


def test_the_rate_is_read_one_cold_start_and_half_a_window_ahead_upwards_only() -> None:
    # slope 0.1 req/s per s, 60 s cold start + 30 s (the window's middle) -> 19 req/s.
    rising = slots_needed(demand(rate_slope=0.1), 6.0, 0.0, 60.0)
    assert rising == pytest.approx(19 * 6.0)
    assert slots_needed(demand(rate_slope=-0.1), 6.0, 0.0, 60.0) == pytest.approx(60.0)


def scaler(**bounds: object) -> HeterogeneityScaler:
    b = dict(min_replicas=1, max_replicas=10, startup_s=0.0, stabilization_s=60.0)
    b.update(bounds)
    return HeterogeneityScaler(Bounds(**b), [PROFILE], 0.03, 0.9)  # type: ignore[arg-type]


def test_replicas_from_the_hand_computed_need() -> None:
    s = scaler()
    # 10 req/s, residence 200 * 0.03 = 6 s, batch 20: (60 + 1.28 sqrt(60)) / 20 = 3.5 -> 4.
    assert s.wish(demand())[0] == 4
    # cv 1, dispersion 4: (60 + 1.28 sqrt(480)) / 20 = 4.4 -> 5.
    assert s.wish(demand(slot_cv=1.0, dispersion=4.0))[0] == 5
    # A mix whose slots hold less context fits more sequences per pod: context 700, batch 28,
    # step 0.0296: L = 10 * 200 * 0.0296 = 59.2, (59.2 + 1.28 sqrt(59.2)) / 28 = 2.5 -> 3.
    assert s.wish(demand(slot_context=700.0))[0] == 3
    # 40 requests queued for a slot: (69.9 + 40) / 20 -> 6.
    assert s.wish(demand(), waiting=40)[0] == 6
    assert s.decide(demand(), PoolState(ready=1, starting=0)).replicas == 4


def test_zero_traffic_goes_to_the_lower_bound() -> None:
    s = scaler(min_replicas=2, stabilization_s=0.0)
    idle = demand(arrival_rps=0.0)
    assert s.wish(idle) == (0, "no traffic in the window")
    assert s.decide(idle, PoolState(ready=3, starting=0)).replicas == 2
    assert s.decide(dataclasses.replace(idle, now=1005.0), PoolState(2, 0)).replicas == 2


def test_pods_still_starting_count_as_capacity() -> None:
    s = scaler()
    assert s.decide(demand(), PoolState(ready=2, starting=2)).replicas == 4
    assert s.decide(demand(), PoolState(ready=2, starting=1)).replicas == 4


def test_scale_down_waits_for_the_stabilisation_window_one_pod_at_a_time() -> None:
    s = scaler(stabilization_s=60.0)
    busy = demand(arrival_rps=20.0)  # (120 + 1.28 sqrt(120)) / 20 -> 7
    assert s.decide(busy, PoolState(7, 0)).replicas == 7
    quiet = [dataclasses.replace(demand(), now=1000.0 + t) for t in (5, 30, 59, 61, 66)]
    got = [s.decide(d, PoolState(7 if i < 4 else 6, 0)).replicas for i, d in enumerate(quiet)]
    # Within 60 s of the busy wish nothing moves; then one pod per step.
    assert got == [7, 7, 7, 6, 5]


def test_no_scale_down_before_the_burstiness_is_known() -> None:
    s = scaler(stabilization_s=0.0)
    young = demand(arrival_rps=1.0, bursts_known=False)
    d = s.decide(young, PoolState(6, 0))
    assert d.replicas == 6 and "burstiness not known" in d.reason
    assert s.decide(demand(arrival_rps=40.0, bursts_known=False), PoolState(6, 0)).replicas == 10


def test_stabilizer_rate_limits() -> None:
    st = Stabilizer(
        Bounds(1, 10, 0.0, 0.0), up_step=1, up_every_s=180.0, down_step=1, down_every_s=300.0
    )
    assert st.apply(0.0, 9, 3) == 4
    assert st.apply(100.0, 9, 4) == 4  # within 180 s of the last step up
    assert st.apply(180.0, 9, 4) == 5
    assert st.apply(200.0, 1, 5) == 4
    assert st.apply(400.0, 1, 4) == 4  # within 300 s of the last step down
    assert st.apply(500.0, 1, 4) == 3
    assert st.apply(900.0, 99, 3) == 4  # and never past the bounds
    assert Stabilizer(Bounds(2, 4, 0.0, 0.0), up_step=None).apply(0.0, 99, 2) == 4


@pytest.mark.parametrize(
    ("bounds", "field"),
    [
        (dict(min_replicas=-1, max_replicas=3), "min_replicas"),
        (dict(min_replicas=3, max_replicas=2), "max_replicas"),
        (dict(min_replicas=0, max_replicas=0), "max_replicas"),
        (dict(min_replicas=1, max_replicas=2, startup_s=-1.0), "startup_s"),
        (dict(min_replicas=1, max_replicas=2, stabilization_s=math.nan), "stabilization_s"),
    ],
)
def test_bad_bounds_are_named(bounds: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        Bounds(**bounds)  # type: ignore[arg-type]


def test_a_target_outside_its_range_is_refused() -> None:
    with pytest.raises(ValueError, match="target_goodput"):
        HeterogeneityScaler(Bounds(1, 2), [PROFILE], 0.03, 1.0)
    with pytest.raises(ValueError, match="profile"):
        HeterogeneityScaler(Bounds(1, 2), [], 0.03, 0.9)


# ---------------------------------------------------------------------------- the baselines
BOUNDS = Bounds(1, 8, startup_s=60.0, stabilization_s=300.0)


def at(t: float, **over: object):  # type: ignore[no-untyped-def]
    return dataclasses.replace(demand(**over), now=t)


def test_static_peak_always_asks_for_the_upper_bound() -> None:
    assert StaticPeak(BOUNDS).decide(at(0.0, arrival_rps=0.0), PoolState(3, 0)).replicas == 8


def test_keda_queue_follows_waiting_per_pod_with_the_hpa_tolerance() -> None:
    k = KedaQueue(BOUNDS)
    # 4 ready pods, 8 waiting = 2 per pod: on target.
    assert k.decide(at(0.0), PoolState(4, 0, waiting=8)).replicas == 4
    # 8.5 waiting is within 10% of the target: no change.
    assert k.decide(at(15.0), PoolState(4, 0, waiting=8)).replicas == 4
    # 14 waiting over 4 ready = 3.5 per pod -> ceil(4 * 1.75) = 7.
    assert k.decide(at(30.0), PoolState(4, 0, waiting=14)).replicas == 7
    # No queue: it wants the lower bound, but only after the 300 s window.
    assert k.decide(at(100.0), PoolState(7, 0, waiting=0)).replicas == 7
    assert k.decide(at(331.0), PoolState(7, 0, waiting=0)).replicas == 1


def test_llmd_token_scales_on_summed_kv_usage_one_pod_per_180_s() -> None:
    t = LlmdToken(BOUNDS)
    assert t.decide(at(0.0), PoolState(3, 0, kv_usage=2.4)).replicas == 3  # 2.4 / 0.8 = 3
    assert t.decide(at(5.0), PoolState(3, 0, kv_usage=3.9)).replicas == 4
    assert t.decide(at(100.0), PoolState(3, 1, kv_usage=3.9)).replicas == 4
    assert t.decide(at(100.0), PoolState(4, 0, kv_usage=4.0)).replicas == 4  # within 180 s
    assert t.decide(at(185.0), PoolState(4, 0, kv_usage=4.0)).replicas == 5


def test_llmd_slo_has_hysteresis_between_040_and_055() -> None:
    s = LlmdSlo(BOUNDS)
    assert s.decide(at(0.0, ttft_ratio_p90=0.6), PoolState(3, 0)).replicas == 4
    assert (
        s.decide(at(200.0, ttft_ratio_p90=0.5, tpot_ratio_p90=0.45), PoolState(4, 0)).replicas == 4
    )
    assert (
        s.decide(at(400.0, ttft_ratio_p90=0.3, tpot_ratio_p90=0.35), PoolState(4, 0)).replicas == 3
    )


def test_dynamo_plans_every_180_s_and_its_fast_loop_adds_a_pod() -> None:
    d = DynamoPlanner(BOUNDS, [PROFILE], 0.03)
    # 10 req/s over 20 / (200 * 0.03) = 3.33 req/s per engine -> 3.
    assert d.decide(at(0.0), PoolState(6, 0)).replicas == 3
    assert d.decide(at(100.0, arrival_rps=30.0), PoolState(3, 0)).replicas == 3  # not yet
    assert d.decide(at(180.0, arrival_rps=30.0), PoolState(3, 0)).replicas == 8  # 9 -> bound
    # Every engine over the ITL target: one more at once, between plans.
    over = PoolState(4, 0, step_s=(0.031, 0.04, 0.05, 0.032))
    assert d.decide(at(200.0), over).replicas == 5
    assert d.decide(at(205.0), dataclasses.replace(over, step_s=(0.02, 0.04))).replicas == 4


def test_dynamo_keeps_a_pool_the_smaller_one_would_fill_past_80_percent() -> None:
    d = DynamoPlanner(BOUNDS, [PROFILE], 0.03)
    # 8.5 req/s needs ceil(2.55) = 3 engines, but 2 engines would run at 8.5 / 6.67 > 80%...
    # of 3 (the current pool minus one): 8.5 > 0.8 * 2 * 3.33 = 5.33, so 4 stay 4.
    assert d.decide(at(0.0, arrival_rps=8.5), PoolState(4, 0)).replicas == 4


def test_every_name_builds_and_an_unknown_one_is_refused() -> None:
    for name in AUTOSCALERS:
        assert make_autoscaler(name, BOUNDS, [PROFILE], 0.03).name == name
    assert isinstance(make_autoscaler("disaggpool", BOUNDS, [PROFILE], 0.03), HeterogeneityScaler)
    with pytest.raises(ValueError, match="unknown autoscaler 'hpa'"):
        make_autoscaler("hpa", BOUNDS, [PROFILE], 0.03)
