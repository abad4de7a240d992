"""The router's decode autoscaler: the decode pods the traffic it routes needs, for the operator.

The routing service feeds a `core.demand.DemandWindow` with every request it routes and every
one that finishes. Every `period_s`, `DecodeRecommender` reads it with the decode pods' live
state (healthy pods, their scraped queue and KV use, their trusted profiles) and runs the pure
`core.autoscaling.HeterogeneityScaler`; the result is exported as metrics and, when the config
names the DisaggPool, written on it as the annotation ``disaggpool.io/decode-recommendation``
(``{"replicas", "reason", "at"}``), which the operator applies within the pool's bounds
(`operator.scaling`). Only a changed count is written, so the operator is not woken for nothing.

Pods the router does not see yet (asked for, not Ready) are counted as starting: the count the
router last recommended minus the healthy ones, so a cold start in progress is not asked for
again and not cancelled by a scale-down computed from the ready pods alone.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
from collections.abc import Callable
from typing import Any

import aiohttp

from disaggpool.core.autoscaling import Bounds, HeterogeneityScaler, PoolState, ScaleDecision
from disaggpool.kubeclient import ApiError, Kube, KubeUnavailable, path_for
from disaggpool.labels import API_VERSION, DECODE_RECOMMENDATION_ANNOTATION, KIND
from disaggpool.sidecar.config import AutoscalingConfig
from disaggpool.sidecar.service import RoutingService

__all__ = ["AutoscalerTask", "DecodeRecommender"]

log = logging.getLogger("disaggpool.sidecar.autoscale")


class DecodeRecommender:
    """One recommendation per call (see the module docstring); keeps the scaler's history."""

    def __init__(self, config: AutoscalingConfig, service: RoutingService) -> None:
        self.config = config
        self.service = service
        self.bounds = Bounds(
            config.min_replicas, config.max_replicas, config.startup_s, config.stabilization_s
        )
        self._scaler: HeterogeneityScaler | None = None
        self.last: int | None = None  # the last count recommended

    def recommend(self) -> ScaleDecision | None:
        """The decode replicas the traffic needs now; None without a trusted decode profile
        (nothing to size the pods by: the operator keeps the pool as it is)."""
        svc = self.service
        decode = [i for i in svc.state.members("decode") if i.healthy]
        profiles = [i.profile for i in decode if i.profile is not None and i.profile.trusted]
        if not profiles:
            return None
        if self._scaler is None:
            tpot = min(c.tpot_s for c in svc.config.slo_classes)
            self._scaler = HeterogeneityScaler(
                self.bounds, profiles, tpot, self.config.target_goodput
            )
        self._scaler.profiles = profiles  # re-probes and new pods change them
        gauges = [i.gauges for i in decode if i.gauges is not None]
        ready = len(decode)
        state = PoolState(
            ready=ready,
            starting=max(0, (self.last or ready) - ready),
            waiting=sum(g.waiting for g in gauges),
            kv_usage=sum(g.kv_usage for g in gauges),
        )
        demand = svc.demand.demand(svc.clock())
        decision = self._scaler.decide(demand, state)
        m = svc.metrics
        m.demand_rate.set(demand.arrival_rps)
        m.demand_dispersion.set(demand.dispersion)
        m.desired_decode.set(decision.replicas)
        return decision


class AutoscalerTask:
    """Runs a `DecodeRecommender` every `period_s` and writes changed counts on the pool."""

    def __init__(
        self,
        config: AutoscalingConfig,
        service: RoutingService,
        session: aiohttp.ClientSession,
        *,
        kube: Callable[[], Kube] | None = None,
    ) -> None:
        """`kube`: how to reach the API server (default: in-cluster or $KUBECONFIG)."""
        self.config = config
        self.recommender = DecodeRecommender(config, service)
        self.session = session
        self._kube_factory = kube or (lambda: Kube.from_environment(session=session))
        self._kube: Kube | None = None
        self._published: int | None = None
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
            await asyncio.sleep(self.config.period_s)

    async def step(self) -> ScaleDecision | None:
        """One recommendation, written on the pool when its count changed."""
        decision = self.recommender.recommend()
        if decision is None:
            return None
        self.recommender.last = decision.replicas
        changed = decision.replicas != self._published
        if self.config.pool_name and changed and await self._publish(decision):
            self._published = decision.replicas
        return decision

    async def _publish(self, decision: ScaleDecision) -> bool:
        cfg = self.config
        body: dict[str, Any] = {
            "replicas": decision.replicas,
            "reason": decision.reason,
            "at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        }
        patch = {"metadata": {"annotations": {DECODE_RECOMMENDATION_ANNOTATION: json.dumps(body)}}}
        path = path_for(API_VERSION, KIND, cfg.pool_namespace, cfg.pool_name)
        try:
            if self._kube is None:
                self._kube = self._kube_factory()
            await self._kube.merge_patch(path, patch)
        except (ApiError, KubeUnavailable, aiohttp.ClientError, OSError) as exc:
            self.recommender.service.metrics.autoscaler_publish_failures.inc()
            log.warning(
                "decode recommendation %d not written on the pool: %s", decision.replicas, exc
            )
            return False
        log.info("decode recommendation %d: %s", decision.replicas, decision.reason)
        return True
