"""The sidecar's live view of its pool: members, scraped gauges, health, profiles, and the books.

It is the router's table of pods (`core.pods.Pods`: what the policies see of each pod, and the
ledger the router books requests in) with what only the sidecar knows of a pod: its URL, its
scrape failures, its KV event index, its model length. Collectors (`scrape`, `membership`,
`profiles`) write into it; the router (`core.router.Router`, run by `sidecar.service`) books the
requests; the hot path reads the `PoolSnapshot` built by `core.ledger.view` from both (the rule is
written down there), each pod's view cached until it or its account changes.

With `prefix_index`, it also keeps a `core.prefix_index.PrefixIndex`: the prompt blocks the router
sent to each prefill pod (the approximate index; a pod that leaves, or a new pod behind a name,
holds nothing we know of). A pod whose KV events the sidecar hears (`sidecar.kv_events`) also
has an `EventIndex`, read instead while it is live: it has announced something, and it has not
kept silent for `stale_after_s` after being sent blocks it did not hold (`cached_index`).

A pod that leaves the membership stays, marked `removed` and out of every snapshot, until the
last request routed to it ends.

Everything runs on one asyncio loop, so there are no locks: each method is atomic with respect
to the others. Time is passed in (`now`, monotonic seconds), never read here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from disaggpool.core.ledger import Entry, Gauges
from disaggpool.core.pods import Pod, Pods
from disaggpool.core.prefix_index import EventIndex, PrefixIndex
from disaggpool.core.profile import CalibrationProfile
from disaggpool.sidecar.config import Member

__all__ = ["Gauges", "Instance", "PoolState"]


@dataclasses.dataclass(slots=True, kw_only=True)
class Instance(Pod):
    """One pod: what the collectors know of it (`Pod`'s fields and the sidecar's own)."""

    member: Member
    scraped_at: float = -1.0
    failures: int = 0  # consecutive failed scrapes or connection errors
    profile_loaded_at: float = -1.0
    events: EventIndex | None = None  # its cache as its KV events announce it (prefill pods)
    events_at: float = -1.0  # when its last event batch arrived (-1: none yet)
    awaiting_events_since: float | None = None  # sent new blocks at; cleared by any batch
    max_model_len: int | None = None  # from its /v1/models, once read (None: not yet)

    @classmethod
    def of(cls, member: Member) -> Instance:
        return cls(member.name, member.role, member=member)


class PoolState(Pods[Instance]):
    """Members by name plus the ledger of in-flight requests (see the module docstring)."""

    def __init__(self, *, prefix_index: bool = False) -> None:
        super().__init__()
        self.prefix = PrefixIndex() if prefix_index else None

    # ---------------------------------------------------------------- membership and collectors
    def set_members(self, members: Iterable[Member]) -> tuple[list[str], list[str]]:
        """Make the pool exactly `members`; returns (added, removed) names."""
        wanted = {m.name: m for m in members}
        added, removed = [], []
        for name, member in wanted.items():
            inst = self.instances.get(name)
            if inst is None:
                self.add(Instance.of(member))
                added.append(name)
            elif inst.removed or inst.member != member:
                if inst.member.url != member.url:  # a new pod behind the name: forget the old one
                    inst.gauges, inst.healthy, inst.failures = None, True, 0
                    inst.max_model_len = None
                    inst.events, inst.events_at, inst.awaiting_events_since = None, -1.0, None
                    if self.prefix is not None:
                        self.prefix.forget(name)
                inst.member, inst.role, inst.removed = member, member.role, False
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
        inst.scraped_at = now
        inst.healthy, inst.failures = True, 0
        super().scraped(name, gauges, now)

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
    def touched(self, entry: Entry | None) -> None:
        """`entry`'s pods changed: their views are stale, and a removed pod whose last request
        this was is collected."""
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
