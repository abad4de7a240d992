"""The routing service: one object that both adapters (gRPC servicer, HTTP front door) call.

The decisions and the books are the router's (`core.router.Router`, the very code the simulator
runs): `route` predicts the output length, looks the prompt up in the prefix index, asks the
configured policy for a (prefill, decode) pair and books the request in flight; the pair may lack
its prefill pod (the P/D decider's local path: the decode pod prefills) or, when the caller can
take a late answer (`bind_late`: the front door always, a gRPC client that says so) and
`decode_binding` is `late` (the default), its decode pod until the prefill leg returns
(`bind_decode`); `retry_decode` books another decode pod for a leg that failed before its first
token. `prefilled` / `progress` / `finished` / `failed` move it through its life and teach the
output-length predictor.

Around the router, this service keeps what only production needs: admission (below), the request
ids and endpoints the adapters answer with (`Routed`), metrics and logs, which profile each pod
is scored with (`sidecar.profile_trust`: a re-probe's profile that is not trusted does not
replace a trusted one) and what each end teaches the goodput, heterogeneity, demand and drift
signals (`sidecar.outcomes`). Synchronous and loop-confined: no awaits, so a decision is atomic.

With `prefix_index` on, a request that comes with its token ids (the front door and gRPC
`prompt_text` measure them) is looked up in the router's prefix index, extended with the pods'
KV events (`sidecar.prefix`).

Who booked a request matters for admission. The front door's requests count against
`max_inflight` and live until the front door reports them (at worst `inflight_ttl_s`). A gRPC
client's `Route` (`client` = its peer) counts against `grpc.max_inflight` and
`grpc.max_inflight_per_client` instead, and holds a lease of `grpc.lease_s` that each report
renews: bookings nobody reports on cannot fill the pool for the front door, nor for long.

Errors are typed so each adapter maps them to its protocol: `BadRequest` (INVALID_ARGUMENT /
400), `Overloaded` and its `Shed` (RESOURCE_EXHAUSTED / 429), `NoCapacity` (UNAVAILABLE / 503),
`Duplicate` (ALREADY_EXISTS / 409).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import random
import time
from collections.abc import Callable, Collection, Sequence

from disaggpool.core.contracts import PoolSnapshot, RequestFeatures, RouteDecision, SLOClass
from disaggpool.core.demand import BURST_WINDOW_DEFAULT_S, DemandWindow
from disaggpool.core.drift import DriftTracker
from disaggpool.core.heterogeneity import SlidingSpread
from disaggpool.core.ledger import Entry
from disaggpool.core.policies.base import DecodeChoice, NoCapacityError, Policy
from disaggpool.core.policies.registry import make_policy
from disaggpool.core.predictor import OutputPredictor, make_predictor
from disaggpool.core.profile import CalibrationProfile
from disaggpool.core.router import Request, Router
from disaggpool.sidecar.auth import KeyFile
from disaggpool.sidecar.config import Member, SidecarConfig
from disaggpool.sidecar.metrics import SidecarMetrics
from disaggpool.sidecar.outcomes import Outcomes
from disaggpool.sidecar.prefix import PrefixLookup
from disaggpool.sidecar.profile_trust import ProfileTrust
from disaggpool.sidecar.state import PoolState

__all__ = [
    "BadRequest",
    "Duplicate",
    "NoCapacity",
    "Overloaded",
    "Routed",
    "RoutingService",
    "ServiceError",
    "Shed",
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


class Shed(Overloaded):
    """The request's class is sheddable and it would miss its SLO: refused rather than late."""


class Duplicate(ServiceError):
    pass


@dataclasses.dataclass(frozen=True, slots=True)
class Routed:
    """A decision with the endpoints to call and what it was based on.

    `prefill` is None when the decode pod prefills the prompt itself (no prefill leg); `decode`
    is None until `bind_decode` when the decode pod is bound late.
    """

    request_id: str
    prefill: Member | None
    decode: Member | None
    decision: RouteDecision
    slo: SLOClass
    predicted_output_tokens: float
    prompt_tokens: int
    max_tokens: int | None = None
    features: RequestFeatures | None = None
    token_ids: Sequence[int] | None = None  # kept for a reroute, which looks the prefix up again


class RoutingService:
    """The router with admission, metrics and logs around it (see the module docstring)."""

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
        self.draining = False  # SIGTERM received: health says so, answers close (sidecar.app)
        # Why this replica stands by ("" while it routes): with `leader_election`, another
        # holds the Lease (sidecar.leader); readiness fails, as while draining.
        self.standby = ""
        self.state = state or PoolState(prefix_index=config.prefix_index)
        self.policy = policy or make_policy(config.policy, options=config.options)
        self.predictor = predictor or make_predictor(config.predictor)
        self.rng = random.Random(seed)
        self.clock = clock
        events = config.kv_events
        # What the autoscalers read (sidecar.autoscale).
        scaling = config.autoscaling
        self.demand = DemandWindow(
            burst_window_s=scaling.burst_window_s if scaling else BURST_WINDOW_DEFAULT_S
        )
        self.metrics = SidecarMetrics(
            self.state,
            clock,
            config.heterogeneity_window,
            events.stale_after_s if events is not None else None,
            demand=lambda: self.demand.demand(self.clock()),
        )
        self.spread = SlidingSpread(config.heterogeneity_window)
        drift = config.drift
        self.drift = DriftTracker(drift.window, drift.min_samples) if drift else DriftTracker()
        self.outcomes = Outcomes(self.metrics, self.demand, self.spread, self.drift)
        # Which profile each pod is scored with, refused and distrusted ones, and the log lines.
        max_error = drift.max_error if drift else 0.0
        self.trust = ProfileTrust(self.state, self.drift, self.metrics, clock, max_error=max_error)
        index = self.state.prefix
        self.prefix = (
            PrefixLookup(self.state, index, events, self.metrics) if index is not None else None
        )
        self.router = Router(
            _Timed(self.policy, self.metrics),
            self.predictor,
            self.rng,
            self.state,
            prefix=self.prefix,
            late_binding=config.decode_binding == "late",
        )
        self._unbound: dict[str, Routed] = {}  # late binding: routed, decode pod not chosen yet
        self._leases: dict[str, _Lease] = {}  # gRPC bookings: request id -> client, expiry
        self._per_client: collections.Counter[str] = collections.Counter()
        self._upstream_key = KeyFile(config.auth.upstream_api_key_file)

    # ------------------------------------------------------------------ deciding
    def route(
        self,
        request_id: str,
        prompt_tokens: int,
        slo_class: str = "",
        *,
        max_tokens: int | None = None,
        exclude_prefill: Collection[str] = (),
        exclude_decode: Collection[str] = (),
        token_ids: Sequence[int] | None = None,
        bind_late: bool = False,
        client: str | None = None,
    ) -> Routed:
        """Route one request. `bind_late`: the caller will call `bind_decode` when the prefill
        leg answers, so the decode pod may be chosen then (when `decode_binding` is `late`).
        `exclude_decode`: decode pods it may not go to (the endpoint picker's subset hint).
        `client`: the gRPC peer that books it (None: the front door and the endpoint picker,
        whose bookings count against `max_inflight`; module docstring)."""
        if not request_id or len(request_id) > MAX_REQUEST_ID or not request_id.isprintable():
            raise BadRequest("must be 1-128 printable characters", "request_id")
        if prompt_tokens < 1:
            raise BadRequest(f"must be at least 1, got {prompt_tokens}", "prompt_tokens")
        slo = self.config.slo(slo_class)
        if slo is None:
            names = ", ".join(c.name for c in self.config.slo_classes)
            raise BadRequest(f"unknown SLO class {slo_class!r}; valid: {names}", "slo_class")
        if self.state.is_inflight(request_id):
            raise Duplicate(f"request id {request_id!r} is already in flight", "request_id")
        self._admit(client)
        now = self.clock()
        self.outcomes.arrived(now)
        blocks, block_tokens = self.prefix.blocks(token_ids) if self.prefix else ((), 0)
        request = Request(
            request_id,
            prompt_tokens,
            slo,
            max_tokens=max_tokens,
            blocks=blocks,
            block_tokens=block_tokens,
            token_ids=token_ids,
        )
        try:
            placed = self.router.route(
                request,
                now,
                bind_late=bind_late,
                exclude_prefill=exclude_prefill,
                exclude_decode=exclude_decode,
            )
        except NoCapacityError as exc:
            self.metrics.rejected.labels("no_capacity").inc()
            raise NoCapacity(str(exc)) from None
        decision = placed.decision
        if decision.shed:
            self.outcomes.shed(slo.name)
            raise Shed(
                f"class {slo.name!r} is sheddable and no pod can serve this request within its "
                f"SLO now (predicted TTFT {decision.predicted_ttft_s or 0.0:.3f} s)"
            )
        # What the autoscalers size the pools by: the prompt (prefill work), the predicted
        # output (decode work), and whether the decode pod prefills it itself.
        self.outcomes.admitted(
            now,
            prompt_tokens,
            placed.features.predicted_output_tokens,
            local=decision.prefill is None,
        )
        self._account(decision, bound=not placed.late)
        instances = self.state.instances
        p = instances[decision.prefill] if decision.prefill is not None else None
        d = None if placed.late else instances[decision.decode]
        self.metrics.inflight.set(self.state.inflight)
        routed = Routed(
            request_id,
            p.member if p else None,
            d.member if d else None,
            decision,
            slo,
            placed.features.predicted_output_tokens,
            prompt_tokens,
            max_tokens,
            placed.features,
            token_ids,
        )
        if placed.late:
            self._unbound[request_id] = routed
        if client is not None:
            self._leases[request_id] = _Lease(client, now + self.config.grpc.lease_s)
            self._per_client[client] += 1
        return routed

    def _admit(self, client: str | None) -> None:
        """Overloaded when the caller's share of the pool is full (module docstring)."""
        if client is None:
            ours = self.state.inflight - len(self._leases)
            if ours >= self.config.max_inflight:
                self.metrics.rejected.labels("overload").inc()
                raise Overloaded(f"{ours} requests in flight (max_inflight)")
            return
        g = self.config.grpc
        if len(self._leases) >= g.max_inflight:
            self.metrics.rejected.labels("overload").inc()
            raise Overloaded(f"{len(self._leases)} gRPC bookings in flight (grpc.max_inflight)")
        if self._per_client[client] >= g.max_inflight_per_client:
            self.metrics.rejected.labels("overload").inc()
            raise Overloaded(
                f"{self._per_client[client]} bookings of this client in flight "
                "(grpc.max_inflight_per_client)"
            )

    def _renew(self, request_id: str) -> None:
        lease = self._leases.get(request_id)
        if lease is not None:
            lease.until = self.clock() + self.config.grpc.lease_s

    def max_model_len(self) -> int:
        """The longest prompt + output a request may ask for: the config's `max_model_len`, else
        the smallest any pod of the pool reported (0: not known yet, no check)."""
        if self.config.max_model_len:
            return self.config.max_model_len
        known = [
            i.max_model_len
            for i in self.state.instances.values()
            if i.max_model_len and not i.removed
        ]
        return min(known, default=0)

    @property
    def expiry_period_s(self) -> float:
        """How often `expire` should run: often enough to honour the shortest lifetime."""
        return max(0.5, min(30.0, self.config.inflight_ttl_s / 4, self.config.grpc.lease_s / 4))

    def upstream_headers(self) -> dict[str, str]:
        """What every request to a pod carries: vLLM's API key when one is configured."""
        key = self._upstream_key.keys()
        return {"Authorization": f"Bearer {key[0]}"} if key else {}

    def bind_decode(self, request_id: str) -> Routed:
        """Late binding: the prefill leg of `request_id` answered; choose its decode pod now."""
        routed = self._unbound.pop(request_id, None)
        if routed is None:
            raise BadRequest("is not a routed request awaiting its decode pod", "request_id")
        self._renew(request_id)
        try:
            decision = self.router.bind_decode(request_id, self.clock())
        except NoCapacityError as exc:
            self.metrics.rejected.labels("no_capacity").inc()
            raise NoCapacity(str(exc)) from None
        if decision is None:
            raise BadRequest("is not a routed request awaiting its decode pod", "request_id")
        self.metrics.decisions.labels(decision.policy, "decode", decision.decode).inc()
        return self._rebound(routed, decision, local=False)

    def retry_decode(self, routed: Routed, failed: str, *, local: bool) -> Routed:
        """The decode leg of `routed` failed on `failed` before its first token: book it on
        another decode pod. `local` (or a request on the local path already): that pod prefills
        the prompt itself, chosen as the policy routes a new request; else it pulls the same KV
        (the failed pod never asked for it), chosen as late binding chooses
        (`Router.retry_decode`)."""
        self._release(routed.request_id)
        try:
            decision = self.router.retry_decode(
                routed.request_id, failed, self.clock(), local=local
            )
        except NoCapacityError as exc:
            self.metrics.rejected.labels("no_capacity").inc()
            raise NoCapacity(str(exc)) from None
        if decision is None:
            raise BadRequest("is not a routed request with a decode leg", "request_id")
        self.metrics.decisions.labels(decision.policy, "decode", decision.decode).inc()
        return self._rebound(routed, decision, local=local or routed.prefill is None)

    def _rebound(self, routed: Routed, decision: RouteDecision, *, local: bool) -> Routed:
        """`routed` with the decode pod of `decision` (and, `local`, no prefill leg)."""
        merged = dataclasses.replace(
            routed.decision,
            prefill=None if local else routed.decision.prefill,
            decode=decision.decode,
            predicted_ttft_s=decision.predicted_ttft_s,
            predicted_tpot_s=decision.predicted_tpot_s,
            slo_feasible=decision.slo_feasible,
        )
        d = self.state.instances[decision.decode]
        prefill = None if local else routed.prefill
        return dataclasses.replace(routed, prefill=prefill, decode=d.member, decision=merged)

    def reroute(self, routed: Routed, exclude_prefill: Collection[str]) -> Routed:
        """Route a request again (its prefill leg failed), avoiding the pods that failed it."""
        self._forget(routed.request_id)
        return self.route(
            routed.request_id,
            routed.prompt_tokens,
            routed.slo.name,
            max_tokens=routed.max_tokens,
            exclude_prefill=exclude_prefill,
            token_ids=routed.token_ids,
            bind_late=routed.decode is None,
        )

    def _account(self, decision: RouteDecision, *, bound: bool = True) -> None:
        m = self.metrics
        if decision.prefill is None:
            m.local_prefills.labels(decision.decode).inc()
        else:
            m.decisions.labels(decision.policy, "prefill", decision.prefill).inc()
        if bound:
            m.decisions.labels(decision.policy, "decode", decision.decode).inc()
        if decision.fallback is None:
            return
        m.fallbacks.labels(decision.fallback).inc()
        for name in (decision.prefill, decision.decode):
            if name is not None:  # says once per pod and profile why it has no trusted one
                self.trust.fallback_used(name, decision.fallback)

    def _release(self, request_id: str) -> None:
        """Drop what the service holds of a request: its late binding, its gRPC lease."""
        self._unbound.pop(request_id, None)
        lease = self._leases.pop(request_id, None)
        if lease is not None:
            self._per_client[lease.client] -= 1
            if not self._per_client[lease.client]:
                del self._per_client[lease.client]

    def _forget(self, request_id: str) -> Entry | None:
        self._release(request_id)
        return self.router.forget(request_id)

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
        return self.state.inflight

    def install_profile(self, pod: str, profile: CalibrationProfile | None, now: float) -> bool:
        """Give `pod` its (re)loaded `profile` (None clears it); False when refused: a profile
        that is not trusted (a re-probe that came out poor) never replaces a trusted one, and a
        distrusted profile delivered again stays distrusted (`sidecar.profile_trust`)."""
        return self.trust.install(pod, profile, now)

    def profile_changed(self, pod: str) -> None:
        """A pod's profile was (re)loaded: warn again if it is still untrusted, say again what
        prices the KV transfer of decode pods that did not measure theirs, and start its drift
        window over (its errors were about the old profile)."""
        self.trust.profile_changed(pod)

    def note_transfer_stand_ins(self) -> None:
        """Log what prices the KV transfer of decode pods that did not measure theirs; call it
        when profiles or membership change (`ProfileTrust.note_transfer_stand_ins`)."""
        self.trust.note_transfer_stand_ins()

    # ------------------------------------------------------------------ reporting
    def prefilled(self, request_id: str) -> bool:
        self._renew(request_id)
        return self.router.prefilled(request_id)

    def progress(
        self, request_id: str, generated: int, first_token_at: float | None = None
    ) -> bool:
        """`generated` output tokens so far; `first_token_at` (default: now) is when the first
        was seen, for a reporter that knows it better than the report's arrival."""
        self._renew(request_id)
        return self.router.progress(request_id, generated, self.clock(), first_token_at)

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
        self._release(request_id)
        rec = self.router.finished(request_id, output_tokens)
        if rec is None:
            return False
        self.metrics.inflight.set(self.state.inflight)
        self.outcomes.finished(
            rec,
            output_tokens,
            ttft_s,
            tpot_s,
            self.clock(),
            predicted_ttft_s=predicted_ttft_s,
            predicted_tpot_s=predicted_tpot_s,
            met=met,
        )
        return True

    def failed(self, request_id: str, error: str = "", *, aborted: bool = False) -> bool:
        """A request that ended in an error; `aborted` (the client left) stays out of goodput."""
        rec = self._forget(request_id)
        if rec is None:
            return False
        self.metrics.inflight.set(self.state.inflight)
        self.outcomes.failed(rec, aborted=aborted)
        if error:
            log.info("request %s failed: %s", request_id, error)
        return True

    def expire(self) -> int:
        """Forget requests nobody reported on within their lifetime, counted as failed: a gRPC
        booking's lease, or `inflight_ttl_s` (a safety net under the front door's own bookings,
        which it always reports)."""
        now = self.clock()
        lapsed = [rid for rid, lease in self._leases.items() if lease.until < now]
        gone = [rec for rid in lapsed if (rec := self._forget(rid)) is not None]
        for rec in self.router.expired(now, self.config.inflight_ttl_s):
            self._release(rec.request_id)
            gone.append(rec)
        for rec in gone:
            self.outcomes.failed(rec)
            log.warning("request %s expired in flight (no report)", rec.request_id)
        if gone:
            self.metrics.inflight.set(self.state.inflight)
        return len(gone)


class _Timed:
    """The policy, with the time each decision takes in `disaggpool_route_decision_seconds`
    (the router is pure and reads no clock; the sidecar may)."""

    def __init__(self, policy: Policy, metrics: SidecarMetrics) -> None:
        self.policy = policy
        self.name = policy.name
        self._seconds = metrics.decision_seconds

    def route(self, req: RequestFeatures, pool: PoolSnapshot, rng: random.Random) -> RouteDecision:
        started = time.perf_counter()
        decision = self.policy.route(req, pool, rng)
        self._seconds.observe(time.perf_counter() - started)
        return decision

    def route_decode(self, choice: DecodeChoice, rng: random.Random) -> RouteDecision:
        started = time.perf_counter()
        decision = self.policy.route_decode(choice, rng)
        self._seconds.observe(time.perf_counter() - started)
        return decision


@dataclasses.dataclass(slots=True)
class _Lease:
    client: str
    until: float
