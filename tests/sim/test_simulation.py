"""End-to-end simulator runs: one per policy, conservation, determinism, physics sanity."""

from __future__ import annotations

import json
import random

import pytest

from disaggpool.core.contracts import SLOClass
from disaggpool.core.hardware import builtin_profile
from disaggpool.core.policies.registry import POLICY_NAMES, PolicyOptions, make_policy
from disaggpool.core.predictor import make_predictor
from disaggpool.core.router import Request
from disaggpool.engine.decode import DecodeEngine
from disaggpool.engine.prefill import PrefillEngine
from disaggpool.sim import workload
from disaggpool.sim.cluster import InstanceSpec, RouterOptions, Simulation
from disaggpool.sim.metrics import summarize
from disaggpool.sim.pools import build_pool
from disaggpool.sim.router import RouterReplica
from disaggpool.sim.runner import RunSpec, execute

A40 = builtin_profile("a40-llama3-8b")
DATASHEET = builtin_profile("a40-llama3-8b-datasheet")
SLO = {"chat": SLOClass("chat", 1.7, 0.065), "code": SLOClass("code", 3.5, 0.133)}


def trace(n: int = 600, rate: float = 12.0, seed: int = 3):
    rng = random.Random(seed)
    lengths = workload.lognormal_lengths(
        n,
        rng,
        prompt_mean=1100,
        output_mean=180,
        sigma=1.0,
        slo_classes=[("chat", 0.7), ("code", 0.3)],
    )
    lengths = workload.clip_lengths(lengths, 7000, 1000)
    return workload.with_arrivals(lengths, workload.gamma_arrivals(rate, 2.0, n, rng))


def simulate(policy: str, instances, reqs, seed: int = 1):
    sim = Simulation(
        instances,
        policies=[make_policy(policy, datasheet={i.name: DATASHEET for i in instances})],
        predictor=make_predictor("online"),
        slo_classes=SLO,
        default_class="chat",
        seed=seed,
    )
    return sim.run(reqs)


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_every_policy_completes_every_request_consistently(policy: str) -> None:
    reqs = trace()
    outcome = simulate(policy, build_pool(3, 4, A40, seed=1), reqs)
    assert len(outcome.requests) == len(reqs)
    assert not outcome.rejected
    for r in outcome.requests:
        assert r.arrival <= r.prefill_done <= r.first_token <= r.finish
        assert r.prefill_instance.startswith("prefill-") and r.decode_instance.startswith("decode-")
    served = outcome.served
    assert sum(v for k, v in served.items() if k.startswith("prefill")) == len(reqs)
    assert sum(v for k, v in served.items() if k.startswith("decode")) == len(reqs)
    summary = summarize(outcome, SLO)
    assert 0.0 <= summary["goodput"] <= 1.0
    assert summary["completed"] == len(reqs)


def test_ttft_includes_prefill_transfer_and_a_decode_step_when_idle() -> None:
    from disaggpool.formats.traces import TraceRequest

    one = [TraceRequest(0.0, 2000, 5, "chat")]
    instances = [InstanceSpec("p", "prefill", A40, A40), InstanceSpec("d", "decode", A40, A40)]
    sim = Simulation(
        instances,
        policies=[make_policy("round_robin")],
        predictor=make_predictor("oracle"),
        slo_classes=SLO,
        default_class="chat",
        seed=1,
        jitter=0.0,
    )
    (r,) = sim.run(one).requests
    prefill = A40.prefill.p0 + A40.prefill.p1 * 2000 + A40.prefill.p2 * 2000**2
    expected = prefill + A40.kv_transfer.time(2000) + A40.decode.step(1, 2000)
    assert r.ttft == pytest.approx(expected)


def test_more_load_means_less_goodput() -> None:
    instances = build_pool(2, 2, A40, seed=1)
    light = summarize(simulate("round_robin", instances, trace(rate=3.0)), SLO)["goodput"]
    heavy = summarize(simulate("round_robin", instances, trace(rate=30.0)), SLO)["goodput"]
    assert light > heavy


def test_calibrated_sends_less_work_to_a_slower_decode_instance() -> None:
    slow = A40.scaled(0.6, name="decode-3")
    instances = [
        *build_pool(3, 3, A40, seed=1, speed_sigma=0.0, fit_error=0.0),
        InstanceSpec("decode-3", "decode", slow, slow),
    ]
    reqs = trace(n=800, rate=14.0)
    served = {p: simulate(p, instances, reqs).served for p in ("round_robin", "calibrated")}
    assert served["round_robin"]["decode-3"] == 200
    fast_mean = sum(served["calibrated"][f"decode-{i}"] for i in range(3)) / 3
    assert served["calibrated"]["decode-3"] < 0.9 * fast_mean


def test_same_seed_same_bytes_different_seed_different_result() -> None:
    def row(seed: int) -> str:
        spec = RunSpec(
            experiment="run",
            trace_name="t",
            trace=tuple(trace(n=300)),
            instances=tuple(build_pool(2, 3, A40, seed=seed)),
            slo_classes=tuple(SLO.values()),
            policy="calibrated",
            seed=seed,
        )
        return json.dumps(execute(spec), sort_keys=True)

    assert row(4) == row(4)
    assert row(4) != row(5)


def test_rejected_requests_leave_no_trace_in_the_router_accounting() -> None:
    from disaggpool.formats.traces import TraceRequest

    reqs = list(trace(n=200, rate=8.0))
    reqs[10] = TraceRequest(reqs[10].arrival_s, 9000, 50, "chat")  # longer than max_model_len
    reqs[50] = TraceRequest(reqs[50].arrival_s, 12000, 50, "code")
    instances = build_pool(2, 2, A40, seed=1)
    sim = Simulation(
        instances,
        policies=[make_policy("calibrated")],
        predictor=make_predictor("online"),
        slo_classes=SLO,
        default_class="chat",
        seed=1,
    )
    outcome = sim.run(reqs)
    assert len(outcome.rejected) == 2
    assert sum(1 for r in outcome.requests if r.finish >= 0) == 198
    (router,) = sim.routers
    assert router.ledger.entries == {}
    accounts = router.ledger.accounts.values()
    assert {(a.inflight, a.queued, a.queued_tokens, a.decoding) for a in accounts} == {(0, 0, 0, 0)}
    assert all(not a.targets for a in accounts)
    assert summarize(outcome, SLO)["rejected"] == 2


def _run(
    policy: str,
    options: PolicyOptions,
    router: RouterOptions,
    reqs,
    replicas: int = 1,
    scheduling: str = "fcfs",
):
    instances = build_pool(2, 4, A40, seed=1)
    sim = Simulation(
        instances,
        policies=[make_policy(policy, options=options) for _ in range(replicas)],
        predictor=make_predictor("online"),
        slo_classes=SLO,
        default_class="chat",
        seed=1,
        router=router,
        scheduling=scheduling,
    )
    return sim, sim.run(reqs)


@pytest.mark.parametrize(
    ("options", "router", "replicas"),
    [
        (PolicyOptions(), RouterOptions(late_binding=True), 1),
        (PolicyOptions(), RouterOptions(scrape_interval_s=1.0, replicas=3), 3),
        (PolicyOptions(pd_decider=True), RouterOptions(), 1),
        (PolicyOptions(local_prefill_below=600), RouterOptions(scrape_interval_s=0.5), 1),
    ],
    ids=["late", "stale-3-replicas", "pd_decider", "local<600"],
)
def test_router_options_serve_every_request_and_leave_clean_books(
    options: PolicyOptions, router: RouterOptions, replicas: int
) -> None:
    reqs = trace(n=500, rate=14.0)
    sim, outcome = _run("calibrated", options, router, reqs, replicas)
    done = [r for r in outcome.requests if r.finish >= 0]
    assert len(done) == len(reqs)
    for r in done:
        assert r.arrival <= r.first_token <= r.finish
        assert r.decode_instance.startswith("decode-")
    local = [r for r in done if not r.prefill_instance]
    if options.pd_decider or options.local_prefill_below:
        assert 0 < len(local) < len(done)
        assert all(r.prefill_done < 0 for r in local)  # no prefill leg, no prefill pod
        if options.local_prefill_below:
            assert all(r.prompt_tokens < 600 for r in local)
    else:
        assert not local
    assert len(sim.routers) == replicas
    for router_replica in sim.routers:
        assert router_replica.ledger.entries == {}
        for acc in router_replica.ledger.accounts.values():
            assert (acc.inflight, acc.queued, acc.queued_tokens, acc.local_tokens) == (0, 0, 0, 0)


def test_late_binding_decides_on_the_state_after_prefill() -> None:
    """With late binding every decode choice happens when its prefill is done, so every request
    is still routed, and the simulation stays deterministic."""
    reqs = trace(n=300, rate=14.0)
    a = _run("calibrated", PolicyOptions(), RouterOptions(late_binding=True), reqs)[1]
    b = _run("calibrated", PolicyOptions(), RouterOptions(late_binding=True), reqs)[1]
    assert [r.decode_instance for r in a.requests] == [r.decode_instance for r in b.requests]
    early = _run("calibrated", PolicyOptions(), RouterOptions(), reqs)[1]
    assert [r.decode_instance for r in a.requests] != [r.decode_instance for r in early.requests]


def test_a_router_without_books_sees_the_last_scrape_alone() -> None:
    """Between two scrapes a replica with its own books sees the requests it routed; one
    without sees the gauges alone (what a router keeping no books decides on), while it still
    keeps the books for the reports."""
    prefill, decode = PrefillEngine("p0", A40), DecodeEngine("d0", A40)
    believed = {"p0": A40, "d0": A40}
    req = Request("r0", 500, SLO["chat"], true_output_tokens=50)
    seen = {}
    for books in (True, False):
        replica = RouterReplica(
            [prefill],
            [decode],
            believed,
            policy=make_policy("least_loaded"),
            predictor=make_predictor("oracle"),
            rng=random.Random(0),
            scrape_interval_s=10.0,
            own_books=books,
            late_binding=True,
        )
        replica.observe(0.0)  # the scrape at 0: an idle pool
        assert replica.router.route(req, 0.0).late  # late binding: not bound yet
        replica.observe(1.0)
        snap = replica.router.snapshot(1.0)
        seen[books] = (snap.prefill[0].queued_tokens, snap.unbound_kv_tokens)
        assert "r0" in replica.ledger.entries
    assert seen == {True: (500, 550.0), False: (0, 0.0)}


def test_a_router_without_books_still_serves_every_request() -> None:
    """Whole runs: without books every request is still served and the books end clean."""
    reqs = trace(n=300, rate=14.0)
    blind = RouterOptions(scrape_interval_s=1.0, own_books=False)
    sim, outcome = _run("least_loaded", PolicyOptions(), blind, reqs)
    assert all(r.finish >= 0 for r in outcome.requests)
    assert sim.routers[0].ledger.entries == {}


def test_router_options_are_checked() -> None:
    with pytest.raises(ValueError, match="replicas"):
        RouterOptions(replicas=0)
    with pytest.raises(ValueError, match="scrape_interval_s"):
        RouterOptions(scrape_interval_s=-1.0)
    with pytest.raises(ValueError, match="policy objects"):
        Simulation(
            build_pool(1, 1, A40, seed=1),
            policies=[make_policy("length")],
            predictor=make_predictor("online"),
            slo_classes=SLO,
            default_class="chat",
            seed=1,
            router=RouterOptions(replicas=2),
        )


def test_shedding_refuses_only_sheddable_requests_and_counts_them_missed() -> None:
    """At twice the load a 2+4 pool carries, a sheddable class is shed where it would be late;
    shed requests count against goodput and the others do better for it."""
    reqs = trace(n=500, rate=40.0)
    classes = {
        "chat": SLOClass("chat", 1.7, 0.065, sheddable=True),
        "code": SLOClass("code", 3.5, 0.133),
    }
    outcomes = {}
    for label, slo in (("kept", SLO), ("shed", classes)):
        sim = Simulation(
            build_pool(2, 4, A40, seed=1),
            policies=[make_policy("calibrated", options=PolicyOptions(pd_decider=True))],
            predictor=make_predictor("online"),
            slo_classes=slo,
            default_class="chat",
            seed=1,
        )
        outcomes[label] = (sim.run(reqs), slo)
    shed_outcome, slo = outcomes["shed"]
    assert shed_outcome.shed and all(r.slo_class == "chat" for r in shed_outcome.shed)
    assert all(r.finish < 0 and r.first_token < 0 for r in shed_outcome.shed)
    summary = summarize(shed_outcome, slo)
    assert summary["misses"]["shed"] == len(shed_outcome.shed) == summary["shed"]
    met = sum(
        1 for r in shed_outcome.requests if r.finish >= 0 and slo[r.slo_class].met(r.ttft, r.tpot)
    )
    assert summary["goodput"] == pytest.approx(met / len(reqs), abs=1e-6)
    kept = summarize(*outcomes["kept"])
    assert kept["misses"]["shed"] == 0
    assert summary["classes"]["code"]["goodput"] >= kept["classes"]["code"]["goodput"]


def test_priority_scheduling_lets_on_time_requests_pass_the_late_ones() -> None:
    """Requests the policy predicts late get priority 1; on engines scheduling by priority an
    on-time request routed later to the same prefill instance is prefilled before one of them,
    and fewer requests miss their TTFT than with FCFS engines."""
    reqs = trace(n=500, rate=16.0)
    outcomes = {}
    for on in (False, True):
        sim, outcomes[on] = _run(
            "calibrated",
            PolicyOptions(priority_scheduling=on),
            RouterOptions(),
            reqs,
            scheduling="priority" if on else "fcfs",
        )
        assert all(e.scheduling == ("priority" if on else "fcfs") for e in sim.prefill)
    late = [r for r in outcomes[True].requests if r.priority == 1]
    assert late and all(r.priority == 0 for r in outcomes[False].requests)
    passed = [
        (a, b)
        for a in late
        for b in outcomes[True].requests
        if b.priority == 0
        and b.prefill_instance == a.prefill_instance != ""
        and b.arrival > a.arrival
        and 0 <= b.prefill_done < a.prefill_done
    ]
    assert passed
    ttft_missed = {
        on: sum(1 for r in o.requests if r.ttft > SLO[r.slo_class].ttft_s)
        for on, o in outcomes.items()
    }
    assert ttft_missed[True] < ttft_missed[False], ttft_missed
