"""The sidecar's live view of its pool: members, scraped gauges, profiles, in-flight accounting.

Collectors (`scrape`, `membership`, `profiles`) write into it; the hot path reads a
`PoolSnapshot` built from it, with the same meaning as the simulator's `sim.router.RouterState`:

* prefill instance: `inflight` = `queued` = requests routed there whose prefill leg has not
  answered, `queued_tokens` / `queued_sq_tokens` their prompt tokens (and squares);
* decode instance: `inflight` = routed and not finished; `queued` = not yet decoding (no first
  token yet), `queued_tokens` their prompt tokens; `remaining_output_tokens` = predicted output
  of the in-flight requests minus what they generated so far (the front door counts streamed
  tokens); `tpot_targets` their TPOT targets.
* `running` / `waiting` are the pod's scraped gauges, raised to the router's own count of
  requests decoding / queued there when that is higher: a scrape is up to one interval old,
  while our own accounting is exact for the requests we routed. `kv_tokens_used` is the scraped
  value plus the prompt tokens routed there since that scrape.

Everything runs on one asyncio loop, so there are no locks: each method is atomic with respect
to the others. Time is passed in (`now`, monotonic seconds), never read here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from disaggpool.core.contracts import InstanceSnapshot, PoolSnapshot, Role, SLOClass
from disaggpool.core.profile import CalibrationProfile
from disaggpool.sidecar.config import Member

__all__ = ["Gauges", "InflightRecord", "Instance", "PoolState"]


@dataclasses.dataclass(frozen=True, slots=True)
class Gauges:
    """What one scrape of a pod's /metrics said."""

    running: int
    waiting: int
    kv_usage: float  # fraction of the KV cache in use
    kv_capacity_tokens: int  # num_gpu_blocks * block_size (0 if not reported)
    preemptions: float = 0.0


@dataclasses.dataclass(slots=True)
class Instance:
    """One pod and the router's counters for it."""

    member: Member
    gauges: Gauges | None = None
    scraped_at: float = -1.0
    healthy: bool = True
    failures: int = 0  # consecutive failed scrapes or connection errors
    profile: CalibrationProfile | None = None
    profile_loaded_at: float = -1.0
    removed: bool = False  # gone from membership; kept while requests are still in flight
    inflight: int = 0
    queued: int = 0
    queued_tokens: int = 0
    queued_sq_tokens: float = 0.0
    decoding: int = 0
    predicted_left: float = 0.0
    tokens_since_scrape: int = 0
    targets: dict[float, int] = dataclasses.field(default_factory=dict)
    view: InstanceSnapshot | None = None  # cached snapshot; None after any change

    @property
    def name(self) -> str:
        return self.member.name

    @property
    def role(self) -> Role:
        return self.member.role


@dataclasses.dataclass(slots=True)
class InflightRecord:
    """A routed request the router has not seen finish."""

    request_id: str
    prefill: str
    decode: str
    prompt_tokens: int
    predicted_output: float
    slo: SLOClass
    routed_at: float
    prefilled: bool = False
    decoding: bool = False
    generated: int = 0


class PoolState:
    """Members by name plus the in-flight records (see the module docstring)."""

    def __init__(self) -> None:
        self.instances: dict[str, Instance] = {}
        self.records: dict[str, InflightRecord] = {}

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
                inst.member, inst.removed = member, False
                inst.view = None
        for name, inst in list(self.instances.items()):
            if name not in wanted and not inst.removed:
                inst.removed = True
                removed.append(name)
                if inst.inflight == 0:
                    del self.instances[name]
        return added, removed

    def scraped(self, name: str, gauges: Gauges, now: float) -> None:
        inst = self.instances.get(name)
        if inst is None:
            return
        inst.gauges, inst.scraped_at = gauges, now
        inst.healthy, inst.failures = True, 0
        inst.tokens_since_scrape = 0
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

    # ---------------------------------------------------------------- request lifecycle
    def routed(self, rec: InflightRecord) -> None:
        if rec.request_id in self.records:
            raise KeyError(f"request id {rec.request_id!r} is already in flight")
        self.records[rec.request_id] = rec
        p, d = self.instances[rec.prefill], self.instances[rec.decode]
        n = rec.prompt_tokens
        p.inflight += 1
        p.queued += 1
        p.queued_tokens += n
        p.queued_sq_tokens += float(n) * n
        d.inflight += 1
        d.queued += 1
        d.queued_tokens += n
        d.predicted_left += rec.predicted_output
        d.tokens_since_scrape += n
        d.targets[rec.slo.tpot_s] = d.targets.get(rec.slo.tpot_s, 0) + 1
        p.view = d.view = None

    def prefilled(self, request_id: str) -> bool:
        rec = self.records.get(request_id)
        if rec is None or rec.prefilled:
            return rec is not None
        rec.prefilled = True
        self._release_prefill(rec)
        return True

    def progress(self, request_id: str, generated: int) -> bool:
        """`generated` output tokens so far; the first call with > 0 marks it decoding."""
        rec = self.records.get(request_id)
        if rec is None:
            return False
        if not rec.prefilled:
            self.prefilled(request_id)
        d = self.instances[rec.decode]
        if not rec.decoding and generated > 0:
            rec.decoding = True
            d.queued -= 1
            d.queued_tokens -= rec.prompt_tokens
            d.decoding += 1
        step = max(0, generated - rec.generated)
        d.predicted_left -= min(step, max(0.0, rec.predicted_output - rec.generated))
        rec.generated = max(rec.generated, generated)
        d.view = None
        return True

    def finished(self, request_id: str) -> InflightRecord | None:
        """Forget a request (finished, failed or expired); returns its record, if known."""
        rec = self.records.pop(request_id, None)
        if rec is None:
            return None
        if not rec.prefilled:
            self._release_prefill(rec)
        d = self.instances[rec.decode]
        d.inflight -= 1
        if rec.decoding:
            d.decoding -= 1
        else:
            d.queued -= 1
            d.queued_tokens -= rec.prompt_tokens
        d.predicted_left -= max(0.0, rec.predicted_output - rec.generated)
        if d.inflight == 0:
            d.predicted_left = 0.0  # no float residue once idle
        left = d.targets[rec.slo.tpot_s] - 1
        if left:
            d.targets[rec.slo.tpot_s] = left
        else:
            del d.targets[rec.slo.tpot_s]
        d.view = None
        self._collect(d)
        return rec

    def expired(self, now: float, ttl: float) -> list[InflightRecord]:
        """Forget requests routed more than `ttl` seconds ago (a caller that never reported)."""
        old = [r.request_id for r in self.records.values() if now - r.routed_at > ttl]
        return [rec for rid in old if (rec := self.finished(rid)) is not None]

    def _release_prefill(self, rec: InflightRecord) -> None:
        p = self.instances[rec.prefill]
        n = rec.prompt_tokens
        p.inflight -= 1
        p.queued -= 1
        p.queued_tokens -= n
        p.queued_sq_tokens -= float(n) * n
        if p.inflight == 0:
            p.queued_sq_tokens = 0.0
        p.view = None
        self._collect(p)

    def _collect(self, inst: Instance) -> None:
        if inst.removed and inst.inflight == 0:
            self.instances.pop(inst.name, None)

    # ---------------------------------------------------------------- the hot path's view
    def members(self, role: Role) -> list[Instance]:
        return [i for i in self.instances.values() if i.role == role and not i.removed]

    def snapshot(self, now: float) -> PoolSnapshot:
        """The pool as the policies see it; unchanged pods reuse their cached view."""
        prefill: list[InstanceSnapshot] = []
        decode: list[InstanceSnapshot] = []
        for inst in self.instances.values():
            if inst.removed:
                continue
            view = inst.view
            if view is None:
                view = inst.view = _view(inst)
            (prefill if inst.role == "prefill" else decode).append(view)
        return PoolSnapshot(now=now, prefill=prefill, decode=decode)


def _view(inst: Instance) -> InstanceSnapshot:
    g = inst.gauges
    kv_used = 0
    running = waiting = 0
    if g is not None:
        running, waiting = g.running, g.waiting
        kv_used = int(g.kv_usage * g.kv_capacity_tokens)
    kv_used += inst.tokens_since_scrape
    if inst.role == "prefill":
        return InstanceSnapshot(
            name=inst.name,
            role="prefill",
            running=running,
            waiting=max(waiting, inst.queued),
            kv_tokens_used=kv_used,
            inflight=inst.inflight,
            queued=inst.queued,
            queued_tokens=inst.queued_tokens,
            queued_sq_tokens=inst.queued_sq_tokens,
            healthy=inst.healthy,
            profile=inst.profile,
        )
    return InstanceSnapshot(
        name=inst.name,
        role="decode",
        running=max(running, inst.decoding),
        waiting=max(waiting, inst.queued),
        kv_tokens_used=kv_used,
        inflight=inst.inflight,
        queued=inst.queued,
        queued_tokens=inst.queued_tokens,
        remaining_output_tokens=max(float(inst.decoding), inst.predicted_left),
        tpot_targets=tuple(sorted(inst.targets.items())),
        healthy=inst.healthy,
        profile=inst.profile,
    )
