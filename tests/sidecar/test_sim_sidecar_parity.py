"""One router, everywhere: fed the same events, the sidecar decides what the simulator decided.

Both run `core.router.Router`; what this checks is their adapters: that the simulator
(`sim.cluster`, `sim.router`) and the sidecar (`sidecar.service`, `sidecar.state`) hand the router
the same requests and reports, and do what it decided. A simulation runs with its router replica
recording, in order, every event a real router would see: each scrape (the gauges it read), each
routed request (and the decision), each prefill leg answered, each streamed-token count, each
late decode binding, each end. Those events are then replayed into a sidecar `RoutingService`
(same policy name, options and seed; a clock set to the event's time; the pods' believed profiles
installed), through its public API: `route`, `bind_decode`, `prefilled`, `progress`, `finished`,
`failed`, and the pool state's `scraped`. Every decision must come out the same, for every
policy, at arrival and with late binding, with the calibrated P/D decider on and off.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterable
from typing import Any

import pytest

from disaggpool.core.contracts import SLOClass
from disaggpool.core.hardware import builtin_profile
from disaggpool.core.ledger import Entry, Gauges
from disaggpool.core.policies.registry import POLICY_NAMES, PolicyOptions, make_policy
from disaggpool.core.predictor import make_predictor
from disaggpool.core.router import Placement, Request
from disaggpool.formats.traces import TraceRequest
from disaggpool.sidecar.config import Member, SidecarConfig
from disaggpool.sidecar.service import RoutingService, Shed
from disaggpool.sim.cluster import InstanceSpec, RouterOptions, Simulation
from disaggpool.sim.pools import build_pool
from disaggpool.sim.router import RouterReplica

QWEN = builtin_profile("a40-qwen2.5-3b")
DATASHEET = builtin_profile("a40-qwen2.5-3b-datasheet")
SLO = SLOClass("chat", 0.3, 0.05)

Event = tuple[Any, ...]


def record(replica: RouterReplica, log: list[Event]) -> None:
    """Write down every event the replica's router is told or reads, in order (its methods are
    wrapped on the instances the simulation calls)."""
    router, pods = replica.router, replica.pods
    scraped, route, bind = pods.scraped, router.route, router.bind_decode
    streamed, prefilled = router.streamed, router.prefilled
    finished, forget = router.finished, router.forget

    def on_scraped(name: str, gauges: Gauges, now: float) -> None:
        log.append(("scraped", now, name, gauges))
        scraped(name, gauges, now)

    def on_route(request: Request, now: float, **kwargs: Any) -> Placement:
        placed = route(request, now, **kwargs)
        d = placed.decision
        decode = None if placed.late else d.decode
        log.append(("routed", now, request.request_id, request.prompt_tokens, d.prefill, decode,
                    d.priority))  # fmt: skip
        return placed

    def on_bind(request_id: str, now: float) -> Any:
        decision = bind(request_id, now)
        log.append(("bound", now, request_id, decision.decode if decision else None))
        return decision

    def on_streamed(counts: Iterable[tuple[str, int, float | None]], now: float) -> None:
        counts = list(counts)
        for request_id, generated, first_token_at in counts:
            entry = replica.ledger.entries.get(request_id)
            if entry is not None and generated > entry.generated:  # what the router counts
                log.append(("progress", now, request_id, generated, first_token_at))
        streamed(counts, now)

    def on_prefilled(request_id: str) -> bool:
        log.append(("prefilled", request_id))
        return prefilled(request_id)

    def on_finished(request_id: str, output_tokens: int) -> Entry | None:
        log.append(("finished", request_id, output_tokens, True))
        return finished(request_id, output_tokens)

    def on_forget(request_id: str) -> Entry | None:
        log.append(("finished", request_id, 0, False))
        return forget(request_id)

    pods.scraped = on_scraped  # type: ignore[method-assign]
    router.route = on_route  # type: ignore[method-assign]
    router.bind_decode = on_bind  # type: ignore[method-assign]
    router.streamed = on_streamed  # type: ignore[method-assign]
    router.prefilled = on_prefilled  # type: ignore[method-assign]
    router.finished = on_finished  # type: ignore[method-assign]
    router.forget = on_forget  # type: ignore[method-assign]


def trace(n: int, seed: int, rate: float = 14.0) -> list[TraceRequest]:
    rng = random.Random(seed)
    t = 0.0
    out = []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(TraceRequest(t, rng.randint(20, 2000), rng.randint(5, 300), "chat"))
    return out


def simulate(
    specs: list[InstanceSpec], policy: str, options: PolicyOptions, late: bool
) -> list[Event]:
    log: list[Event] = []
    datasheet = {s.name: DATASHEET for s in specs}
    sim = Simulation(
        specs,
        policies=[make_policy(policy, datasheet=datasheet, options=options)],
        predictor=make_predictor("online"),
        slo_classes={"chat": SLO},
        default_class="chat",
        seed=11,
        router=RouterOptions(late_binding=late),
        scheduling="priority" if options.priority_scheduling else "fcfs",
    )
    (replica,) = sim.routers
    record(replica, log)
    # Priorities are 1 only for requests predicted late, and the P/D decider prefills locally only
    # to save an SLO: load the pool until some are late.
    sim.run(trace(300, seed=5, rate=100.0 if options.pd_decider else 14.0))
    return log


def replay(
    log: list[Event], specs: list[InstanceSpec], policy: str, options: PolicyOptions, late: bool
) -> tuple[int, int]:
    """Feed `log` to a RoutingService; returns (decisions compared, decisions that differ)."""
    members = tuple(Member(s.name, s.role, f"http://{s.name}") for s in specs)  # type: ignore[arg-type]
    config = SidecarConfig(
        policy=policy,
        model="m",
        slo_classes=(SLO,),
        static_members=members,
        decode_binding="late" if late else "arrival",
        options=options,
    )
    now = [0.0]
    datasheet = {s.name: DATASHEET for s in specs}
    service = RoutingService(
        config,
        policy=make_policy(policy, datasheet=datasheet, options=options),
        seed=11,
        clock=lambda: now[0],
    )
    service.state.set_members(members)
    for s in specs:
        service.state.set_profile(s.name, s.believed_profile, 0.0)
    compared = differ = 0
    for event in log:
        kind = event[0]
        if kind == "scraped":
            _, t, name, gauges = event
            now[0] = t
            service.state.scraped(name, gauges, t)
        elif kind == "progress":
            _, t, rid, produced, first_token_at = event
            now[0] = t
            service.progress(rid, produced, first_token_at)
        elif kind == "routed":
            _, t, rid, prompt, prefill, decode, priority = event
            now[0] = t
            routed = service.route(rid, prompt, bind_late=True)  # as the front door does
            got = (
                routed.prefill.name if routed.prefill else None,
                routed.decode.name if routed.decode else None,
                routed.decision.priority,
            )
            compared += 1
            differ += got != (prefill, decode, priority)
        elif kind == "bound":
            _, t, rid, decode = event
            now[0] = t
            routed = service.bind_decode(rid)
            compared += 1
            differ += routed.decode is None or routed.decode.name != decode
        elif kind == "prefilled":
            service.prefilled(event[1])
        elif kind == "finished":
            _, rid, output, done = event
            if done:
                service.finished(rid, output, 0.1, 0.01)
            else:
                service.failed(rid, "refused by an engine")
    assert service.inflight == 0
    return compared, differ


CASES = [(name, PolicyOptions(), False) for name in POLICY_NAMES] + [
    ("length", PolicyOptions(), True),
    ("calibrated", PolicyOptions(), True),
    ("calibrated", PolicyOptions(pd_decider=True), True),
    ("calibrated", PolicyOptions(pd_decider=True), False),
    ("calibrated", PolicyOptions(pd_decider=True, priority_scheduling=True), False),
    ("round_robin", PolicyOptions(local_prefill_below=300), False),
]


@pytest.mark.parametrize(
    ("policy", "options", "late"),
    CASES,
    ids=[
        "-".join(
            [p, "late" if late else "arrival"]
            + (["pd_decider"] if o.pd_decider else [])
            + ([f"local<{o.local_prefill_below}"] if o.local_prefill_below else [])
            + (["priority"] if o.priority_scheduling else [])
        )
        for p, o, late in CASES
    ],
)
def test_the_sidecar_decides_what_the_simulator_decided(
    policy: str, options: PolicyOptions, late: bool
) -> None:
    specs = build_pool(2, 4, QWEN, seed=4)
    log = simulate(specs, policy, options, late)
    routed = sum(1 for e in log if e[0] == "routed")
    assert routed == 300
    locals_ = sum(1 for e in log if e[0] == "routed" and e[4] is None)
    if late:  # every request sent to the prefill pool is bound when its leg answers
        assert sum(1 for e in log if e[0] == "bound") == routed - locals_
    if options.pd_decider or options.local_prefill_below:
        assert 0 < locals_ < routed  # the decider took both paths in this trace
    if options.priority_scheduling:
        late_ones = sum(1 for e in log if e[0] == "routed" and e[6] == 1)
        assert 0 < late_ones < routed  # some were predicted late, so priorities are compared
    compared, differ = replay(log, specs, policy, options, late)
    assert compared >= 300
    assert differ == 0, f"{differ} of {compared} decisions differ"


def test_a_late_bound_request_books_its_decode_pod_only_when_bound() -> None:
    specs = build_pool(1, 2, QWEN, seed=4)
    members = tuple(Member(s.name, s.role, f"http://{s.name}") for s in specs)  # type: ignore[arg-type]
    config = SidecarConfig(
        policy="calibrated", model="m", slo_classes=(SLO,), decode_binding="late"
    )
    service = RoutingService(config, seed=0, clock=lambda: 0.0)
    service.state.set_members(members)
    for s in specs:
        service.state.set_profile(s.name, s.believed_profile, 0.0)
    routed = service.route("r0", 700, bind_late=True)
    assert routed.prefill is not None and routed.decode is None
    snap = service.state.snapshot(0.0)
    assert snap.prefill[0].queued_tokens == 700
    assert sum(d.inflight for d in snap.decode) == 0  # nothing booked on decode yet
    predicted = service.state.ledger.entries["r0"].predicted_output
    assert snap.unbound_kv_tokens == 700 + predicted  # what the decode pool owes it
    bound = service.bind_decode("r0")
    assert bound.decode is not None and bound.decision.decode == bound.decode.name
    snap = service.state.snapshot(0.0)
    assert snap.prefill[0].queued_tokens == 0  # binding also reports the prefill leg done
    by_pod = {d.name: d for d in snap.decode}
    assert by_pod[bound.decode.name].queued_tokens == 700
    assert snap.unbound_kv_tokens == 0.0
    with pytest.raises(Exception, match="awaiting its decode pod"):
        service.bind_decode("r0")
    assert dataclasses.replace(bound, decode=None).decode is None


def test_a_sheddable_request_that_would_be_late_is_refused_with_its_own_error() -> None:
    specs = build_pool(1, 2, QWEN, seed=4)
    members = tuple(Member(s.name, s.role, f"http://{s.name}") for s in specs)  # type: ignore[arg-type]
    classes = (SLO, SLOClass("batch", 0.001, 0.001, sheddable=True))
    config = SidecarConfig(policy="calibrated", model="m", slo_classes=classes)
    service = RoutingService(config, seed=0, clock=lambda: 0.0)
    service.state.set_members(members)
    for s in specs:
        service.state.set_profile(s.name, s.believed_profile, 0.0)
    with pytest.raises(Shed, match="sheddable"):
        service.route("r0", 700, "batch")
    assert service.inflight == 0  # nothing booked
    assert service.route("r1", 700, "chat").prefill is not None  # a kept class is served
    text = service.metrics.render().decode()
    assert 'disaggpool_requests_total{outcome="shed",slo_class="batch"} 1.0' in text
    assert 'disaggpool_rejected_requests_total{reason="shed"} 1.0' in text
