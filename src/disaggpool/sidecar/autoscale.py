"""The router's decode autoscaler: the decode pods the traffic it routes needs, for the operator.

The routing service feeds a `core.demand.DemandWindow` with every request it routes and every
one that finishes. Every `period_s`, `DecodeRecommender` reads it with the decode pods' live
state (healthy pods, their scraped queue and KV use, their trusted profiles) and runs the pure
`core.autoscaling.HeterogeneityScaler`; the result is exported as metrics and, when the config
names the DisaggPool, written on its status by `sidecar.pool_writer` as
``status.router.decodeRecommendation`` (``{"replicas", "reason", "at"}``), which the operator
applies within the pool's bounds (`operator.scaling`). Only a changed count is written, so the
operator is not woken for nothing.

Pods the router does not see yet (asked for, not Ready) are counted as starting: the count the
router last recommended minus the healthy ones, so a cold start in progress is not asked for
again and not cancelled by a scale-down computed from the ready pods alone.
"""

from __future__ import annotations

from typing import Any

from disaggpool.core.autoscaling import Bounds, HeterogeneityScaler, PoolState, ScaleDecision
from disaggpool.labels import DECODE_RECOMMENDATION_KEY
from disaggpool.sidecar.config import AutoscalingConfig
from disaggpool.sidecar.service import RoutingService

__all__ = ["DecodeRecommender"]


class DecodeRecommender:
    """One recommendation per call (see the module docstring); keeps the scaler's history."""

    key = DECODE_RECOMMENDATION_KEY

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
        svc.metrics.desired_decode.set(decision.replicas)
        return decision

    def current(self) -> tuple[Any, dict[str, Any]] | None:
        """For `sidecar.pool_writer`: (what identifies it, the body it writes), or None."""
        decision = self.recommend()
        if decision is None:
            return None
        self.last = decision.replicas
        return decision.replicas, {"replicas": decision.replicas, "reason": decision.reason}
