"""The routing service: one object that both adapters (gRPC servicer, HTTP front door) call.

`route` predicts the output length, snapshots the pool, asks the configured policy (the very
`core.policies` object the simulator runs) for a (prefill, decode) pair and books the request in
flight; `prefilled` / `progress` / `finished` / `failed` move it through its life, feed the
output-length predictor, the goodput and heterogeneity signals and the predicted-vs-observed
error. Synchronous and loop-confined: no awaits, so a decision is atomic.

Errors are typed so each adapter maps them to its protocol: `BadRequest` (INVALID_ARGUMENT /
400), `Overloaded` (RESOURCE_EXHAUSTED / 429), `NoCapacity` (UNAVAILABLE / 503), `Duplicate`
(ALREADY_EXISTS / 409).
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Callable, Collection

from disaggpool.core.contracts import PoolSnapshot, RequestFeatures, RouteDecision, SLOClass
from disaggpool.core.heterogeneity import SlidingSpread
from disaggpool.core.policies.base import NoCapacityError, Policy
from disaggpool.core.policies.registry import make_policy
from disaggpool.core.predictor import OutputPredictor, make_predictor
from disaggpool.sidecar.config import Member, SidecarConfig
from disaggpool.sidecar.metrics import SidecarMetrics
from disaggpool.sidecar.state import InflightRecord, PoolState

__all__ = [
    "BadRequest",
    "Duplicate",
    "NoCapacity",
    "Overloaded",
    "Routed",
    "RoutingService",
    "ServiceError",
]

log = logging.getLogger("disaggpool.sidecar")

MAX_REQUEST_ID = 128


class ServiceError(Exception):
    """A request the service refuses; `field` names the offending input when there is one."""

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(message)
        self.field = field


class BadRequest(ServiceError):
    pass


class Overloaded(ServiceError):
    pass


class NoCapacity(ServiceError):
    pass


class Duplicate(ServiceError):
    pass


@dataclasses.dataclass(frozen=True, slots=True)
class Routed:
    """A decision with the endpoints to call and what it was based on."""

    request_id: str
    prefill: Member
    decode: Member
    decision: RouteDecision
    slo: SLOClass
    predicted_output_tokens: float
    prompt_tokens: int
    max_tokens: int | None = None


class RoutingService:
    """Policy + predictor + live state (see the module docstring)."""

    def __init__(
        self,
        config: SidecarConfig,
        state: PoolState | None = None,
        *,
        policy: Policy | None = None,
        predictor: OutputPredictor | None = None,
        seed: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.state = state or PoolState()
        self.policy = policy or make_policy(config.policy)
        self.predictor = predictor or make_predictor(config.predictor)
        self.rng = random.Random(seed)
        self.clock = clock
        self.metrics = SidecarMetrics(self.state, clock, config.heterogeneity_window)
        self.spread = SlidingSpread(config.heterogeneity_window)
        self._untrusted_logged: set[str] = set()

    # ------------------------------------------------------------------ deciding
    def route(
        self,
        request_id: str,
        prompt_tokens: int,
        slo_class: str = "",
        *,
        max_tokens: int | None = None,
        exclude_prefill: Collection[str] = (),
    ) -> Routed:
        if not request_id or len(request_id) > MAX_REQUEST_ID or not request_id.isprintable():
            raise BadRequest("must be 1-128 printable characters", "request_id")
        if prompt_tokens < 1:
            raise BadRequest(f"must be at least 1, got {prompt_tokens}", "prompt_tokens")
        slo = self.config.slo(slo_class)
        if slo is None:
            names = ", ".join(c.name for c in self.config.slo_classes)
            raise BadRequest(f"unknown SLO class {slo_class!r}; valid: {names}", "slo_class")
        if request_id in self.state.records:
            raise Duplicate(f"request id {request_id!r} is already in flight", "request_id")
        if len(self.state.records) >= self.config.max_inflight:
            self.metrics.rejected.labels("overload").inc()
            raise Overloaded(f"{len(self.state.records)} requests in flight (max_inflight)")
        now = self.clock()
        pred = self.predictor.predict(slo.name, prompt_tokens, self.rng)
        predicted = pred.mean if not max_tokens else min(pred.mean, float(max_tokens))
        features = RequestFeatures(
            request_id=request_id,
            prompt_tokens=prompt_tokens,
            predicted_output_tokens=predicted,
            output_uncertainty=pred.std,
            slo=slo,
        )
        pool = self._pool(now, exclude_prefill)
        started = time.perf_counter()
        try:
            decision = self.policy.route(features, pool, self.rng)
        except NoCapacityError as exc:
            self.metrics.rejected.labels("no_capacity").inc()
            raise NoCapacity(str(exc)) from None
        self.metrics.decision_seconds.observe(time.perf_counter() - started)
        self._account(decision)
        p = self.state.instances[decision.prefill]
        d = self.state.instances[decision.decode]
        self.state.routed(
            InflightRecord(request_id, p.name, d.name, prompt_tokens, predicted, slo, routed_at=now)
        )
        self.metrics.inflight.set(len(self.state.records))
        return Routed(
            request_id, p.member, d.member, decision, slo, predicted, prompt_tokens, max_tokens
        )

    def reroute(self, routed: Routed, exclude_prefill: Collection[str]) -> Routed:
        """Route a request again (its prefill leg failed), avoiding the pods that failed it."""
        self.state.finished(routed.request_id)
        return self.route(
            routed.request_id,
            routed.prompt_tokens,
            routed.slo.name,
            max_tokens=routed.max_tokens,
            exclude_prefill=exclude_prefill,
        )

    def _pool(self, now: float, exclude_prefill: Collection[str]) -> PoolSnapshot:
        pool = self.state.snapshot(now)
        if not exclude_prefill:
            return pool
        prefill = [
            dataclasses.replace(i, healthy=False) if i.name in exclude_prefill else i
            for i in pool.prefill
        ]
        return dataclasses.replace(pool, prefill=prefill)

    def _account(self, decision: RouteDecision) -> None:
        m = self.metrics
        m.decisions.labels(decision.policy, "prefill", decision.prefill).inc()
        m.decisions.labels(decision.policy, "decode", decision.decode).inc()
        if decision.fallback is None:
            return
        m.fallbacks.labels(decision.fallback).inc()
        for name in (decision.prefill, decision.decode):
            inst = self.state.instances[name]
            if (inst.profile is None or not inst.profile.trusted) and (
                name not in self._untrusted_logged
            ):
                self._untrusted_logged.add(name)
                log.warning(
                    "pod %s has no trusted calibration profile (%s): routing with %s",
                    name,
                    "none" if inst.profile is None else inst.profile.quality,
                    "the median trusted profile"
                    if decision.fallback == "median-profile"
                    else "least-loaded",
                )

    def pod_failed(self, pod: str) -> None:
        """A pod failed a request leg (refused, reset, 5xx): stop routing to it until a scrape
        succeeds again. Adapters report it here rather than touching the pool state."""
        self.state.unreachable(pod)

    def healthy_pods(self) -> dict[str, int]:
        """Healthy pods per role (what `/health` and the gRPC health service report)."""
        return {r: sum(i.healthy for i in self.state.members(r)) for r in ("prefill", "decode")}

    @property
    def inflight(self) -> int:
        """Requests routed and not yet finished or failed."""
        return len(self.state.records)

    def profile_changed(self, pod: str) -> None:
        """A pod's profile was (re)loaded: warn again if it is still untrusted."""
        self._untrusted_logged.discard(pod)

    # ------------------------------------------------------------------ reporting
    def prefilled(self, request_id: str) -> bool:
        return self.state.prefilled(request_id)

    def progress(self, request_id: str, generated: int) -> bool:
        return self.state.progress(request_id, generated)

    def finished(
        self,
        request_id: str,
        output_tokens: int,
        ttft_s: float,
        tpot_s: float,
        predicted_ttft_s: float | None = None,
        predicted_tpot_s: float | None = None,
        *,
        met: bool | None = None,
    ) -> bool:
        """A completed request; `met` overrides judging the SLO on ttft_s/tpot_s."""
        rec = self.state.finished(request_id)
        if rec is None:
            return False
        self.metrics.inflight.set(len(self.state.records))
        if output_tokens > 0:
            self.predictor.observe(rec.slo.name, rec.prompt_tokens, output_tokens)
        self.spread.add(float(rec.prompt_tokens + output_tokens))
        self.metrics.heterogeneity.set(self.spread.cv)
        if met is None:
            met = rec.slo.met(ttft_s, tpot_s)
        self.metrics.outcome(rec.slo.name, "met" if met else "missed")
        err = self.metrics.prediction_error
        if predicted_ttft_s is not None and ttft_s > 0:
            err.labels("ttft").observe(abs(predicted_ttft_s - ttft_s) / ttft_s)
        if predicted_tpot_s is not None and tpot_s > 0 and output_tokens > 1:
            err.labels("tpot").observe(abs(predicted_tpot_s - tpot_s) / tpot_s)
        return True

    def failed(self, request_id: str, error: str = "", *, aborted: bool = False) -> bool:
        """A request that ended in an error; `aborted` (the client left) stays out of goodput."""
        rec = self.state.finished(request_id)
        if rec is None:
            return False
        self.metrics.inflight.set(len(self.state.records))
        if aborted:
            self.metrics.requests.labels(rec.slo.name, "aborted").inc()
        else:
            self.metrics.outcome(rec.slo.name, "failed")
        if error:
            log.info("request %s failed: %s", request_id, error)
        return True

    def expire(self) -> int:
        """Forget requests nobody reported on within `inflight_ttl_s` (counted as failed)."""
        gone = self.state.expired(self.clock(), self.config.inflight_ttl_s)
        for rec in gone:
            self.metrics.outcome(rec.slo.name, "failed")
            log.warning("request %s expired in flight (no report)", rec.request_id)
        if gone:
            self.metrics.inflight.set(len(self.state.records))
        return len(gone)
