"""What a router knows of its pool: each pod as last observed, and its books of what it sent there.

A `Pods` table holds one `Pod` per instance (its role, the `Gauges` of its last scrape, whether it
is healthy, the calibration profile the router believes for it) and the router's
`core.ledger.Ledger`. `snapshot(now)` combines the two into the `PoolSnapshot` the policies read,
by the one rule written down in `core.ledger` (`view`).

Who writes what. The adapters write what they observe: the sidecar's collectors (scrapes,
membership, health, profiles; `sidecar.state.PoolState` extends the table with what only the
sidecar knows of a pod), the simulator's engines at its scrape ticks (`sim.router`). The
`core.router.Router` writes the requests, through the lifecycle methods here (`routed`,
`bind_decode`, `prefilled`, `progress`, `finished`, `expired`), which keep the cached views in
step with the books. Nothing else writes to the ledger but `core.shared_books.SharedBooks`, which
books the other router replicas' requests there (below).

Views are cached per pod and rebuilt after any change to the pod (`changed`) or to its account
(`touched`). A view that carries TPOT budgets also ages, since budgets shrink with time: it is
rebuilt once `refresh_s` old. The sidecar reuses one for `BUDGETS_REFRESH_S` (the ledger's own
reuse window for budgets; at thousands of decisions a second a pool of hundreds of streams is not
walked per decision); `refresh_s=0` rebuilds it at every decision, so that every snapshot is what
a fresh `view` of every pod would give (the simulator, whose results must not depend on the
cache). A view without budgets has nothing that ages (no request queued or decoding there), so
reusing it until the next change gives exactly the fresh view.

Shared books: a `BookListener` given to the table is told of every change the router makes to
its own books (`core.shared_books.Publisher` sends them to the other replicas), and the entries
booked from the other replicas' events (`core.shared_books.SharedBooks`) count in the views like
the router's own. `inflight` and `is_inflight` count the router's own requests only, and
`streamed` skips the others' (a simulator's engines stream every replica's requests; only their
owners' events move them).

`own_books=False` shows the policies the scraped gauges alone, as a router that keeps no books
sees the pool between two scrapes (the books are still kept, for late binding and the reports).

Pure and synchronous: times are passed in, nothing is read from a clock.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Generic, Protocol, TypeVar

from disaggpool.core.contracts import InstanceSnapshot, PoolSnapshot, Role
from disaggpool.core.ledger import BUDGETS_REFRESH_S, Account, Entry, Gauges, Ledger, view
from disaggpool.core.profile import CalibrationProfile

__all__ = ["BookListener", "Pod", "Pods"]


@dataclasses.dataclass(slots=True)
class Pod:
    """One instance as the router last observed it, with its cached view."""

    name: str
    role: Role
    gauges: Gauges | None = None
    healthy: bool = True
    profile: CalibrationProfile | None = None
    removed: bool = False  # gone from membership; kept while requests are still in flight
    view: InstanceSnapshot | None = None  # cached snapshot; None after any change
    view_at: float = 0.0  # when it was built: its TPOT budgets age (module docstring)
    scraped_at: float | None = None  # when `gauges` were read (None: never)


class BookListener(Protocol):
    """Told of each change the router makes to its own books, after the ledger made it."""

    def booked(self, entry: Entry) -> None: ...

    def bound(self, entry: Entry) -> None: ...

    def prefilled(self, entry: Entry) -> None: ...

    def progressed(self, entry: Entry) -> None: ...

    def finished(self, entry: Entry) -> None: ...


P = TypeVar("P", bound=Pod)

_NO_ACCOUNTS: dict[str, Account] = {}


class Pods(Generic[P]):
    """Pods by name, in the order the policies see them, plus the ledger (module docstring)."""

    def __init__(
        self,
        *,
        own_books: bool = True,
        refresh_s: float = BUDGETS_REFRESH_S,
        listener: BookListener | None = None,
    ) -> None:
        self.instances: dict[str, P] = {}
        self.ledger = Ledger()
        self.own_books = own_books
        self.refresh_s = refresh_s
        self.listener = listener

    # ---------------------------------------------------------------- what the adapters observe
    def add(self, pod: P) -> None:
        """`pod` joins the pool, after those already in it (its view is built afresh: its
        account may have changed while it was out)."""
        pod.view = None
        self.instances[pod.name] = pod

    def remove(self, name: str) -> P | None:
        """`name` leaves the pool at once (its account stays in the ledger); returns it."""
        return self.instances.pop(name, None)

    def scraped(self, name: str, gauges: Gauges, now: float) -> None:
        """A scrape of `name` at `now`: what it says of itself, and which of our requests it
        held then (`Ledger.scraped`)."""
        pod = self.instances.get(name)
        if pod is None:
            return
        pod.gauges = gauges
        pod.scraped_at = now
        self.ledger.scraped(name)
        pod.view = None

    def changed(self, name: str) -> None:
        """Something the view shows of `name` other than its account changed (health, profile)."""
        pod = self.instances.get(name)
        if pod is not None:
            pod.view = None

    def members(self, role: Role) -> list[P]:
        return [p for p in self.instances.values() if p.role == role and not p.removed]

    def kv_capacity(self, name: str) -> int:
        """KV tokens `name` holds, as the router knows it: its profile's, else its last
        scrape's (0: not known)."""
        pod = self.instances.get(name)
        if pod is None:
            return 0
        capacity = pod.profile.kv_capacity_tokens if pod.profile is not None else 0
        if not capacity and pod.gauges is not None:
            capacity = pod.gauges.kv_capacity_tokens
        return capacity

    # ---------------------------------------------------------------- the books (Router only)
    @property
    def inflight(self) -> int:
        """The router's own requests in flight."""
        return self.ledger.own_entries

    def is_inflight(self, request_id: str) -> bool:
        entry = self.ledger.entries.get(request_id)
        return entry is not None and entry.owner is None

    def routed(self, entry: Entry) -> None:
        held = self.ledger.entries.get(entry.request_id)
        if held is not None and held.owner is not None and entry.owner is None:
            # The id is in flight on another replica: most likely a client retrying elsewhere
            # after that replica failed. Our own client's request wins; the owner's later events
            # for the id are ignored (`SharedBooks.apply`), so it is counted once, as ours.
            self.finished(entry.request_id)
        self.ledger.routed(entry)
        self.touched(entry)
        if self.listener is not None:
            self.listener.booked(entry)

    def bind_decode(self, request_id: str, decode: str) -> Entry | None:
        entry = self.ledger.bind_decode(request_id, decode)
        self.touched(entry)
        if entry is not None and self.listener is not None:
            self.listener.bound(entry)
        return entry

    def prefilled(self, request_id: str) -> bool:
        entry = self.ledger.entries.get(request_id)
        if entry is None:
            return False
        if not entry.prefilled:
            self.ledger.prefilled(request_id)
            self.touched(entry)
            if self.listener is not None:
                self.listener.prefilled(entry)
        return True

    def progress(
        self, request_id: str, generated: int, now: float, first_token_at: float | None = None
    ) -> bool:
        """`generated` output tokens so far; the first call with > 0 marks it decoding."""
        entry = self.ledger.progress(request_id, generated, now, first_token_at)
        self.touched(entry)
        if entry is not None and self.listener is not None:
            self.listener.progressed(entry)
        return entry is not None

    def streamed(self, counts: Iterable[tuple[str, int, float | None]], now: float) -> None:
        """`progress` of many requests at once: (request id, output tokens so far, when the
        first was seen), each counted only when it grew. A view goes stale once, however many
        of its pod's requests moved (no snapshot is built in between). Another replica's
        requests are left to its events."""
        entries = self.ledger.entries
        advance = self.ledger.advance
        listener = self.listener
        last: str | None = None
        for request_id, generated, first_token_at in counts:
            entry = entries.get(request_id)
            if entry is None or generated <= entry.generated or entry.owner is not None:
                continue
            prefilled = entry.prefilled
            advance(entry, generated, now, first_token_at)
            if entry.decode != last or not prefilled:
                self.touched(entry)
                last = entry.decode
            if listener is not None:
                listener.progressed(entry)

    def finished(self, request_id: str) -> Entry | None:
        """Forget a request (finished, failed or expired); returns its entry, if known."""
        entry = self.ledger.finished(request_id)
        self.touched(entry)
        if entry is not None and self.listener is not None:
            self.listener.finished(entry)
        return entry

    def expired(self, now: float, ttl: float) -> list[Entry]:
        """Forget requests routed more than `ttl` seconds ago (a caller that never reported)."""
        gone = self.ledger.expired(now, ttl)
        for entry in gone:
            self.touched(entry)
            if self.listener is not None:
                self.listener.finished(entry)
        return gone

    def touched(self, entry: Entry | None) -> None:
        """The accounts of `entry`'s pods changed: their views are stale."""
        if entry is None:
            return
        instances = self.instances
        if entry.prefill is not None:
            pod = instances.get(entry.prefill)
            if pod is not None:
                pod.view = None
        if entry.decode is not None:
            pod = instances.get(entry.decode)
            if pod is not None:
                pod.view = None

    # ---------------------------------------------------------------- the hot path's view
    def snapshot(self, now: float) -> PoolSnapshot:
        """The pool as the policies see it at `now`; unchanged pods reuse their cached view."""
        prefill: list[InstanceSnapshot] = []
        decode: list[InstanceSnapshot] = []
        ledger = self.ledger
        accounts = ledger.accounts if self.own_books else _NO_ACCOUNTS
        refresh_s = self.refresh_s
        for name, pod in self.instances.items():
            if pod.removed:
                continue
            snap = pod.view
            if snap is None or (
                snap.tpot_budgets.seconds and not 0.0 <= now - pod.view_at < refresh_s
            ):
                pod.view_at = now
                snap = pod.view = view(
                    name,
                    pod.role,
                    accounts.get(name),
                    pod.gauges,
                    now=now,
                    healthy=pod.healthy,
                    profile=pod.profile,
                )
            (decode if snap.role == "decode" else prefill).append(snap)
        return PoolSnapshot(
            now=now,
            prefill=prefill,
            decode=decode,
            unbound_kv_tokens=ledger.unbound_kv_tokens if self.own_books else 0.0,
        )

    def names(self, role: Role) -> Iterable[str]:
        """The names of the pods of `role` in the pool."""
        return (p.name for p in self.instances.values() if p.role == role and not p.removed)
