"""Kopf wiring: which watch events trigger a reconcile of which pool.

Every handler is a thin trigger: a DisaggPool event, or an event on one of its pods, profile
ConfigMaps, calibration Jobs or Deployments, marks that pool dirty. One worker task per pool runs
`reconcile.reconcile` until the pool is clean, so a burst of 16 pods turning Ready costs a couple
of passes, not 16, and two passes of one pool never race. A periodic resync re-marks every pool
(profiles go stale with time, not with events). Only watch-event handlers are used, so Kopf adds no
finalizers: deleting a pool never waits for the operator, owner references clean up.

The router's report on a pool (``status.router``: its decode recommendation, its pods' drift
errors) arrives as a DisaggPool watch event like any other change, so it triggers a pass too.

Health (``disaggpool operator --liveness URL``, Kopf's endpoint): Kopf serves it once the startup
handler has run; `_loops_alive` fails it when the resync loop has died, so the kubelet restarts
the operator (its liveness probe); reconcile errors never kill a worker (logged, retried with
backoff). The operator serves no traffic, so its readiness probe asks the same endpoint: ready
means started and alive (docs/operator.md, "Probes").

Settings (environment): DISAGGPOOL_IMAGE (the image the router and probe Jobs run; the operator's
own), DISAGGPOOL_ROUTER_MODE (`router.mode` of pools that name none: frontdoor, the default, or
gateway), DISAGGPOOL_RESYNC_SECONDS (default 60). Run with ``disaggpool operator`` (kopf run of this
module; ``--all-namespaces`` by default). With ``--namespace`` (`watch_namespaces`) it touches
nothing outside those namespaces (a namespaced Role in each suffices: Kopf does not scan
namespaces or CRDs, the resync lists each namespace's pools).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
from collections.abc import Sequence
from typing import Any

import kopf

from disaggpool.kubeclient import ApiError, Kube
from disaggpool.labels import (
    GROUP,
    MANAGED_BY,
    MANAGED_BY_LABEL,
    PLURAL,
    POOL_LABEL,
    PROBE_JOB_LABELS,
    PROFILE_LABELS,
    VERSION,
)
from disaggpool.operator.reconcile import pool_path, reconcile

__all__ = ["DEFAULT_IMAGE", "Coalescer", "watch_namespaces"]

log = logging.getLogger("disaggpool.operator")

DEFAULT_IMAGE = "ghcr.io/disaggpool/disaggpool:0.1.0"


class Coalescer:
    """Per-pool dirty flags, each drained by one worker task (see the module docstring)."""

    def __init__(self, kube: Kube, image: str, mode: str = "frontdoor") -> None:
        self.kube = kube
        self.image = image
        self.mode = mode
        self._dirty: dict[tuple[str, str], bool] = {}
        self._workers: dict[tuple[str, str], asyncio.Task[None]] = {}
        self.passes = 0

    def trigger(self, namespace: str, name: str) -> None:
        key = (namespace, name)
        self._dirty[key] = True
        if key not in self._workers:
            self._workers[key] = asyncio.create_task(self._work(key))

    async def _work(self, key: tuple[str, str]) -> None:
        backoff = 1.0
        try:
            while self._dirty.get(key):
                self._dirty[key] = False
                try:
                    result = await reconcile(
                        self.kube, *key, default_image=self.image, default_mode=self.mode
                    )
                    self.passes += 1
                    backoff = 1.0
                    if result.changed:
                        log.info(
                            "reconciled %s/%s: created %s updated %s deleted %s jobs %s",
                            *key,
                            result.created,
                            result.updated,
                            result.deleted,
                            result.jobs_created,
                        )
                except (TimeoutError, ApiError, OSError) as exc:
                    # Transient API trouble or a conflict: retry with jittered backoff, never crash.
                    log.warning("reconcile %s/%s failed, retrying: %s", *key, exc)
                    self._dirty[key] = True
                    await asyncio.sleep(backoff * (0.5 + random.random()))
                    backoff = min(backoff * 2, 30.0)
                except Exception:  # a bug: logged with its traceback, retried like the above
                    log.exception("reconcile %s/%s raised; retrying", *key)
                    self._dirty[key] = True
                    await asyncio.sleep(backoff * (0.5 + random.random()))
                    backoff = min(backoff * 2, 30.0)
        finally:
            del self._workers[key]

    async def close(self) -> None:
        for task in list(self._workers.values()):
            task.cancel()
        await asyncio.gather(*self._workers.values(), return_exceptions=True)
        await self.kube.close()


_state: dict[str, Any] = {"namespaces": ()}


def watch_namespaces(namespaces: Sequence[str]) -> None:
    """Serve only these namespaces (empty: all of them); set before `kopf.run`."""
    _state["namespaces"] = tuple(namespaces)


def _coalescer() -> Coalescer:
    c: Coalescer = _state["coalescer"]
    return c


async def _resync(period: float) -> None:
    """Re-mark every pool every `period`; listed per watched namespace (or cluster-wide), so a
    namespaced Role suffices. Never ends on an error: a dead resync fails the liveness probe."""
    scopes: tuple[str | None, ...] = _state["namespaces"] or (None,)
    while True:
        await asyncio.sleep(period)
        for scope in scopes:
            try:
                items = await _coalescer().kube.list(pool_path(scope), {})
            except (TimeoutError, ApiError, OSError) as exc:
                log.warning("resync list of %s failed: %s", scope or "all namespaces", exc)
                continue
            except Exception:
                log.exception("resync list of %s raised", scope or "all namespaces")
                continue
            for item in items:
                md = item.get("metadata") or {}
                _coalescer().trigger(md.get("namespace", ""), md.get("name", ""))


@kopf.on.startup()
async def _startup(settings: kopf.OperatorSettings, **_: Any) -> None:
    # Kopf's progress bookkeeping is unused (watch-event handlers only); keep it off the status.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    settings.watching.connect_timeout = 30
    if _state["namespaces"]:
        # Only the named namespaces: no cluster-wide listing of namespaces or CRDs (a
        # namespaced Role cannot grant it, and the names are fixed at start anyway).
        settings.scanning.disabled = True
    image = os.environ.get("DISAGGPOOL_IMAGE", DEFAULT_IMAGE)
    # An unknown mode is not refused here: every pool naming none reports it (router.mode).
    mode = os.environ.get("DISAGGPOOL_ROUTER_MODE") or "frontdoor"
    _state["coalescer"] = Coalescer(Kube.from_environment(), image, mode)
    period = float(os.environ.get("DISAGGPOOL_RESYNC_SECONDS", "60"))
    _state["resync"] = asyncio.create_task(_resync(period))


@kopf.on.probe(id="loops")
async def _loops_alive(**_: Any) -> dict[str, int]:
    """Liveness: the resync loop runs (each pool's worker restarts on its next trigger)."""
    task = _state.get("resync")
    if task is None or task.done():
        raise kopf.PermanentError("the resync loop has stopped")
    c = _coalescer()
    return {"passes": c.passes, "pools_in_progress": len(c._workers)}


@kopf.on.cleanup()
async def _cleanup(**_: Any) -> None:
    task = _state.pop("resync", None)
    if task is not None:
        task.cancel()
    if "coalescer" in _state:
        await _state.pop("coalescer").close()


@kopf.on.event(GROUP, VERSION, PLURAL)
async def _pool_event(
    event: kopf.RawEvent, namespace: str | None, name: str | None, **_: Any
) -> None:
    if event["type"] != "DELETED" and namespace and name:
        _coalescer().trigger(namespace, name)


def _trigger_from_labels(namespace: str | None, labels: kopf.Labels) -> None:
    pool = labels.get(POOL_LABEL)
    if namespace and pool:
        _coalescer().trigger(namespace, pool)


@kopf.on.event("v1", "pods", labels={POOL_LABEL: kopf.PRESENT})
async def _pod_event(namespace: str | None, labels: kopf.Labels, **_: Any) -> None:
    _trigger_from_labels(namespace, labels)


@kopf.on.event("v1", "configmaps", labels={POOL_LABEL: kopf.PRESENT, **PROFILE_LABELS})
async def _profile_event(namespace: str | None, labels: kopf.Labels, **_: Any) -> None:
    _trigger_from_labels(namespace, labels)


@kopf.on.event("batch", "v1", "jobs", labels={POOL_LABEL: kopf.PRESENT, **PROBE_JOB_LABELS})
async def _job_event(namespace: str | None, labels: kopf.Labels, **_: Any) -> None:
    _trigger_from_labels(namespace, labels)


@kopf.on.event("apps", "v1", "deployments", labels={MANAGED_BY_LABEL: MANAGED_BY})
async def _deployment_event(namespace: str | None, labels: kopf.Labels, **_: Any) -> None:
    _trigger_from_labels(namespace, labels)
