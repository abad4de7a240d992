"""The sidecar's live view of its pool: members, scraped gauges, health, profiles, and its ledger.

Collectors (`scrape`, `membership`, `profiles`) write into it; the routing service books requests
in its `core.ledger.Ledger`, the same ledger the simulator's router keeps; the hot path reads a
`PoolSnapshot` built by `core.ledger.view` from both (the rule is written down there).

With `prefix_index`, it also keeps a `core.prefix_index.PrefixIndex`: the prompt blocks the router
sent to each prefill pod (the approximate index; a pod that leaves, or a new pod behind a name,
holds nothing we know of). A pod whose KV events the sidecar hears (`sidecar.kv_events`) also
has an `EventIndex`, read instead while it is live: it has announced something, and it has not
kept silent for `stale_after_s` after being sent blocks it did not hold (`cached_index`).

Everything runs on one asyncio loop, so there are no locks: each method is atomic with respect
to the others. Time is passed in (`now`, monotonic seconds), never read here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from disaggpool.core.contracts import InstanceSnapshot, PoolSnapshot, Role
from disaggpool.core.ledger import BUDGETS_REFRESH_S, Entry, Gauges, Ledger, view
from disaggpool.core.prefix_index import EventIndex, PrefixIndex
from disaggpool.core.profile import CalibrationProfile
from disaggpool.sidecar.config import Member

__all__ = ["Gauges", "Instance", "PoolState"]


@dataclasses.dataclass(slots=True)
class Instance:
    """One pod: what the collectors know of it."""

    member: Member
    gauges: Gauges | None = None
    scraped_at: float = -1.0
    healthy: bool = True
    failures: int = 0  # consecutive failed scrapes or connection errors
    profile: CalibrationProfile | None = None
    profile_loaded_at: float = -1.0
    removed: bool = False  # gone from membership; kept while requests are still in flight
    view: InstanceSnapshot | None = None  # cached snapshot; None after any change
    view_at: float = 0.0  # when it was built: its TPOT budgets age (core.ledger)
    events: EventIndex | None = None  # its cache as its KV events announce it (prefill pods)
    events_at: float = -1.0  # when its last event batch arrived (-1: none yet)
    awaiting_events_since: float | None = None  # sent new blocks at; cleared by any batch
    max_model_len: int | None = None  # from its /v1/models, once read (None: not yet)

    @property
    def name(self) -> str:
        return self.member.name

    @property
    def role(self) -> Role:
        return self.member.role


class PoolState:
    """Members by name plus the ledger of in-flight requests (see the module docstring)."""

    def __init__(self, *, prefix_index: bool = False) -> None:
        self.instances: dict[str, Instance] = {}
        self.ledger = Ledger()
        self.prefix = PrefixIndex() if prefix_index else None

    # ---------------------------------------------------------------- membership and collectors
    def set_members(self, members: Iterable[Member]) -> tuple[list[str], list[str]]:
        """Make the pool exactly `members`; returns (added, removed) names."""
        wanted = {m.name: m for m in members}
        added, removed = [], []
        for name, member in wanted.items():
            inst = self.instances.get(name)
            if inst is None:
                self.instances[name] = Instance(member)
                added.append(name)
            elif inst.removed or inst.member != member:
                if inst.member.url != member.url:  # a new pod behind the name: forget the old one
                    inst.gauges, inst.healthy, inst.failures = None, True, 0
                    inst.max_model_len = None
                    inst.events, inst.events_at, inst.awaiting_events_since = None, -1.0, None
                    if self.prefix is not None:
                        self.prefix.forget(name)
                inst.member, inst.removed = member, False
                inst.view = None
        for name, inst in list(self.instances.items()):
            if name not in wanted and not inst.removed:
                inst.removed = True
                removed.append(name)
                if self.prefix is not None:
                    self.prefix.forget(name)
                self._collect(name)
        return added, removed

    def scraped(self, name: str, gauges: Gauges, now: float) -> None:
        inst = self.instances.get(name)
        if inst is None:
            return
        inst.gauges, inst.scraped_at = gauges, now
        inst.healthy, inst.failures = True, 0
        self.ledger.scraped(name)
        inst.view = None

    def unreachable(self, name: str, failures_to_unhealthy: int = 1) -> None:
        """A scrape or a request could not reach the pod."""
        inst = self.instances.get(name)
        if inst is None:
            return
        inst.failures += 1
        if inst.failures >= failures_to_unhealthy:
            inst.healthy = False
            inst.view = None

    def set_profile(self, name: str, profile: CalibrationProfile | None, now: float) -> bool:
        """Install (or clear) a pod's profile; False when the pod is unknown."""
        inst = self.instances.get(name)
        if inst is None:
            return False
        inst.profile, inst.profile_loaded_at = profile, now
        inst.view = None
        return True

    def events_heard(self, name: str, now: float) -> EventIndex | None:
        """A batch of `name`'s KV events arrived: its event index to apply it to."""
        inst = self.instances.get(name)
        if inst is None or inst.removed:
            return None
        if inst.events is None:
            inst.events = EventIndex()
        inst.events_at, inst.awaiting_events_since = now, None
        return inst.events

    def cached_index(self, name: str, now: float, stale_after_s: float) -> EventIndex | None:
        """The event index to read for `name`, or None for the approximate one (the module
        docstring says when)."""
        inst = self.instances.get(name)
        if inst is None or inst.events is None or inst.events_at < 0:
            return None
        since = inst.awaiting_events_since
        if since is not None and now - since > stale_after_s:
            return None
        return inst.events

    # ---------------------------------------------------------------- request lifecycle
    @property
    def inflight(self) -> int:
        return len(self.ledger.entries)

    def is_inflight(self, request_id: str) -> bool:
        return request_id in self.ledger.entries

    def routed(self, entry: Entry) -> None:
        self.ledger.routed(entry)
        self._touched(entry)

    def bind_decode(self, request_id: str, decode: str) -> Entry | None:
        entry = self.ledger.bind_decode(request_id, decode)
        self._touched(entry)
        return entry

    def prefilled(self, request_id: str) -> bool:
        entry = self.ledger.prefilled(request_id)
        self._touched(entry)
        return entry is not None

    def progress(
        self, request_id: str, generated: int, now: float, first_token_at: float | None = None
    ) -> bool:
        """`generated` output tokens so far; the first call with > 0 marks it decoding."""
        entry = self.ledger.progress(request_id, generated, now, first_token_at)
        self._touched(entry)
        return entry is not None

    def finished(self, request_id: str) -> Entry | None:
        """Forget a request (finished, failed or expired); returns its entry, if known."""
        entry = self.ledger.finished(request_id)
        self._touched(entry)
        return entry

    def expired(self, now: float, ttl: float) -> list[Entry]:
        """Forget requests routed more than `ttl` seconds ago (a caller that never reported)."""
        gone = self.ledger.expired(now, ttl)
        for entry in gone:
            self._touched(entry)
        return gone

    def _touched(self, entry: Entry | None) -> None:
        if entry is None:
            return
        for name in (entry.prefill, entry.decode):
            if name is None:
                continue
            inst = self.instances.get(name)
            if inst is not None:
                inst.view = None
                if inst.removed:
                    self._collect(name)

    def _collect(self, name: str) -> None:
        if not self.ledger.busy(name):
            self.instances.pop(name, None)
            self.ledger.forget(name)

    # ---------------------------------------------------------------- the hot path's view
    def members(self, role: Role) -> list[Instance]:
        return [i for i in self.instances.values() if i.role == role and not i.removed]

    def snapshot(self, now: float) -> PoolSnapshot:
        """The pool as the policies see it; unchanged pods reuse their cached view."""
        prefill: list[InstanceSnapshot] = []
        decode: list[InstanceSnapshot] = []
        accounts = self.ledger.accounts
        for name, inst in self.instances.items():
            if inst.removed:
                continue
            snap = inst.view
            # TPOT budgets shrink with time: a view carrying some is rebuilt once they are stale.
            if snap is None or (
                snap.tpot_budgets.seconds and not 0.0 <= now - inst.view_at < BUDGETS_REFRESH_S
            ):
                inst.view_at = now
                snap = inst.view = view(
                    name,
                    snap.role if snap is not None else inst.member.role,
                    accounts.get(name),
                    inst.gauges,
                    now=now,
                    healthy=inst.healthy,
                    profile=inst.profile,
                )
            (decode if snap.role == "decode" else prefill).append(snap)
        return PoolSnapshot(
            now=now,
            prefill=prefill,
            decode=decode,
            unbound_kv_tokens=self.ledger.unbound_kv_tokens,
        )
