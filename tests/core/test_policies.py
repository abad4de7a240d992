"""Each policy's choice on hand-built snapshots, the guard, fallbacks and the registry."""

from __future__ import annotations

import dataclasses
import random

import pytest

from disaggpool.core import costmodel
from disaggpool.core.contracts import (
    InstanceSnapshot,
    PoolSnapshot,
    RequestFeatures,
    SLOClass,
    TpotBudgets,
)
from disaggpool.core.hardware import builtin_profile
from disaggpool.core.policies.base import DecodeChoice, NoCapacityError
from disaggpool.core.policies.calibrated import median_measured_transfer
from disaggpool.core.policies.registry import POLICY_NAMES, PolicyOptions, make_policy
from disaggpool.core.profile import KVTransferModel

A40 = builtin_profile("a40-llama3-8b")
SLOW = A40.scaled(0.6, name="slow")
CHAT = SLOClass("chat", 1.7, 0.065)
REQ = RequestFeatures("r1", 1000, 200.0, 50.0, CHAT)


def decode(name: str, profile=A40, **kw) -> InstanceSnapshot:
    return InstanceSnapshot(name, "decode", profile=profile, **kw)


def prefill(name: str, profile=A40, **kw) -> InstanceSnapshot:
    return InstanceSnapshot(name, "prefill", profile=profile, **kw)


def pool(decodes, prefills=None) -> PoolSnapshot:
    return PoolSnapshot(0.0, prefills or [prefill("p0"), prefill("p1")], decodes)


def test_registry_builds_every_policy_and_rejects_unknown() -> None:
    ds = {"d0": A40}
    for name in POLICY_NAMES:
        assert make_policy(name, datasheet=ds).name == name
    with pytest.raises(KeyError, match="valid: round_robin"):
        make_policy("fastest")
    with pytest.raises(ValueError, match="datasheet"):
        make_policy("uncalibrated")


def test_round_robin_cycles_both_pools_independently() -> None:
    policy = make_policy("round_robin")
    snap = pool([decode("d0"), decode("d1"), decode("d2")])
    picks = [policy.route(REQ, snap, random.Random(0)) for _ in range(6)]
    assert [d.decode for d in picks] == ["d0", "d1", "d2"] * 2
    assert [d.prefill for d in picks] == ["p0", "p1"] * 3


def test_round_robin_takes_turns_over_the_decode_pods_it_binds_late() -> None:
    # Late binding asks `route` (whose decode pod is discarded) and then `route_decode`; the
    # kept decode pods must still take turns (a shared cursor skipped every second one).
    policy = make_policy("round_robin")
    snap = pool([decode("d0"), decode("d1")])
    kept = []
    for _ in range(4):
        arrival = policy.route(REQ, snap, random.Random(0))
        assert arrival.prefill is not None
        kept.append(
            policy.route_decode(
                DecodeChoice(REQ, snap, arrival.prefill, 0.5), random.Random(0)
            ).decode
        )
    assert kept == ["d0", "d1"] * 2


def test_least_loaded_counts_requests() -> None:
    snap = pool(
        [decode("d0", inflight=5), decode("d1", inflight=2), decode("d2", inflight=9)],
        [prefill("p0", inflight=3), prefill("p1", inflight=1)],
    )
    d = make_policy("least_loaded").route(REQ, snap, random.Random(0))
    assert (d.prefill, d.decode) == ("p1", "d1")


def test_length_counts_tokens_not_requests() -> None:
    snap = pool(
        [
            decode("d0", inflight=1, remaining_output_tokens=900.0),
            decode("d1", inflight=5, remaining_output_tokens=300.0),
        ],
        [
            prefill("p0", inflight=1, queued_tokens=8000),
            prefill("p1", inflight=4, queued_tokens=2000),
        ],
    )
    d = make_policy("length").route(REQ, snap, random.Random(0))
    assert (d.prefill, d.decode) == ("p1", "d1")


def test_random_and_p2c_are_seeded() -> None:
    snap = pool([decode(f"d{i}", inflight=i) for i in range(8)])
    for name in ("random", "p2c"):

        def draws(seed: int, policy: str = name) -> list[str]:
            rng = random.Random(seed)
            chooser = make_policy(policy)
            return [chooser.route(REQ, snap, rng).decode for _ in range(64)]

        # the same seed replays the same 64 choices; another seed gives another sequence, and the
        # choices really vary (a policy that ignored the RNG would fail one of the two)
        assert draws(7) == draws(7)
        assert draws(7) != draws(8)
        assert len(set(draws(7))) > 1


def test_p2c_takes_the_less_loaded_of_its_two_samples() -> None:
    snap = pool([decode("d0", inflight=0), decode("d1", inflight=10)])
    assert make_policy("p2c").route(REQ, snap, random.Random(3)).decode == "d0"


def test_calibrated_sends_less_work_to_a_slower_instance() -> None:
    # Same counts everywhere; d1 is 40% slower: the calibrated scorer sees it, counting does not.
    busy = {
        "running": 40,
        "kv_tokens_used": 60_000,
        "inflight": 40,
        "remaining_output_tokens": 4000.0,
    }
    snap = pool([decode("d0", **busy), decode("d1", profile=SLOW, **busy)])
    d = make_policy("calibrated").route(REQ, snap, random.Random(0))
    assert d.decode == "d0"
    assert d.predicted_ttft_s is not None and d.predicted_tpot_s is not None
    assert d.slo_feasible is True


def test_calibrated_protects_requests_it_would_push_over_their_slo() -> None:
    # d0 is faster but full of chat requests right at their TPOT target; d1 holds only code
    # requests with plenty of slack. A new chat request should go where it breaks nobody.
    # r_bar = 100 remaining tokens, growth 50 per sequence while r overlaps (COSTMODEL.md)
    before = A40.decode.step(60, 60_000 + 60 * 50)
    after = A40.decode.step(61, 61_000 + 61 * 50)
    tight = TpotBudgets.of([((before + after) / 2, 64, 60)])
    snap = pool(
        [
            decode(
                "d0",
                running=60,
                kv_tokens_used=60 * 1000,
                inflight=60,
                remaining_output_tokens=6000.0,
                tpot_budgets=tight,
            ),
            decode(
                "d1",
                running=70,
                kv_tokens_used=70 * 1000,
                inflight=70,
                remaining_output_tokens=7000.0,
                tpot_budgets=TpotBudgets.of([(0.2, 64, 70)]),
            ),
        ]
    )
    code = dataclasses.replace(REQ, slo=SLOClass("code", 3.5, 0.2))
    assert make_policy("calibrated").route(code, snap, random.Random(0)).decode == "d1"


def test_infeasible_everywhere_is_flagged() -> None:
    impossible = dataclasses.replace(REQ, slo=SLOClass("rt", 0.001, 0.001))
    d = make_policy("calibrated").route(
        impossible, pool([decode("d0"), decode("d1")]), random.Random(0)
    )
    assert d.slo_feasible is False


def test_scarcity_guard_bounds_piling_onto_the_cheapest_instance() -> None:
    # d0 is much faster, so greedy sends everything there; the guard caps its share.
    fast = A40.scaled(2.0, name="fast")
    snap = pool(
        [
            decode("d0", profile=fast, inflight=30),
            decode("d1", inflight=2),
            decode("d2", inflight=2),
        ]
    )
    greedy = make_policy("calibrated_greedy").route(REQ, snap, random.Random(0))
    guarded = make_policy("calibrated").route(REQ, snap, random.Random(0))
    assert greedy.decode == "d0"
    assert guarded.decode != "d0" and guarded.guarded


def test_uncalibrated_scores_with_the_datasheet_not_the_pods_profiles() -> None:
    busy = {
        "running": 40,
        "kv_tokens_used": 60_000,
        "inflight": 40,
        "remaining_output_tokens": 4000.0,
    }
    snap = pool([decode("d0", profile=SLOW, **busy), decode("d1", **busy)])
    ds = builtin_profile("a40-llama3-8b-datasheet")
    unc = make_policy("uncalibrated", datasheet={"d0": ds, "d1": ds, "p0": ds, "p1": ds})
    cal = make_policy("calibrated")
    assert cal.route(REQ, snap, random.Random(0)).decode == "d1"
    # identical datasheet constants and identical counts: the datasheet cannot tell them apart
    d = unc.route(REQ, snap, random.Random(0))
    assert d.policy == "uncalibrated"
    assert d.predicted_tpot_s < cal.route(REQ, snap, random.Random(0)).predicted_tpot_s


def test_missing_profiles_fall_back_and_say_so() -> None:
    trusted = pool([decode("d0"), decode("d1")])
    d = make_policy("calibrated").route(REQ, trusted, random.Random(0))
    assert (d.policy, d.fallback) == ("calibrated", None)
    untrusted = dataclasses.replace(A40, quality="poor")
    snap = pool([decode("d0"), decode("d1", profile=untrusted)])
    d = make_policy("calibrated").route(REQ, snap, random.Random(0))
    assert (d.policy, d.fallback) == ("calibrated", "median-profile")
    assert d.predicted_ttft_s is not None  # still scored with the cost model
    none = pool(
        [decode("d0", profile=None), decode("d1", profile=None)], [prefill("p0", profile=None)]
    )
    d = make_policy("calibrated").route(REQ, none, random.Random(0))
    assert (d.policy, d.fallback) == ("calibrated", "least-loaded")
    assert d.predicted_ttft_s is None


def linked(name: str, k0: float, gbps: float, quality: str = "good", measured: bool = True):
    """A40 behind a KV link of `k0` seconds + `gbps` GB/s; `measured=False`: the probe's defaults
    written without a peer, marked unmeasured."""
    kv = KVTransferModel(k0, A40.kv_transfer.bytes_per_token, gbps * 1e9)
    unmeasured = () if measured else ("kv_transfer",)
    return dataclasses.replace(
        A40, name=name, kv_transfer=kv, quality=quality, unmeasured=unmeasured
    )


def test_median_measured_transfer_is_a_trusted_measured_links_model() -> None:
    d0, d1, d2 = linked("d0", 0.003, 12), linked("d1", 0.005, 8), linked("d2", 0.001, 30)
    # Ordered by the time of a 1024-token prompt: d2 (5.5 ms), d0 (14 ms), d1 (22 ms).
    assert median_measured_transfer([d1, d2, d0]) is d0.kv_transfer
    assert median_measured_transfer([d1, d2]) is d1.kv_transfer  # even: the upper, as profiles
    unmeasured = linked("dx", 0.002, 20, measured=False)
    poor = linked("dp", 0.050, 1, quality="poor")
    assert median_measured_transfer([unmeasured, poor, None]) is None
    assert median_measured_transfer([unmeasured, poor, d2]) is d2.kv_transfer


def test_an_unmeasured_kv_transfer_is_priced_with_the_pools_measured_median() -> None:
    """Issue #14: defaults are not calibration. `dx` was probed without a peer; the pool's
    trusted pods measured three links (median 3 ms + 12 GB/s, that of d0), and a poor profile's
    link is not counted. The other pods are down: the median is of the pool, not only of the
    pods healthy now, and `dx` is the only choice, so the prediction shows what priced it."""
    dx = linked("dx", 0.002, 20, quality="fair", measured=False)
    others = [
        linked("d0", 0.003, 12),
        linked("d1", 0.005, 8),
        linked("d2", 0.001, 30),
        linked("d3", 0.050, 1, quality="poor"),
    ]
    decodes = [decode("dx", dx)] + [decode(p.name, p, healthy=False) for p in others]
    policy = make_policy("calibrated")
    ready = costmodel.prefill_ready_time(REQ, prefill("p0"), A40)

    def ttft(profile) -> float:
        return costmodel.decode_estimate(REQ, decodes[0], profile, ready).ttft_s

    with_median = dataclasses.replace(dx, kv_transfer=others[0].kv_transfer)
    d = policy.route(REQ, pool(decodes), random.Random(0))
    assert (d.decode, d.fallback) == ("dx", None)
    assert d.predicted_ttft_s == pytest.approx(ttft(with_median))
    assert d.predicted_ttft_s > ttft(dx) + 0.005  # the slower measured link, not the defaults
    again = policy.route(REQ, pool(decodes), random.Random(0))  # the cached stand-in
    assert again.predicted_ttft_s == d.predicted_ttft_s
    late = policy.route_decode(DecodeChoice(REQ, pool(decodes), "p0", ready), random.Random(0))
    assert late.predicted_ttft_s == pytest.approx(
        costmodel.decode_estimate(REQ, decodes[0], with_median, ready, bound_late=True).ttft_s
    )
    # Nobody measured the link: the defaults are all there is.
    alone = policy.route(REQ, pool([decode("dx", dx)]), random.Random(0))
    assert alone.predicted_ttft_s == pytest.approx(ttft(dx))


def test_unhealthy_instances_are_never_chosen_and_none_left_raises() -> None:
    snap = pool([decode("d0", healthy=False), decode("d1")])
    for name in POLICY_NAMES:
        policy = make_policy(name, datasheet={"d0": A40, "d1": A40, "p0": A40, "p1": A40})
        for _ in range(4):
            assert policy.route(REQ, snap, random.Random(1)).decode == "d1"
    dead = pool([decode("d0", healthy=False)])
    with pytest.raises(NoCapacityError):
        make_policy("calibrated").route(REQ, dead, random.Random(0))


def test_pd_decider_prefills_on_a_decode_instance_only_when_that_saves_the_slo() -> None:
    """A burst has queued 40k prompt tokens on both prefill instances: remotely the request
    cannot meet its TTFT (about 6 s of queue), on an idle decode instance it can."""
    queued = {"queued": 40, "queued_tokens": 40_000, "queued_sq_tokens": 40 * 1000.0**2}
    busy = pool([decode("d0"), decode("d1")], [prefill("p0", **queued), prefill("p1", **queued)])
    plain = make_policy("calibrated").route(REQ, busy, random.Random(0))
    assert plain.prefill in ("p0", "p1") and plain.slo_feasible is False
    local = make_policy("calibrated", options=PolicyOptions(pd_decider=True))
    d = local.route(REQ, busy, random.Random(0))
    assert d.prefill is None and d.decode in ("d0", "d1") and d.slo_feasible is True
    # with the prefill pool idle the two legs are cheaper: nothing changes
    idle = pool([decode("d0"), decode("d1")])
    assert local.route(REQ, idle, random.Random(0)).prefill in ("p0", "p1")


def test_the_local_path_spends_only_decode_kv_no_routed_request_will_claim() -> None:
    """The same burst; the 80 queued prompts are still unbound and will claim decode KV when
    their prefill answers. While the decode pool can hold them and this request, it is
    prefilled locally; once their claim leaves less than its own prompt and output, it waits
    in the prefill queue like them instead of taking the KV they need."""
    queued = {"queued": 40, "queued_tokens": 40_000, "queued_sq_tokens": 40 * 1000.0**2}
    prefills = [prefill("p0", **queued), prefill("p1", **queued)]
    policy = make_policy("calibrated", options=PolicyOptions(pd_decider=True))
    spare = 2 * A40.kv_capacity_tokens * (1.0 - costmodel.KV_HEADROOM)
    need = REQ.prompt_tokens + REQ.predicted_output_tokens
    fits = PoolSnapshot(0.0, prefills, [decode("d0"), decode("d1")], spare - need)
    assert policy.route(REQ, fits, random.Random(0)).prefill is None
    owed = PoolSnapshot(0.0, prefills, [decode("d0"), decode("d1")], spare - need + 1.0)
    assert policy.route(REQ, owed, random.Random(0)).prefill in ("p0", "p1")


def test_threshold_decider_wraps_any_policy() -> None:
    policy = make_policy("round_robin", options=PolicyOptions(local_prefill_below=1001))
    snap = pool([decode("d0"), decode("d1")])
    assert policy.route(REQ, snap, random.Random(0)).prefill is None  # 1000 < 1001
    longer = dataclasses.replace(REQ, prompt_tokens=1001)
    assert policy.route(longer, snap, random.Random(0)).prefill == "p1"  # the cursor moved on
    with pytest.raises(ValueError, match="pd_decider"):
        make_policy("length", options=PolicyOptions(pd_decider=True))
    with pytest.raises(ValueError, match="local_prefill_below"):
        PolicyOptions(local_prefill_below=-1)


def test_route_decode_keeps_the_prefill_and_prices_the_elapsed_time() -> None:
    """Late binding: the prefill leg on p1 returned 1.5 s after arrival; the decode choice sees
    the state of now and a TTFT that already carries those 1.5 s."""
    snap = pool([decode("d0", inflight=6, running=6), decode("d1")])
    for name in POLICY_NAMES:
        policy = make_policy(name, datasheet={"d0": A40, "d1": A40, "p0": A40, "p1": A40})
        d = policy.route_decode(DecodeChoice(REQ, snap, "p1", 1.5), random.Random(0))
        assert d.prefill == "p1" and d.decode in ("d0", "d1")
        if d.predicted_ttft_s is not None:
            assert d.predicted_ttft_s > 1.5
    assert (
        make_policy("calibrated")
        .route_decode(DecodeChoice(REQ, snap, "p1", 1.5), random.Random(0))
        .decode
        == "d1"
    )
    with pytest.raises(NoCapacityError, match="p9"):
        make_policy("length").route_decode(DecodeChoice(REQ, snap, "p9", 0.0), random.Random(0))


def test_study_weighted_scores_backlog_service_and_queue_in_its_own_units() -> None:
    """The study's form: equal boards, one with 3,000 tokens of backlog: it loses; the same
    backlog with a tighter class weighs more (sigma), so the other instance wins by more."""
    policy = make_policy("study_weighted")
    snap = pool(
        [decode("d0", remaining_output_tokens=3000.0, running=10), decode("d1", running=10)]
    )
    assert policy.route(REQ, snap, random.Random(0)).decode == "d1"
    # prefill: the work (queued + own tokens) times the board's seconds per prompt token
    snap = pool([decode("d0")], [prefill("p0", queued_tokens=4000), prefill("p1", profile=SLOW)])
    assert policy.route(REQ, snap, random.Random(0)).prefill == "p1"  # slower, but idle
    # the datasheet twin scores with the datasheet's constants, whatever the instances believe
    ds = builtin_profile("a40-llama3-8b-datasheet")
    twin = make_policy("study_weighted_datasheet", datasheet={"d0": ds, "p0": ds, "p1": ds})
    assert twin.route(REQ, snap, random.Random(0)).policy == "study_weighted_datasheet"
    with pytest.raises(ValueError, match="datasheet"):
        make_policy("study_weighted_datasheet")


def test_a_sheddable_request_that_would_miss_everywhere_is_shed() -> None:
    """Only a class marked sheddable is shed, only when even the best placement misses its own
    SLO, and only by a policy that priced every instance."""
    queued = {"queued": 40, "queued_tokens": 40_000, "queued_sq_tokens": 40 * 1000.0**2}
    busy = pool(
        [decode("d0", running=250, kv_tokens_used=180_000), decode("d1", running=250)],
        [prefill("p0", **queued), prefill("p1", **queued)],
    )
    hopeless = dataclasses.replace(REQ, slo=SLOClass("batch", 0.5, 0.02, sheddable=True))
    assert make_policy("calibrated").route(hopeless, busy, random.Random(0)).shed
    kept = dataclasses.replace(hopeless, slo=SLOClass("batch", 0.5, 0.02))
    d = make_policy("calibrated").route(kept, busy, random.Random(0))
    assert not d.shed and d.slo_feasible is False
    fine = dataclasses.replace(REQ, slo=SLOClass("batch", 60.0, 1.0, sheddable=True))
    assert not make_policy("calibrated").route(fine, busy, random.Random(0)).shed
    for name in ("round_robin", "least_loaded", "length", "p2c"):
        assert not make_policy(name).route(hopeless, busy, random.Random(0)).shed


def test_calibrated_avoids_a_preemption_risk_its_completion_time_would_take() -> None:
    # A step time nearly blind to context, so the completion time favours the small batch on the
    # nearly full instance; the chance of running out of KV there counts as an expected miss.
    flat = dataclasses.replace(A40, decode=dataclasses.replace(A40.decode, d2=1e-9))
    full = decode(
        "full", flat, running=2, inflight=2, kv_tokens_used=185_150, remaining_output_tokens=200.0
    )
    busy = decode(
        "busy", flat, running=40, inflight=40, kv_tokens_used=40_000, remaining_output_tokens=4000.0
    )
    risky = costmodel.decode_estimate(REQ, full, flat, 0.0)
    roomy = costmodel.decode_estimate(REQ, busy, flat, 0.0)
    assert risky.act_s < roomy.act_s and 0.05 < risky.preempt_p < 0.95 and roomy.preempt_p == 0
    assert max(risky.tpot_s, roomy.tpot_s) <= CHAT.tpot_s
    policy = make_policy("calibrated_greedy", options=PolicyOptions(pd_decider=False))
    assert policy.route(REQ, pool([full, busy]), random.Random(0)).decode == "busy"


def test_priority_scheduling_asks_priority_1_for_a_request_late_anyway() -> None:
    """Only with the switch, only when even the chosen placement misses the TTFT target; and
    the work of earlier late requests is not ahead of an on-time one (it passes them)."""
    fine = pool([decode("d0"), decode("d1")])
    late_work = {"queued": 30, "queued_tokens": 30_000, "queued_sq_tokens": 30 * 1000.0**2}
    yielded = {**late_work, "yielded_tokens": 30_000, "yielded_sq_tokens": 30 * 1000.0**2}
    behind_late = pool([decode("d0"), decode("d1")], [prefill("p0", **yielded)])
    behind_fcfs = pool([decode("d0"), decode("d1")], [prefill("p0", **late_work)])
    on = make_policy("calibrated", options=PolicyOptions(priority_scheduling=True))
    off = make_policy("calibrated")
    rng = random.Random(0)
    assert on.route(REQ, fine, rng).priority == 0
    assert on.route(REQ, behind_late, rng).priority == 0  # passes the late ones
    d = on.route(REQ, behind_fcfs, rng)
    assert d.priority == 1 and d.predicted_ttft_s is not None and d.predicted_ttft_s > CHAT.ttft_s
    assert off.route(REQ, behind_fcfs, rng).priority == 0
    with pytest.raises(ValueError, match="priority_scheduling"):
        make_policy("length", options=PolicyOptions(priority_scheduling=True))
