"""Shared books: router replicas tell each other what they routed, so that each one's snapshot
counts every replica's requests, not only its own.

Each replica keeps books (`core.ledger`) of the requests it routed and sees the rest of the pool
only through the scraped gauges, up to a scrape interval old. Several replicas routing greedily
on such views herd: each sends its share of a second's arrivals where the last scrape looked
emptiest, and none sees the others' local prefills stall a decode instance's batch. Shared books
close that gap with two halves:

* `Publisher`, the `core.pods.BookListener` of a replica's `Pods`: every change the router makes
  to its own books becomes a `core.book_event.BookEvent` handed to `send` (the bus). Progress
  goes out each time the owner's count grows, by default: thinned to one event every
  `progress_tokens` tokens, a receiver sees each stream stall between two events, its TPOT
  budget shrinking as if it fell behind, and the P/D decider and the guard shy away from
  instances that are fine (`sim paper`'s herding setup, 16 replicas, 1,500 requests of one seed:
  calibrated's goodput 0.86 with every count, 0.71-0.72 with an event every 4 or 16 tokens). A
  bus that must carry less should batch the events of one report into one message instead.
* `SharedBooks` applies the other replicas' events to this replica's ledger as entries owned by
  them (`Entry.owner`), which count like its own in every account and view: queued prompt tokens,
  remaining output, TPOT budgets, local-prefill stalls, unbound KV. They are also in
  `held_at_scrape`, so the work they explain in a scrape is not counted again as foreign. Events
  arrive a bus delay late, so two corrections keep that rule: a booking routed before the
  instance's last scrape here was already in that scrape (it joins `held_at_scrape`), and a first
  token seen before that scrape had its prompt's KV in it (it leaves `tokens_since_scrape`). One
  overlap of a bus delay's width stays: a scrape here between a prefill leg's answer and its
  ``prefilled`` event counts the request on its decode instance beside the books.

Shared entries leave on their owner's word (``finished``) or with their owner's lease: every
event from an owner renews it, and `expire` drops all entries of an owner not heard from for
`lease_s`, so a dead replica's books do not linger. A live replica with requests in flight is
heard from as their tokens stream; one whose requests all wait longer than the lease in a queue
without any other event would lose them here (a production publisher also sends a heartbeat).
Events of an entry this replica does not hold (one that arrived after its lease, a duplicate
``finished``) are ignored; so are events claiming a request id another owner holds.

**Snapshots** heal what a bus loses and teach a replica that joins: `Publisher.snapshot` states
an owner's whole books as events (each request ``booked`` as it stands, then ``bound``,
``prefilled`` and its ``progress``), and `SharedBooks.holding`, applied after them, drops the
owner's entries it no longer names (a ``finished`` lost in a server restart). Applying a
snapshot to books that already hold it changes nothing, so one can be sent whenever it helps
(the sidecar sends one on connecting, to every new owner, and as its heartbeat).

Pure and synchronous: times are passed in, sending is the caller's.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from typing import Any

from disaggpool.core.book_event import BookEvent
from disaggpool.core.contracts import SLOClass
from disaggpool.core.ledger import Entry
from disaggpool.core.pods import Pods

__all__ = ["DEFAULT_LEASE_S", "DEFAULT_PROGRESS_TOKENS", "Publisher", "SharedBooks"]

DEFAULT_LEASE_S = 30.0  # an owner silent this long is taken for dead
DEFAULT_PROGRESS_TOKENS = 1  # a progress event each time the count grows (module docstring)


class Publisher:
    """Turns the changes to `owner`'s own books into events for `send` (module docstring)."""

    def __init__(
        self,
        owner: str,
        send: Callable[[BookEvent], None],
        *,
        progress_tokens: int = DEFAULT_PROGRESS_TOKENS,
    ) -> None:
        if progress_tokens < 1:
            raise ValueError(f"progress_tokens must be >= 1, got {progress_tokens!r}")
        self.owner = owner
        self.send = send
        self.progress_tokens = progress_tokens
        self._sent: dict[str, int] = {}  # request id -> `generated` of its last progress event

    def booked(self, entry: Entry) -> None:
        if entry.owner is None:
            self.send(self._booked(entry))

    def snapshot(self, entries: Iterable[Entry]) -> list[BookEvent]:
        """The owner's own `entries` as events that book each as it stands (module docstring);
        `SharedBooks.holding` with their ids follows them."""
        events = []
        for entry in entries:
            if entry.owner is not None:
                continue
            events.append(self._booked(entry))
            rid = entry.request_id
            if entry.decode is not None:  # for books that hold it unbound
                events.append(BookEvent("bound", rid, self.owner, decode=entry.decode))
            if entry.prefilled and entry.prefill is not None:
                events.append(BookEvent("prefilled", rid, self.owner))
            if entry.decoding:
                events.append(
                    BookEvent(
                        "progress",
                        rid,
                        self.owner,
                        generated=entry.generated,
                        first_token_at=entry.first_token_at,
                    )
                )
        return events

    def _booked(self, entry: Entry) -> BookEvent:
        slo = entry.slo
        return BookEvent(
            "booked",
            entry.request_id,
            self.owner,
            prefill=entry.prefill,
            decode=entry.decode,
            prompt_tokens=entry.prompt_tokens,
            predicted_output=entry.predicted_output,
            cached_tokens=entry.cached_tokens,
            priority=entry.priority,
            slo=slo.name,
            ttft_s=slo.ttft_s,
            tpot_s=slo.tpot_s,
            routed_at=entry.routed_at,
        )

    def bound(self, entry: Entry) -> None:
        if entry.owner is None:
            self.send(BookEvent("bound", entry.request_id, self.owner, decode=entry.decode))

    def prefilled(self, entry: Entry) -> None:
        if entry.owner is None:
            self.send(BookEvent("prefilled", entry.request_id, self.owner))

    def progressed(self, entry: Entry) -> None:
        if entry.owner is not None:
            return
        sent = self._sent.get(entry.request_id, -1)
        k = entry.generated
        # The prefill leg's answer (the first report), the first token, then every
        # `progress_tokens` tokens.
        if sent < 0 or (sent == 0 and k > 0) or k - sent >= self.progress_tokens:
            self._sent[entry.request_id] = k
            self.send(
                BookEvent(
                    "progress",
                    entry.request_id,
                    self.owner,
                    generated=k,
                    first_token_at=entry.first_token_at,
                )
            )

    def finished(self, entry: Entry) -> None:
        if entry.owner is None:
            self._sent.pop(entry.request_id, None)
            self.send(BookEvent("finished", entry.request_id, self.owner))


class SharedBooks:
    """The other replicas' requests in `pods`' ledger, kept by their events (module docstring).
    Events of `owner` (this replica) are ignored."""

    def __init__(self, pods: Pods[Any], owner: str, *, lease_s: float = DEFAULT_LEASE_S) -> None:
        if not lease_s > 0.0:
            raise ValueError(f"lease_s must be > 0, got {lease_s!r}")
        self.pods = pods
        self.ledger = pods.ledger
        self.owner = owner
        self.lease_s = lease_s
        self.heard: dict[str, float] = {}  # owner -> when its last event was applied here

    def apply(self, event: BookEvent, now: float) -> Entry | None:
        """Apply `event`, received at `now`; returns the entry it changed (None: ignored)."""
        owner = event.owner
        if owner == self.owner:
            return None
        self.heard[owner] = now
        if event.kind == "booked":
            return self._booked(event)
        entry = self.ledger.entries.get(event.request_id)
        if entry is None or entry.owner != owner:
            return None
        if event.kind == "bound":
            if entry.decode is not None:
                return None
            assert event.decode is not None  # BookEvent checks it
            self.ledger.bind_decode(entry.request_id, event.decode)
        elif event.kind == "prefilled":
            self.ledger.prefilled(entry.request_id)
        elif event.kind == "progress":
            self._progress(entry, event, now)
        else:
            self.ledger.finished(entry.request_id)
        self.pods.touched(entry)
        return entry

    def holding(self, owner: str, request_ids: Collection[str], now: float) -> list[Entry]:
        """`owner` holds exactly `request_ids` (the end of its snapshot): drop its entries not
        among them, and return those."""
        if owner == self.owner:
            return []
        self.heard[owner] = now
        gone = [
            e
            for e in self.ledger.entries.values()
            if e.owner == owner and e.request_id not in request_ids
        ]
        for entry in gone:
            self.ledger.finished(entry.request_id)
            self.pods.touched(entry)
        return gone

    def expire(self, now: float) -> list[Entry]:
        """Drop the entries of every owner not heard from for `lease_s`; returns them."""
        silent = {o for o, at in self.heard.items() if now - at > self.lease_s}
        if not silent:
            return []
        for owner in silent:
            del self.heard[owner]
        gone = [e for e in self.ledger.entries.values() if e.owner in silent]
        for entry in gone:
            self.ledger.finished(entry.request_id)
            self.pods.touched(entry)
        return gone

    def _booked(self, event: BookEvent) -> Entry | None:
        if event.request_id in self.ledger.entries:  # a duplicate, or an id another one holds
            return None
        entry = Entry(
            event.request_id,
            event.prefill,
            event.decode,
            event.prompt_tokens,
            event.predicted_output,
            SLOClass(event.slo, event.ttft_s, event.tpot_s),
            event.routed_at,
            cached_tokens=event.cached_tokens,
            priority=event.priority,
            owner=event.owner,
        )
        self.ledger.routed(entry)
        # The instance holding it from routing on (its prefill instance, else its decode one
        # prefilling it) was scraped here since: that scrape counted it.
        holder = entry.prefill if entry.prefill is not None else entry.decode
        if holder is not None and self._scraped_since(holder, entry.routed_at):
            self.ledger.account(holder).held_at_scrape += 1
        self.pods.touched(entry)
        return entry

    def _progress(self, entry: Entry, event: BookEvent, now: float) -> None:
        was_decoding = entry.decoding
        self.ledger.advance(entry, event.generated, now, event.first_token_at)
        # The ledger counts a new stream's prompt KV as in no scrape yet; a scrape here after
        # its first token already has it.
        decode = entry.decode
        if (
            entry.decoding
            and not was_decoding
            and decode is not None
            and self._scraped_since(decode, entry.first_token_at)
        ):
            self.ledger.accounts[decode].tokens_since_scrape -= entry.prompt_tokens

    def _scraped_since(self, name: str, at: float) -> bool:
        pod = self.pods.instances.get(name)
        return pod is not None and pod.scraped_at is not None and pod.scraped_at >= at
