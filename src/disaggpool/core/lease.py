"""Leader election on a coordination.k8s.io/v1 Lease, as pure decisions: no I/O, no clock.

One router replica routes, the others stand by (`sidecar.leader` does the I/O and keeps the
time). The rules are Kubernetes' own (client-go's leaderelection), restated:

* a Lease with no holder (never taken, or released) may be taken at once;
* a Lease held by another may be taken once `lease_duration_s` has passed *on our own clock*
  since we last saw its record change (`observed_at`): the holder's `renewTime` is written by
  another machine's clock, so it is shown, never compared;
* the holder keeps it by writing a new `renewTime` before `renew_deadline_s` has passed since its
  last successful write, and steps down at once when it has not: `renew_deadline_s` is shorter
  than `lease_duration_s`, so a replica that lost the API server stops leading before any other
  may take over;
* every write carries the `resourceVersion` it read, so of two replicas taking the same Lease at
  once the API server accepts one and answers the other 409 Conflict;
* each taking of an existing Lease (from another holder, or after a release) counts one
  `leaseTransitions`; releasing writes no holder and a 1 s
  duration, so a standby takes over at its next try rather than after an expiry.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Mapping
from typing import Any

__all__ = [
    "LeaseRecord",
    "LeaseTimings",
    "lease_body",
    "may_take",
    "parse_lease",
    "released",
    "renewal_overdue",
    "taken",
]


@dataclasses.dataclass(frozen=True, slots=True)
class LeaseTimings:
    """How long a Lease lasts unrenewed, how long its holder tries to renew before stepping
    down, and how often every replica tries (lease > renew deadline > retry period)."""

    lease_duration_s: float = 15.0
    renew_deadline_s: float = 10.0
    retry_period_s: float = 2.0

    def problems(self) -> list[tuple[str, str]]:
        """(field, why) for each rule broken; [] when the timings are usable."""
        out: list[tuple[str, str]] = []
        if self.lease_duration_s < 1:  # leaseDurationSeconds is a whole number of seconds
            out.append(("lease_duration_s", "must be at least 1"))
        if not self.renew_deadline_s < self.lease_duration_s:
            out.append(
                ("renew_deadline_s", "must be shorter than lease_duration_s, or two could lead")
            )
        if not 0 < self.retry_period_s < self.renew_deadline_s:
            out.append(("retry_period_s", "must be positive and shorter than renew_deadline_s"))
        return out


@dataclasses.dataclass(frozen=True, slots=True)
class LeaseRecord:
    """What a Lease says (its spec) and the `resourceVersion` it was read at."""

    holder: str = ""
    duration_s: int = 0
    acquire_time: str = ""  # MicroTime text, as the API server stores it
    renew_time: str = ""
    transitions: int = 0
    resource_version: str = ""


def parse_lease(obj: Mapping[str, Any]) -> LeaseRecord:
    """A Lease object (as the API server returns it) as a `LeaseRecord`."""
    spec = obj.get("spec") or {}
    return LeaseRecord(
        holder=str(spec.get("holderIdentity") or ""),
        duration_s=int(spec.get("leaseDurationSeconds") or 0),
        acquire_time=str(spec.get("acquireTime") or ""),
        renew_time=str(spec.get("renewTime") or ""),
        transitions=int(spec.get("leaseTransitions") or 0),
        resource_version=str((obj.get("metadata") or {}).get("resourceVersion") or ""),
    )


def may_take(record: LeaseRecord | None, me: str, observed_at: float, now: float) -> bool:
    """Whether `me` may write itself as holder: no Lease yet, no holder, already `me`, or the
    holder's lease ran out on our clock (`observed_at`: when we saw this record first)."""
    if record is None or not record.holder or record.holder == me:
        return True
    return now >= observed_at + record.duration_s


def renewal_overdue(last_renewed: float, timings: LeaseTimings, now: float) -> bool:
    """Whether the holder has failed to renew for `renew_deadline_s`: it must step down."""
    return now >= last_renewed + timings.renew_deadline_s


def taken(
    record: LeaseRecord | None, me: str, timings: LeaseTimings, wall: dt.datetime
) -> LeaseRecord:
    """The record `me` writes to take or renew the Lease at wall time `wall` (UTC): the same
    `acquireTime` and transitions when renewing, a new `acquireTime` and one more transition
    when the holder changes."""
    stamp = micro_time(wall)
    duration = max(1, round(timings.lease_duration_s))
    if record is not None and record.holder == me:
        return dataclasses.replace(record, duration_s=duration, renew_time=stamp)
    transitions = 0 if record is None else record.transitions + 1  # also after a release
    version = "" if record is None else record.resource_version
    return LeaseRecord(me, duration, stamp, stamp, transitions, version)


def released(record: LeaseRecord, wall: dt.datetime) -> LeaseRecord:
    """The record a holder writes on leaving: no holder, a 1 s duration (client-go's too)."""
    return dataclasses.replace(record, holder="", duration_s=1, renew_time=micro_time(wall))


def lease_body(record: LeaseRecord, namespace: str, name: str) -> dict[str, Any]:
    """The Lease object to create or replace; with `resource_version` set the write is
    conditional on it (the API server answers 409 when the Lease has changed since)."""
    metadata: dict[str, Any] = {"name": name, "namespace": namespace}
    if record.resource_version:
        metadata["resourceVersion"] = record.resource_version
    spec: dict[str, Any] = {
        "holderIdentity": record.holder or None,
        "leaseDurationSeconds": record.duration_s,
        "leaseTransitions": record.transitions,
    }
    if record.acquire_time:
        spec["acquireTime"] = record.acquire_time
    if record.renew_time:
        spec["renewTime"] = record.renew_time
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": metadata,
        "spec": spec,
    }


def micro_time(wall: dt.datetime) -> str:
    """A Kubernetes MicroTime: RFC 3339 with microseconds, in UTC."""
    return wall.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
