"""Shared books over a real nats-server on loopback (`sidecar.book_bus`): two routing services
on one subject see each other's requests; the bus down, each routes on its own books and says
so; the server back, they share again; a replica that joins, or missed events, is sent the
others' books. Config errors name the field."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from sidecar_testkit import NatsServer

from disaggpool.core.contracts import SLOClass
from disaggpool.errors import InputError
from disaggpool.sidecar.book_bus import BookBus
from disaggpool.sidecar.config import Member, SharedBooksConfig, SidecarConfig, parse_config
from disaggpool.sidecar.service import RoutingService
from disaggpool.sidecar.supervise import Supervisor

MEMBERS = (
    Member("p0", "prefill", "http://p0"),
    Member("d0", "decode", "http://d0"),
    Member("d1", "decode", "http://d1"),
)
SLO = SLOClass("chat", 60.0, 1.0)


def service(
    url: str, replica: str, lease_s: float = 3.0
) -> tuple[RoutingService, BookBus, Supervisor]:
    shared = SharedBooksConfig(
        nats_url=url, subject="test.books", replica_id=replica, lease_s=lease_s
    )
    config = SidecarConfig(
        policy="least_loaded",
        model="m",
        slo_classes=(SLO,),
        static_members=MEMBERS,
        shared_books=shared,
    )
    svc = RoutingService(config)
    svc.state.set_members(MEMBERS)
    bus = BookBus(shared, svc.state, svc.metrics.registry, svc.clock)
    supervisor = Supervisor(svc.metrics.loop_errors, svc.metrics.loop_restarts)
    supervisor.task("book_bus", bus.run)
    return svc, bus, supervisor


async def until(check: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        await asyncio.sleep(0.01)


def foreign(svc: RoutingService, rid: str) -> str | None:
    entry = svc.state.ledger.entries.get(rid)
    return entry.owner if entry is not None else None


def gauge(svc: RoutingService, name: str, **labels: str) -> float:
    value = svc.metrics.registry.get_sample_value(name, labels or None)
    return float(value or 0.0)


async def both(a: Awaitable[object], b: Awaitable[object]) -> None:
    await asyncio.gather(a, b)


@pytest.mark.timeout(30)
@pytest.mark.asyncio
async def test_two_replicas_share_their_books_and_survive_the_bus(nats_server: NatsServer) -> None:
    a, _, sup_a = service(nats_server.url, "a")
    b, _, sup_b = service(nats_server.url, "b")
    try:
        await until(lambda: gauge(a, "disaggpool_shared_books_connected") == 1.0)
        await until(lambda: gauge(b, "disaggpool_shared_books_connected") == 1.0)
        # A routes: B books it as A's, within a bounded time; A finishes it: it leaves B's books.
        started = time.monotonic()
        routed = a.route("r1", 500)
        await until(lambda: foreign(b, "r1") == "a", timeout=2.0)
        assert time.monotonic() - started < 2.0
        assert foreign(a, "r1") is None  # its own
        assert b.state.ledger.entries["r1"].decode == routed.decode.name
        assert a.progress("r1", 1)
        await until(lambda: b.state.ledger.entries["r1"].generated == 1)
        a.finished("r1", 1, 0.1, 0.01)
        await until(lambda: "r1" not in b.state.ledger.entries)
        assert gauge(b, "disaggpool_shared_books_events_total", outcome="applied") >= 3
        assert gauge(a, "disaggpool_shared_books_events_total", outcome="published") >= 3

        # The bus goes: both keep routing on their own books, and say so.
        nats_server.stop()
        await until(lambda: gauge(a, "disaggpool_shared_books_connected") == 0.0)
        await until(lambda: gauge(b, "disaggpool_shared_books_connected") == 0.0)
        for i in range(5):
            a.route(f"down-a{i}", 100)
            b.route(f"down-b{i}", 100)
        await asyncio.sleep(0.2)
        assert sup_a.alive and sup_b.alive

        # It comes back: they reconnect, and share again.
        nats_server.start()
        await until(lambda: gauge(a, "disaggpool_shared_books_connected") == 1.0, timeout=10)
        await until(lambda: gauge(b, "disaggpool_shared_books_connected") == 1.0, timeout=10)
        b.route("r2", 300)
        await until(lambda: foreign(a, "r2") == "b", timeout=3.0)
        assert gauge(a, "disaggpool_loop_errors_total", loop="book_bus") == 0.0
    finally:
        await both(sup_a.stop(), sup_b.stop())


@pytest.mark.asyncio
async def test_a_silent_owner_loses_its_entries_with_its_lease(nats_server: NatsServer) -> None:
    a, _, sup_a = service(nats_server.url, "a")
    b, _, sup_b = service(nats_server.url, "b")
    try:
        await until(lambda: gauge(a, "disaggpool_shared_books_connected") == 1.0)
        await until(lambda: gauge(b, "disaggpool_shared_books_connected") == 1.0)
        a.route("r1", 500)
        await until(lambda: foreign(b, "r1") == "a")
        await sup_a.stop()  # a dies without finishing it
        await until(lambda: "r1" not in b.state.ledger.entries, timeout=8.0)
    finally:
        await both(sup_a.stop(), sup_b.stop())


@pytest.mark.timeout(30)
@pytest.mark.asyncio
async def test_a_replica_that_joins_or_missed_events_gets_the_others_books_at_once(
    nats_server: NatsServer,
) -> None:
    """With a 30 s lease the heartbeat snapshots come every 10 s: within 5 s, only the answer to
    a replica's hello can have brought the books."""
    a, _, sup_a = service(nats_server.url, "a", lease_s=30.0)
    b, bus_b, sup_b = service(nats_server.url, "b", lease_s=30.0)
    try:
        await sup_b.stop()  # b starts later
        await until(lambda: gauge(a, "disaggpool_shared_books_connected") == 1.0)
        for rid in ("r1", "r2"):
            a.route(rid, 400)
        sup_b = Supervisor(b.metrics.loop_errors, b.metrics.loop_restarts)
        sup_b.task("book_bus", bus_b.run)  # b joins: a's two requests reach its books
        await until(lambda: foreign(b, "r1") == "a" and foreign(b, "r2") == "a", timeout=5.0)

        await sup_b.stop()  # b goes away; r1 finishes meanwhile and b misses it
        a.finished("r1", 1, 0.1, 0.01)
        assert foreign(b, "r1") == "a"
        sup_b = Supervisor(b.metrics.loop_errors, b.metrics.loop_restarts)
        sup_b.task("book_bus", bus_b.run)  # back: its hello brings a's books as they stand
        await until(lambda: "r1" not in b.state.ledger.entries, timeout=5.0)
        assert foreign(b, "r2") == "a"
        assert gauge(b, "disaggpool_shared_books_malformed_messages_total") == 0.0
    finally:
        await both(sup_a.stop(), sup_b.stop())


def test_malformed_messages_are_counted_never_raised() -> None:
    svc = RoutingService(
        SidecarConfig(policy="least_loaded", model="m", slo_classes=(SLO,), static_members=MEMBERS)
    )
    svc.state.set_members(MEMBERS)
    shared = SharedBooksConfig(nats_url="nats://127.0.0.1:1", subject="s", replica_id="me")
    bus = BookBus(shared, svc.state, svc.metrics.registry, svc.clock)
    bus.receive(b"not json")
    bus.receive(b'{"owner": "x"}')
    bus.receive(json.dumps({"owner": "x", "events": [{"kind": "nope"}, 3]}).encode())
    bus.receive(json.dumps({"owner": "x", "events": [], "holding": "q"}).encode())
    bus.receive(json.dumps({"owner": "x", "events": [], "holding": [], "hello": 1}).encode())
    event = {"kind": "booked", "request_id": "q", "owner": "x", "prefill": "p0", "slo": "chat"}
    bus.receive(json.dumps({"owner": "x", "events": [event]}).encode())
    bus.receive(json.dumps({"owner": "me", "events": [{**event, "owner": "me"}]}).encode())
    assert gauge(svc, "disaggpool_shared_books_malformed_messages_total") == 4
    assert gauge(svc, "disaggpool_shared_books_events_total", outcome="rejected") == 2
    assert gauge(svc, "disaggpool_shared_books_events_total", outcome="applied") == 1
    assert foreign(svc, "q") == "x"


def test_the_queue_is_bounded_while_the_bus_is_down() -> None:
    svc = RoutingService(
        SidecarConfig(policy="least_loaded", model="m", slo_classes=(SLO,), static_members=MEMBERS)
    )
    svc.state.set_members(MEMBERS)
    shared = SharedBooksConfig(nats_url="nats://127.0.0.1:1", subject="s", max_pending=10)
    bus = BookBus(shared, svc.state, svc.metrics.registry, svc.clock)
    for i in range(20):
        svc.route(f"r{i}", 100)
    assert len(bus._pending) == 10
    assert gauge(svc, "disaggpool_shared_books_events_total", outcome="dropped") >= 10


BASE = {
    "model": "org/m-1.5",
    "slo_classes": [{"name": "chat", "ttft_s": 1, "tpot_s": 0.1}],
    "pool": {"file": "members.yaml"},
}


def test_config_defaults_and_errors_name_the_field(tmp_path: Path) -> None:
    c = parse_config({**BASE, "shared_books": {"nats_url": "nats://127.0.0.1:4222"}})
    assert c.shared_books == SharedBooksConfig(
        "nats://127.0.0.1:4222", "disaggpool.books.org_m-1_5"
    )
    assert parse_config(BASE).shared_books is None
    (tmp_path / "token").write_text("t")
    remote = {"nats_url": "nats://nats.svc:4222", "token_file": "token"}
    c = parse_config({**BASE, "shared_books": remote}, base=tmp_path)
    assert c.shared_books is not None and c.shared_books.token_file == str(tmp_path / "token")
    for raw, field in (
        ({"nats_url": "nats://nats.svc:4222"}, "shared_books.nats_url"),
        ({"nats_url": "nats://u:p@127.0.0.1:4222"}, "shared_books.nats_url"),
        ({"nats_url": "http://127.0.0.1:4222"}, "shared_books.nats_url"),
        ({}, "shared_books.nats_url"),
        ({"nats_url": "nats://127.0.0.1:1", "lease_s": 0}, "shared_books.lease_s"),
        ({"nats_url": "nats://127.0.0.1:1", "subject": "a.*"}, "shared_books.subject"),
        ({"nats_url": "nats://127.0.0.1:1", "bogus": 1}, "shared_books.bogus"),
    ):
        with pytest.raises(InputError, match=field.replace(".", r"\.")):
            parse_config({**BASE, "shared_books": raw})
