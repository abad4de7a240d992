"""The router's autoscalers: the decode and prefill pods its traffic needs, for the operator.

The routing service feeds a `core.demand.DemandWindow` with every request it routes (its prompt,
its predicted output, whether its decode pod prefills it) and every one that finishes. Every
`period_s`, each recommender reads it with its role's live state (healthy pods, their scraped
queue, running requests and KV use, their trusted profiles) and runs a pure scaler:

* `DecodeRecommender`: `core.autoscaling.HeterogeneityScaler`, sized for the tightest TPOT
  target, written as ``status.router.decodeRecommendation``;
* `PrefillRecommender` (only with ``autoscaling.prefill``): `core.prefill_scaling.PrefillScaler`,
  sized for the tightest TTFT target, written as ``status.router.prefillRecommendation``.

Each result (``{"replicas", "reason", "at"}``) is exported as a metric and, when the config names
the DisaggPool, written on its status by `sidecar.pool_writer`; the operator applies it within
that role's bounds (`operator.scaling`). Only a changed count is written, so the operator is not
woken for nothing.

Pods the router does not see yet (asked for, not Ready) are counted as starting: the count the
router last recommended minus the healthy ones, so a cold start in progress is not asked for
again and not cancelled by a scale-down computed from the ready pods alone.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any, Protocol

from prometheus_client import Gauge

from disaggpool.core.autoscaling import Bounds, HeterogeneityScaler, PoolState, ScaleDecision
from disaggpool.core.contracts import Role
from disaggpool.core.demand import Demand
from disaggpool.core.prefill_scaling import PrefillScaler
from disaggpool.core.profile import CalibrationProfile
from disaggpool.labels import DECODE_RECOMMENDATION_KEY, PREFILL_RECOMMENDATION_KEY
from disaggpool.sidecar.config import AutoscalingConfig, ReplicaBounds
from disaggpool.sidecar.service import RoutingService

__all__ = ["DecodeRecommender", "PrefillRecommender"]


class _Scaler(Protocol):
    """What `HeterogeneityScaler` and `PrefillScaler` share."""

    profiles: list[CalibrationProfile]

    def decide(self, demand: Demand, pool: PoolState) -> ScaleDecision: ...


class _Recommender(abc.ABC):
    """One role's recommendation per call (module docstring); keeps the scaler's history.
    Subclasses name the role, its status key and gauge, and build its scaler."""

    role: Role
    key: str

    def __init__(
        self, config: AutoscalingConfig, service: RoutingService, bounds: ReplicaBounds
    ) -> None:
        self.config = config
        self.service = service
        self.bounds = Bounds(
            bounds.min_replicas, bounds.max_replicas, config.startup_s, config.stabilization_s
        )
        self._scaler: _Scaler | None = None
        self.last: int | None = None  # the last count recommended

    @abc.abstractmethod
    def _make_scaler(self, profiles: Sequence[CalibrationProfile]) -> _Scaler:
        """The role's scaler, sized by `profiles` and the role's SLO target."""

    @abc.abstractmethod
    def _gauge(self) -> Gauge:
        """The metric of the replicas this role's autoscaler recommends."""

    def recommend(self) -> ScaleDecision | None:
        """The role's replicas the traffic needs now; None without a trusted profile of the
        role (nothing to size the pods by: the operator keeps the pool as it is)."""
        svc = self.service
        pods = [i for i in svc.state.members(self.role) if i.healthy]
        profiles = [i.profile for i in pods if i.profile is not None and i.profile.trusted]
        if not profiles:
            return None
        if self._scaler is None:
            self._scaler = self._make_scaler(profiles)
        self._scaler.profiles = profiles  # re-probes and new pods change them
        gauges = [i.gauges for i in pods if i.gauges is not None]
        ready = len(pods)
        state = PoolState(
            ready=ready,
            starting=max(0, (self.last or ready) - ready),
            waiting=sum(g.waiting for g in gauges),
            deferred=sum(g.deferred for g in gauges),
            running=sum(g.running for g in gauges),
            kv_usage=sum(g.kv_usage for g in gauges),
        )
        decision = self._scaler.decide(svc.demand.demand(svc.clock()), state)
        self._gauge().set(decision.replicas)
        return decision

    def current(self) -> tuple[Any, dict[str, Any]] | None:
        """For `sidecar.pool_writer`: (what identifies it, the body it writes), or None."""
        decision = self.recommend()
        if decision is None:
            return None
        self.last = decision.replicas
        return decision.replicas, {"replicas": decision.replicas, "reason": decision.reason}


class DecodeRecommender(_Recommender):
    """Decode pods for the tightest TPOT target over the SLO classes."""

    role = "decode"
    key = DECODE_RECOMMENDATION_KEY

    def __init__(self, config: AutoscalingConfig, service: RoutingService) -> None:
        super().__init__(config, service, ReplicaBounds(config.min_replicas, config.max_replicas))

    def _make_scaler(self, profiles: Sequence[CalibrationProfile]) -> _Scaler:
        tpot = min(c.tpot_s for c in self.service.config.slo_classes)
        return HeterogeneityScaler(
            self.bounds,
            profiles,
            tpot,
            self.config.target_goodput,
            min_headroom=self.config.min_headroom,
        )

    def _gauge(self) -> Gauge:
        return self.service.metrics.desired_decode


class PrefillRecommender(_Recommender):
    """Prefill pods for the tightest TTFT target over the SLO classes (``autoscaling.prefill``
    gives the bounds)."""

    role = "prefill"
    key = PREFILL_RECOMMENDATION_KEY

    def __init__(self, config: AutoscalingConfig, service: RoutingService) -> None:
        if config.prefill is None:
            raise ValueError("a prefill recommender needs autoscaling.prefill")
        super().__init__(config, service, config.prefill)

    def _make_scaler(self, profiles: Sequence[CalibrationProfile]) -> _Scaler:
        ttft = min(c.ttft_s for c in self.service.config.slo_classes)
        return PrefillScaler(
            self.bounds,
            profiles,
            ttft,
            self.config.target_goodput,
            min_headroom=self.config.min_headroom,
        )

    def _gauge(self) -> Gauge:
        return self.service.metrics.desired_prefill
