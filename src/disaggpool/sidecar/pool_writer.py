"""What the router tells the operator, written on its own DisaggPool's status: ``status.router``.

Sources, each optional: the autoscalers' recommendations (`sidecar.autoscale`,
``status.router.decodeRecommendation`` and ``status.router.prefillRecommendation``:
``{"replicas", "reason", "at"}``) and the per-pod
prediction error (`DriftReport`, ``status.router.observedErrors``: ``{"pods": [{"pod": POD,
"error": E, "profile": FITTED_AT}], "at"}``, the median relative error of the pod's recent
predictions and the profile it is about; a list, so that each write replaces the last whole).
Every `period_s` the `PoolWriter` asks each source for its value and merge-patches the pool's
status subresource with those that changed, in one request, each stamped with ``"at"``. The
router never writes the pool itself (its spec is what the operator deploys): its Role allows
`patch` on ``disaggpools/status`` of that one pool and nothing else on DisaggPools
(`operator.access.router_rules`); the operator leaves ``status.router`` as written. Without a
pool in the config it only refreshes the metrics. A failed write is logged and counted
(`disaggpool_pool_status_failures_total`) and retried at the next period; nothing else
depends on it.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import aiohttp

from disaggpool.kubeclient import ApiError, Kube, KubeUnavailable, path_for
from disaggpool.labels import API_VERSION, KIND, OBSERVED_ERRORS_KEY, ROUTER_STATUS_KEY
from disaggpool.sidecar.service import RoutingService

__all__ = ["AnnotationSource", "DriftReport", "PoolWriter"]

log = logging.getLogger("disaggpool.sidecar.pool_writer")


class AnnotationSource(Protocol):
    key: str

    def current(self) -> tuple[Any, dict[str, Any]] | None:
        """(what identifies the value, so an equal one is not written again; the body under
        ``status.router.<key>``), or None when there is nothing to say."""


class DriftReport:
    """Each pod's drift error (`core.drift`) with the profile it is about; errors are compared
    at one decimal, so the pool is written when an error moves by 0.1, not on every wobble."""

    key = OBSERVED_ERRORS_KEY

    def __init__(self, service: RoutingService) -> None:
        self.service = service

    def current(self) -> tuple[Any, dict[str, Any]] | None:
        svc = self.service
        errors = svc.drift.errors()
        gauge = svc.metrics.pod_prediction_error
        gauge.clear()
        for pod, error in errors.items():
            gauge.labels(pod).set(error)
        pods: list[dict[str, Any]] = []
        ident = {}
        for pod, error in sorted(errors.items()):
            if not math.isfinite(error):  # not JSON, and the status's schema wants a number
                continue
            inst = svc.state.instances.get(pod)
            fitted = inst.profile.fitted_at if inst and inst.profile else ""
            pods.append({"pod": pod, "error": round(error, 4), "profile": fitted})
            ident[pod] = (round(error, 1), fitted)
        return ident, {"pods": pods}


class PoolWriter:
    """Runs the sources every `period_s` and writes what changed on the pool."""

    def __init__(
        self,
        service: RoutingService,
        sources: Sequence[AnnotationSource],
        *,
        namespace: str,
        name: str,
        period_s: float,
        session: aiohttp.ClientSession | None,
        kube: Callable[[], Kube] | None = None,
    ) -> None:
        """`name` "": metrics only; `kube`: how to reach the API server (default: in-cluster or
        $KUBECONFIG, sharing `session`)."""
        self.service = service
        self.sources = list(sources)
        self.namespace, self.name = namespace, name
        self.period_s = period_s
        self._kube_factory = kube or (lambda: Kube.from_environment(session=session))
        self._kube: Kube | None = None
        self._written: dict[str, Any] = {}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._kube is not None:
            await self._kube.close()  # closes only a session of its own

    async def _run(self) -> None:
        while True:
            await self.step()
            await asyncio.sleep(self.period_s)

    async def step(self) -> dict[str, dict[str, Any]]:
        """One round; what was written under ``status.router`` (key -> body)."""
        changed: dict[str, tuple[Any, dict[str, Any]]] = {}
        for source in self.sources:
            got = source.current()
            if got is not None and got[0] != self._written.get(source.key):
                changed[source.key] = got
        if not self.name or not changed or self.service.standby:
            return {}  # a standby replica writes nothing: the leader writes the pool's status
        at = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        bodies = {key: {**body, "at": at} for key, (_, body) in changed.items()}
        # Every body has the same keys each time and lists replace whole in a merge patch:
        # nothing of an earlier write (this router's or a previous one's) survives this one.
        patch = {"status": {ROUTER_STATUS_KEY: bodies}}
        try:
            if self._kube is None:
                self._kube = self._kube_factory()
            path = path_for(API_VERSION, KIND, self.namespace, self.name) + "/status"
            await self._kube.merge_patch(path, patch)
        except (ApiError, KubeUnavailable, aiohttp.ClientError, OSError) as exc:
            self.service.metrics.pool_status_failures.inc()
            log.warning("pool %s/%s status not written: %s", self.namespace, self.name, exc)
            return {}
        for key, (ident, body) in changed.items():
            self._written[key] = ident
            log.info("pool %s/%s: %s = %s", self.namespace, self.name, key, json.dumps(body))
        return bodies
