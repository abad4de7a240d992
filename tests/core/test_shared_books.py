"""Shared books: another replica's requests, applied from its events, count in the snapshot as its
own do in its own; they leave on the owner's word or with its lease; they explain scraped work;
the events travel as plain data and a malformed one names its bad field."""

from __future__ import annotations

import json

import pytest

from disaggpool.core.book_event import BookEvent, BookEventError
from disaggpool.core.contracts import SLOClass
from disaggpool.core.ledger import Entry, Gauges
from disaggpool.core.pods import Pod, Pods
from disaggpool.core.shared_books import Publisher, SharedBooks

SLO = SLOClass("chat", 1.0, 0.05)


def table(listener: Publisher | None = None) -> Pods[Pod]:
    pods: Pods[Pod] = Pods(refresh_s=0.0, listener=listener)
    for name, role in (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"), ("d1", "decode")):
        pods.add(Pod(name, role))  # type: ignore[arg-type]
    return pods


def entry(rid: str, p: str | None, d: str | None, n: int = 400, at: float = 0.0) -> Entry:
    return Entry(rid, p, d, n, 120.0, SLO, at, cached_tokens=40 if p else 0, priority=1)


def owner_and_peer(
    progress_tokens: int = 1,
) -> tuple[Pods[Pod], Pods[Pod], SharedBooks, list[BookEvent]]:
    """Replica "a" publishing into a list, replica "b" applying what it publishes."""
    sent: list[BookEvent] = []
    a = table(Publisher("a", sent.append, progress_tokens=progress_tokens))
    b = table()
    return a, b, SharedBooks(b, "b"), sent


def deliver(books: SharedBooks, sent: list[BookEvent], now: float) -> None:
    for event in sent:
        books.apply(BookEvent.from_dict(json.loads(json.dumps(event.to_dict()))), now)
    sent.clear()


def test_shared_entries_count_in_the_snapshot_as_the_owners_own() -> None:
    a, b, books, sent = owner_and_peer()
    a.routed(entry("bound", "p0", "d0"))  # decode chosen at arrival
    a.routed(entry("late", "p1", None))  # decode chosen when the prefill leg answers
    a.routed(entry("local", None, "d1", n=900))  # prefilled by its decode instance
    a.routed(entry("stream", "p0", "d1", at=0.1))
    a.prefilled("stream")
    a.progress("stream", 30, now=0.5, first_token_at=0.3)
    deliver(books, sent, 0.5)
    assert b.snapshot(0.6) == a.snapshot(0.6)
    busy = b.snapshot(0.6)
    assert busy.prefill[0].queued_tokens == 360 and busy.prefill[0].yielded_tokens == 360
    assert busy.decode[1].local_prefill_tokens == 900 and busy.unbound_kv_tokens == 520.0
    assert busy.decode[1].remaining_output_tokens == 120.0 + 90.0
    a.prefilled("late")
    a.bind_decode("late", "d0")
    a.progress("stream", 31, now=0.7)
    deliver(books, sent, 0.7)
    assert b.snapshot(0.8) == a.snapshot(0.8)
    for rid in ("bound", "late", "local", "stream"):
        a.finished(rid)
    deliver(books, sent, 0.9)
    assert b.ledger.entries == {} and b.snapshot(1.0) == a.snapshot(1.0)
    assert a.inflight == 0 and b.inflight == 0 and b.snapshot(1.0).decode[0].inflight == 0


def test_shared_entries_are_not_the_peers_own() -> None:
    a, b, books, sent = owner_and_peer()
    a.routed(entry("r", "p0", "d0"))
    b.routed(entry("mine", "p1", "d1"))
    deliver(books, sent, 0.0)
    assert (b.inflight, b.is_inflight("r"), b.is_inflight("mine")) == (1, False, True)
    # The peer's own reports do not move the owner's request: only its events do.
    b.streamed([("r", 5, 0.0)], now=0.1)
    assert b.ledger.entries["r"].generated == 0


def test_an_id_another_replica_holds_is_routed_here_as_ours() -> None:
    """A client retrying on this replica a request another replica still books."""
    a, b, books, sent = owner_and_peer()
    a.routed(entry("r", "p0", "d0"))
    deliver(books, sent, 0.0)
    b.routed(entry("r", "p1", "d1"))
    assert (b.inflight, b.is_inflight("r"), b.ledger.shared_entries) == (1, True, 0)
    assert b.snapshot(0.1).prefill[0].queued_tokens == 0  # the owner's booking left
    a.prefilled("r")
    a.finished("r")  # the owner's word no longer moves it
    deliver(books, sent, 0.2)
    assert b.ledger.entries["r"].prefill == "p1" and b.inflight == 1


def test_a_snapshot_teaches_a_replica_that_joins_and_heals_a_lost_finished() -> None:
    a, b, books, sent = owner_and_peer()
    a.routed(entry("queued", "p0", "d0"))
    a.routed(entry("late", "p1", None))
    a.routed(entry("local", None, "d1", n=900))
    a.routed(entry("stream", "p0", "d1", at=0.1))
    a.prefilled("stream")
    a.progress("stream", 30, now=0.5, first_token_at=0.3)
    sent.clear()  # b joins now: it heard none of that
    publisher = a.listener
    assert isinstance(publisher, Publisher)

    def snapshot(now: float) -> None:
        ids = [rid for rid, e in a.ledger.entries.items() if e.owner is None]
        sent.extend(publisher.snapshot(a.ledger.entries.values()))
        deliver(books, sent, now)
        books.holding("a", ids, now)

    snapshot(0.6)
    assert b.snapshot(0.7) == a.snapshot(0.7)
    # The same snapshot again changes nothing.
    snapshot(0.7)
    assert b.snapshot(0.8) == a.snapshot(0.8)
    # `finished` and `bound` lost on the way (a server restart): the next snapshot heals both.
    a.finished("queued")
    a.prefilled("late")
    a.bind_decode("late", "d0")
    sent.clear()
    assert b.snapshot(0.9) != a.snapshot(0.9)
    snapshot(1.0)
    assert set(b.ledger.entries) == {"late", "local", "stream"}
    assert b.snapshot(1.1) == a.snapshot(1.1)
    assert books.holding("b", [], 1.2) == []  # its own name: nothing of its own is dropped


def test_progress_is_sent_at_the_first_token_then_every_progress_tokens() -> None:
    a, b, books, sent = owner_and_peer(progress_tokens=16)
    a.routed(entry("r", "p0", "d0"))
    a.prefilled("r")
    for k in range(1, 40):
        a.streamed([("r", k, 0.2)], now=0.2 + k * 0.01)
    assert [(e.kind, e.generated) for e in sent] == [
        ("booked", 0),
        ("prefilled", 0),
        ("progress", 1),
        ("progress", 17),
        ("progress", 33),
    ]
    deliver(books, sent, 1.0)
    assert b.ledger.entries["r"].generated == 33


def test_shared_entries_leave_on_the_owners_word_or_with_its_lease() -> None:
    a, b, _, sent = owner_and_peer()
    books = SharedBooks(b, "b", lease_s=10.0)
    a.routed(entry("r1", "p0", "d0"))
    a.routed(entry("r2", "p1", "d1"))
    deliver(books, sent, 1.0)
    a.finished("r1")
    deliver(books, sent, 2.0)
    assert set(b.ledger.entries) == {"r2"}
    assert books.expire(11.0) == []  # heard from at 2.0: within its lease
    assert [e.request_id for e in books.expire(12.5)] == ["r2"]
    assert b.ledger.entries == {} and b.snapshot(13.0) == table().snapshot(13.0)
    # A late word about an expired entry changes nothing; the owner's own events are ignored.
    a.finished("r2")
    deliver(books, sent, 13.0)
    assert books.apply(BookEvent("finished", "x", "b"), 14.0) is None
    assert b.ledger.entries == {}


def test_an_event_for_a_request_another_owner_holds_is_ignored() -> None:
    _, b, books, _ = owner_and_peer()
    booked = BookEvent("booked", "r", "a", prefill="p0", decode="d0", prompt_tokens=10, slo="c")
    assert books.apply(booked, 0.0) is not None
    assert books.apply(BookEvent("finished", "r", "c"), 0.1) is None
    assert books.apply(dataclass_replace(booked, owner="c"), 0.1) is None
    assert b.ledger.entries["r"].owner == "a"


def dataclass_replace(event: BookEvent, **changes: object) -> BookEvent:
    return BookEvent.from_dict({**event.to_dict(), **changes})


def scrape(pods: Pods[Pod], now: float, held: dict[str, int]) -> None:
    """Every instance scraped at `now`, showing `held` requests waiting (none elsewhere)."""
    for name in pods.instances:
        pods.scraped(name, Gauges(0, held.get(name, 0), 0.0, 1000), now)


def test_scraped_work_a_shared_entry_explains_is_not_foreign() -> None:
    a, b, books, sent = owner_and_peer()
    a.routed(entry("r1", "p0", "d0", at=0.0))
    deliver(books, sent, 0.0)  # applied before the scrape
    a.routed(entry("r2", "p0", "d0", at=0.5))
    for pods in (a, b):
        scrape(pods, 1.0, {"p0": 2})  # the scrape counts both requests, queued on p0
    deliver(books, sent, 1.005)  # r2 arrives after the scrape that counted it
    assert [i.foreign for i in a.snapshot(1.1).prefill] == [0, 0]
    assert [i.foreign for i in b.snapshot(1.1).prefill] == [0, 0]
    assert b.snapshot(1.1).prefill[0].queued_tokens == 720
    # A booking routed after the scrape was not in it: an unexplained request stays foreign.
    a.routed(entry("r3", "p1", "d1", at=1.2))
    scrape(b, 1.1, {"p0": 2, "p1": 1})  # p1 holds another client's request
    deliver(books, sent, 1.3)
    assert b.snapshot(1.4).prefill[1].foreign == 1


def test_a_first_token_before_the_scrape_has_its_kv_in_it() -> None:
    a, b, books, sent = owner_and_peer()
    a.routed(entry("r", "p0", "d0"))
    a.prefilled("r")
    deliver(books, sent, 0.1)
    a.progress("r", 1, now=0.2, first_token_at=0.2)
    scrape(b, 0.3, {})
    deliver(books, sent, 0.4)
    assert b.ledger.accounts["d0"].tokens_since_scrape == 0
    a.routed(entry("s", "p0", "d0"))
    a.prefilled("s")
    a.progress("s", 1, now=0.5, first_token_at=0.5)
    deliver(books, sent, 0.6)  # its first token came after the scrape: KV in no scrape yet
    assert b.ledger.accounts["d0"].tokens_since_scrape == 400


def test_an_event_round_trips_as_plain_data() -> None:
    event = BookEvent(
        "booked",
        "req-1",
        "router-3",
        prefill=None,
        decode="d0",
        prompt_tokens=900,
        predicted_output=131.5,
        cached_tokens=0,
        priority=1,
        slo="chat",
        ttft_s=1.0,
        tpot_s=0.05,
        routed_at=12.25,
    )
    wire = json.dumps(event.to_dict())
    assert BookEvent.from_dict(json.loads(wire)) == event
    assert BookEvent.from_dict({"kind": "prefilled", "request_id": "r", "owner": "o"}) == (
        BookEvent("prefilled", "r", "o")
    )


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"kind": "started"}, "kind"),
        ({"prompt_tokens": -1}, "prompt_tokens"),
        ({"prompt_tokens": 1.5}, "prompt_tokens"),
        ({"generated": True}, "generated"),
        ({"routed_at": float("nan")}, "routed_at"),
        ({"owner": ""}, "owner"),
        ({"decode": 3}, "decode"),
        ({"colour": "red"}, "colour"),
        ({"prefill": None, "decode": None}, "decode"),
        ({"cached_tokens": 500}, "cached_tokens"),
    ],
)
def test_a_malformed_event_names_its_field(change: dict[str, object], field: str) -> None:
    good = {
        "kind": "booked",
        "request_id": "r",
        "owner": "o",
        "prefill": "p0",
        "decode": None,
        "prompt_tokens": 400,
        "slo": "chat",
    }
    assert BookEvent.from_dict(good).kind == "booked"
    with pytest.raises(BookEventError, match=f"field '{field}'") as err:
        BookEvent.from_dict({**good, **change})
    assert err.value.field == field


def test_a_missing_field_is_named() -> None:
    with pytest.raises(BookEventError, match="field 'owner': missing"):
        BookEvent.from_dict({"kind": "finished", "request_id": "r"})


def test_events_travel_without_their_defaults() -> None:
    progress = BookEvent("progress", "r", "a", generated=3, first_token_at=1.5)
    assert progress.to_dict() == {
        "kind": "progress", "request_id": "r", "owner": "a", "generated": 3, "first_token_at": 1.5,
    }  # fmt: skip
    booked = BookEvent("booked", "r", "a", decode="d0", prompt_tokens=9, slo="chat", tpot_s=0.1)
    for event in (progress, booked, BookEvent("finished", "r", "a")):
        assert BookEvent.from_dict(json.loads(json.dumps(event.to_dict()))) == event
