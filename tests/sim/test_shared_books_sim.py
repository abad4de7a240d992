"""Shared books in the simulator: a replica counts the requests another routed once the bus
delay has passed and not before; whole runs stay deterministic and serve every request."""

from __future__ import annotations

import json
import random

import pytest
from test_simulation import A40, SLO, _run, trace

from disaggpool.core.book_event import BookEvent
from disaggpool.core.policies.registry import PolicyOptions, make_policy
from disaggpool.core.predictor import make_predictor
from disaggpool.core.router import Request
from disaggpool.engine.decode import DecodeEngine
from disaggpool.engine.prefill import PrefillEngine
from disaggpool.sim.book_bus import BookBus
from disaggpool.sim.cluster import RouterOptions, Simulation
from disaggpool.sim.router import RouterReplica

SHARED = RouterOptions(scrape_interval_s=1.0, replicas=4, shared_books=True, bus_delay_s=0.005)


def replicas(n: int, bus: BookBus | None) -> list[RouterReplica]:
    prefill, decode = [PrefillEngine("p0", A40)], [DecodeEngine("d0", A40)]
    return [
        RouterReplica(
            prefill,
            decode,
            {"p0": A40, "d0": A40},
            policy=make_policy("least_loaded"),
            predictor=make_predictor("oracle"),
            rng=random.Random(0),
            scrape_interval_s=10.0,
            late_binding=False,
            bus=bus,
            name=f"router-{r}",
        )
        for r in range(n)
    ]


@pytest.mark.parametrize("shared", [True, False])
def test_a_replica_sees_another_replicas_placement_after_the_bus_delay(shared: bool) -> None:
    bus = BookBus(0.005) if shared else None
    group = replicas(4, bus)
    for replica in group:
        replica.observe(0.0)  # the scrape at 0: an idle pool
    group[0].router.route(Request("r0", 500, SLO["chat"], true_output_tokens=50), 0.0)
    if bus is not None:
        bus.flush(0.0)
    seen = []
    for t in (0.004, 0.006):
        for replica in group[1:]:
            replica.observe(t)
        seen.append([r.router.snapshot(t).prefill[0].queued_tokens for r in group])
    if shared:
        assert seen == [[500, 0, 0, 0], [500, 500, 500, 500]]
    else:
        assert seen == [[500, 0, 0, 0], [500, 0, 0, 0]]


def outcome_bytes(router: RouterOptions, seed_trace: int = 3) -> str:
    reqs = trace(n=400, rate=16.0, seed=seed_trace)
    _, outcome = _run("calibrated", PolicyOptions(pd_decider=True), router, reqs, router.replicas)
    return json.dumps(
        [(r.prefill_instance, r.decode_instance, r.first_token, r.finish) for r in outcome.requests]
    )


def test_shared_books_runs_are_deterministic_and_change_the_decisions() -> None:
    shared = outcome_bytes(SHARED)
    assert shared == outcome_bytes(SHARED)
    assert shared != outcome_bytes(RouterOptions(scrape_interval_s=1.0, replicas=4))


def test_shared_books_serve_every_request_and_only_foreign_entries_linger() -> None:
    """Every request completes; at the end each replica's books hold none of its own requests
    and, of the others', only those whose last events it has not received yet."""
    reqs = trace(n=400, rate=16.0)
    late = RouterOptions(
        scrape_interval_s=1.0, replicas=4, shared_books=True, bus_delay_s=0.01, late_binding=True
    )
    sim, outcome = _run("calibrated", PolicyOptions(pd_decider=True), late, reqs, 4)
    assert all(r.finish >= 0 for r in outcome.requests)
    last = max(r.arrival for r in outcome.requests)
    for replica in sim.routers:
        assert replica.pods.inflight == 0
        replica.observe(outcome.end_time + 1.0)  # every event is due by then
        assert replica.ledger.entries == {}
        assert all(a.inflight == 0 for a in replica.ledger.accounts.values())
    assert last < outcome.end_time


def test_router_options_check_the_shared_books_fields() -> None:
    with pytest.raises(ValueError, match="bus_delay_s must be a finite number >= 0"):
        RouterOptions(shared_books=True, bus_delay_s=-0.1)
    with pytest.raises(ValueError, match="bus_delay_s needs shared_books"):
        RouterOptions(bus_delay_s=0.005)
    with pytest.raises(ValueError, match="shared_books needs own_books"):
        RouterOptions(shared_books=True, own_books=False)


def test_a_replica_has_heard_the_tokens_streamed_a_bus_delay_before_it_decides(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A front door publishes each token as it streams: at every decision the deciding replica
    counts another's streams at least as far as they had got a bus delay earlier, not merely as
    far as they had got at the decision before (the simulation reports tokens at decisions; so
    reported, 66% of these streams were behind)."""
    delay = 0.005
    router = RouterOptions(scrape_interval_s=1.0, replicas=4, shared_books=True, bus_delay_s=delay)
    behind: list[bool] = []  # per other replica's stream at each decision
    observe = Simulation._observe

    def checked(sim: Simulation, replica: RouterReplica, now: float) -> None:
        observe(sim, replica, now)
        entries = replica.ledger.entries
        for d in sim.serving:
            if d.t_step > now - delay:  # the count of that time is not the engine's to tell
                continue
            for req, produced in d.produced_by(now - delay):
                entry = entries.get(req.key)
                if entry is None or entry.owner is None or produced == 0:
                    continue
                behind.append(entry.generated < produced)

    monkeypatch.setattr(Simulation, "_observe", checked)
    _run("calibrated", PolicyOptions(pd_decider=True), router, trace(n=300, rate=16.0), 4)
    assert len(behind) > 1000
    assert sum(behind) / len(behind) < 0.02


def test_a_flush_dated_back_is_delivered_in_due_order() -> None:
    bus = BookBus(0.005)
    reader = bus.subscribe()
    bus.outbox.append(BookEvent("finished", "a", "router-0"))
    bus.flush(1.0)  # due 1.005
    bus.outbox.append(BookEvent("finished", "b", "router-1"))
    bus.flush(0.997)  # sent before: due 1.002
    assert bus.deliver(reader, 1.001) == []
    assert [e.request_id for e in bus.deliver(reader, 1.002)] == ["b"]
    assert [e.request_id for e in bus.deliver(reader, 1.005)] == ["a"]
    bus.outbox.append(BookEvent("finished", "c", "router-1"))
    bus.outbox.append(BookEvent("finished", "d", "router-1"))
    bus.flush(1.0)  # due 1.005, as a delivered one: after it
    with pytest.raises(ValueError, match="due before what was received"):
        bus.outbox.append(BookEvent("finished", "e", "router-1"))
        bus.flush(0.99)
    assert [e.request_id for e in bus.deliver(reader, 1.01)] == ["c", "d"]
