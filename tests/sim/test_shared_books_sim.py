"""Shared books in the simulator: a replica counts the requests another routed once the bus
delay has passed and not before; whole runs stay deterministic and serve every request."""

from __future__ import annotations

import json
import random

import pytest
from test_simulation import A40, SLO, _run, trace

from disaggpool.core.policies.registry import PolicyOptions, make_policy
from disaggpool.core.predictor import make_predictor
from disaggpool.core.router import Request
from disaggpool.engine.decode import DecodeEngine
from disaggpool.engine.prefill import PrefillEngine
from disaggpool.sim.book_bus import BookBus
from disaggpool.sim.cluster import RouterOptions
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
