"""Active/passive router replicas: one holds a coordination.k8s.io/v1 Lease and routes, the others
stand by (``leader_election`` in CONFIG.md; the rules are `core.lease`'s).

`LeaderElector.step` is one try, run every `retry_period_s` by the supervisor (loop
``leader_election``): read the Lease, and take or renew it when `core.lease.may_take` allows,
with the `resourceVersion` read (a replica that loses the race gets 409 Conflict and stays a
standby). It handles the API server's errors itself, so the period never grows with the
supervisor's backoff: a leader whose renewals have failed for `renew_deadline_s` steps down at
that step, and a request still hanging then is cut off at the deadline.

Standing by means: `service.standby` says why, and the readiness that says "this replica
routes" fails (`/readyz`, the gRPC health service, the picker's ``readiness`` and ext_proc
health); liveness stays up, the collectors keep the pool's view warm, and the pool writer writes
nothing (one replica writes the pool's status). A request that still reaches a standby is
answered, not refused. `release` (SIGTERM) writes the Lease free before the drain, so a standby
takes over at its next try rather than after the lease runs out.

Which replica gets the traffic: with ``endpoints`` (what the operator renders), the leader points
the Endpoints of a Service without a selector at itself, once per term (again at each renewal
until a write succeeds), and the kubelet's probe reads `/readyz?exclude=leader`, so every healthy
replica is Ready. Decision: readiness alone cannot steer the traffic, because a Deployment counts
only Ready pods as available: standbys that are never Ready stall every rolling update (the new
pods wait for the old leader to go, which waits for them to be Ready) and the Deployment never
reports its rollout complete. Without ``endpoints`` (a Service whose selector follows readiness),
the readiness above is the switch.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import ipaddress
import logging
import os
import time
import uuid
from collections.abc import Callable
from typing import Any

import aiohttp
from prometheus_client import Counter, Gauge

from disaggpool.core.lease import (
    LeaseRecord,
    lease_body,
    may_take,
    parse_lease,
    released,
    renewal_overdue,
    taken,
)
from disaggpool.errors import InputError
from disaggpool.kubeclient import ApiError, Kube, KubeUnavailable, path_for
from disaggpool.sidecar.book_bus import replica_name
from disaggpool.sidecar.config import LeaderElectionConfig, LeaderEndpoints
from disaggpool.sidecar.service import RoutingService

__all__ = ["LeaderElector", "default_identity"]

log = logging.getLogger("disaggpool.sidecar")

_API = "coordination.k8s.io/v1"
_ERRORS = (ApiError, KubeUnavailable, aiohttp.ClientError, OSError, TimeoutError)


def default_identity() -> str:
    """The pod's name and a suffix of this process's own (controller-runtime names its holders
    alike): a container the kubelet restarts in the same pod is a new candidate, which waits out
    its predecessor's lease like any other rather than resuming a term it knows nothing of."""
    return f"{replica_name()}_{uuid.uuid4().hex[:8]}"


class LeaderElector:
    """One replica's side of the election (module docstring)."""

    def __init__(
        self,
        config: LeaderElectionConfig,
        service: RoutingService,
        *,
        session: aiohttp.ClientSession | None = None,
        kube: Callable[[], Kube] | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC),
    ) -> None:
        self.config = config
        self.service = service
        self.identity = config.identity or default_identity()
        self.clock, self.wall = clock, wall
        self.timings = config.timings
        self._kube_factory = kube or (lambda: Kube.from_environment(session=session))
        self._kube: Kube | None = None
        self._record: LeaseRecord | None = None  # the Lease as last read or written
        self._observed_at = 0.0  # when that record was first seen, on our clock
        self._last_renewed = 0.0  # when our last successful write began
        self._stopped = False
        self._last_error = ""
        self.leading = False
        self.lease = f"{config.namespace}/{config.name}"
        self._path = path_for(_API, "Lease", config.namespace, config.name)
        self._endpoints = _endpoints_patch(config) if config.endpoints is not None else None
        self._endpoints_pointed = False  # this term's Endpoints write succeeded
        registry = service.metrics.registry
        self.gauge = Gauge(
            "disaggpool_leader", "1 while this replica holds the leader Lease and routes",
            registry=registry,
        )  # fmt: skip
        self.errors = Counter(
            "disaggpool_leader_election_errors",
            "failed reads and writes of the leader Lease (a lost race excluded)",
            registry=registry,
        )  # fmt: skip
        service.standby = f"standby: lease {self.lease} not taken yet"

    # ------------------------------------------------------------------ one try
    async def step(self) -> None:
        """Take or renew the Lease once; step down when renewals failed past the deadline."""
        if self._stopped:
            return
        now = self.clock()
        if self.leading and renewal_overdue(self._last_renewed, self.timings, now):
            self._step_down(f"not renewed for {self.timings.renew_deadline_s:g} s")
        left = self.timings.renew_deadline_s
        if self.leading:
            left = self._last_renewed + self.timings.renew_deadline_s - now
        try:
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation that
            # meets the inner call's end, and the supervisor's stop then waits for ever.
            async with asyncio.timeout(max(0.001, left)):
                await self._try()
        except _ERRORS as exc:
            self._failed(exc)
            if self.leading and renewal_overdue(self._last_renewed, self.timings, self.clock()):
                self._step_down(f"not renewed for {self.timings.renew_deadline_s:g} s: {exc}")
        except Exception as exc:  # a bug or a malformed Lease: the supervisor counts it and
            if self.leading:  # backs off, which would delay the next renewal: stand by now
                self._step_down(f"{type(exc).__name__}: {exc}")
            raise

    async def _try(self) -> None:
        if self._kube is None:
            self._kube = self._kube_factory()
        kube = self._kube
        obj = await kube.get(self._path)
        record = parse_lease(obj) if obj is not None else None
        seen = self.clock()
        if record is None or self._record is None or record != self._record:
            self._record, self._observed_at = record, seen
        if self._stopped:
            return
        if not may_take(record, self.identity, self._observed_at, seen):
            assert record is not None  # may_take allows taking a Lease that is not there
            if self.leading:
                self._step_down(f"the lease is held by {record.holder}")
            self.service.standby = f"standby: lease {self.lease} held by {record.holder}"
            return
        mine = taken(record, self.identity, self.timings, self.wall())
        body = lease_body(mine, self.config.namespace, self.config.name)
        began = self.clock()
        try:
            if record is None:
                written = await kube.create(path_for(_API, "Lease", self.config.namespace), body)
            else:
                written = await kube.replace(self._path, body)
        except ApiError as exc:
            if exc.status != 409:  # 409: another replica wrote first (or created it): not ours
                raise
            log.info("lease %s: another replica wrote it first; reading it again", self.lease)
            return
        self._record, self._observed_at = parse_lease(written), self.clock()
        self._last_renewed = began
        if self._last_error:
            log.info("lease %s: reachable again", self.lease)
            self._last_error = ""
        if not self.leading and not self._stopped:
            self._lead()
        if self.leading and self._endpoints is not None and not self._endpoints_pointed:
            await self._point_endpoints(kube, *self._endpoints)

    async def _point_endpoints(self, kube: Kube, path: str, patch: dict[str, Any]) -> None:
        """Point the Service's Endpoints at this replica; a failure is counted and logged, and
        the next renewal tries again (the Lease is held either way)."""
        try:
            await kube.merge_patch(path, patch)
        except _ERRORS as exc:
            self._failed(exc)
            return
        self._endpoints_pointed = True
        log.info("endpoints %s point at this replica: traffic comes here", path)

    # ------------------------------------------------------------------ transitions
    def _lead(self) -> None:
        self.leading = True
        self.service.standby = ""
        self.gauge.set(1)
        transitions = self._record.transitions if self._record is not None else 0
        log.info(
            "lease %s: %s leads now (transitions %d): routing", self.lease, self.identity,
            transitions,
        )  # fmt: skip

    def _step_down(self, why: str) -> None:
        self.leading = False
        self._endpoints_pointed = False  # whoever leads next writes them
        self.gauge.set(0)
        self.service.standby = f"standby: lease {self.lease} lost ({why})"
        log.warning("lease %s: %s steps down: %s; standing by", self.lease, self.identity, why)

    def _failed(self, exc: BaseException) -> None:
        self.errors.inc()
        message = f"{type(exc).__name__}: {exc}"
        if message != self._last_error:  # the same error again is counted, not logged again
            log.warning("lease %s: %s", self.lease, message)
            self._last_error = message

    async def release(self) -> None:
        """Stop trying and, when leading, write the Lease free (SIGTERM: a standby takes over at
        its next try); a failed write is logged, and the Lease then runs out on its own."""
        self._stopped = True
        if not self.leading or self._record is None or self._kube is None:
            return
        self.leading = False
        self.gauge.set(0)
        self.service.standby = f"standby: lease {self.lease} released"
        try:
            async with asyncio.timeout(self.timings.retry_period_s):
                freed = await self._free(self._kube, self._record)
        except _ERRORS as exc:
            log.warning("lease %s: not released (%s); it runs out on its own", self.lease, exc)
            return
        if freed:
            log.info("lease %s: released by %s", self.lease, self.identity)
        else:
            log.info("lease %s: held by another replica already; nothing to release", self.lease)

    async def _free(self, kube: Kube, record: LeaseRecord) -> bool:
        """Write `record` released; False when the Lease turned out not to be ours any more.

        A 409 here is a renewal of ours that was in flight when SIGTERM came and wrote first
        (seen on a busy host): read the Lease again and free it at its new version, once."""
        try:
            await kube.replace(self._path, self._released_body(record))
            return True
        except ApiError as exc:
            if exc.status != 409:
                raise
        obj = await kube.get(self._path)
        current = parse_lease(obj) if obj is not None else None
        if current is None or current.holder != self.identity:
            return False
        await kube.replace(self._path, self._released_body(current))
        return True

    def _released_body(self, record: LeaseRecord) -> dict[str, Any]:
        return lease_body(released(record, self.wall()), self.config.namespace, self.config.name)

    async def close(self) -> None:
        if self._kube is not None:
            await self._kube.close()  # closes only a session of its own


def _endpoints_patch(config: LeaderElectionConfig) -> tuple[str, dict[str, Any]]:
    """The path of `config.endpoints` and the merge patch that points them at this replica (its
    address, and its pod by name, as the endpoints controller would write it)."""
    ep: LeaderEndpoints | None = config.endpoints
    assert ep is not None
    address = ep.address or os.environ.get("POD_IP", "")
    try:
        ipaddress.ip_address(address)
    except ValueError:
        why = f"not an IP address: {address!r}" if address else "not set, and $POD_IP is unset"
        raise InputError("the sidecar's config", "leader_election.endpoints.address", why) from None
    target = {"kind": "Pod", "namespace": config.namespace, "name": replica_name()}
    ports = [{"name": name, "port": port, "protocol": "TCP"} for name, port in ep.ports]
    patch = {"subsets": [{"addresses": [{"ip": address, "targetRef": target}], "ports": ports}]}
    return path_for("v1", "Endpoints", config.namespace, ep.name), patch
