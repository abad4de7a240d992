"""The sidecar's Prometheus metrics (served on the front door's `/metrics`).

Names follow Prometheus conventions (`disaggpool_` prefix, base units, `_total` counters):

* `disaggpool_route_decisions_total{policy,role,pod}`: every decision, once per role, so a
  dashboard shows how the work splits over pods;
* `disaggpool_route_decision_seconds`: time spent in the policy (histogram);
* `disaggpool_local_prefills_total{pod}`: requests the P/D decider sent to a decode pod to
  prefill itself (no prefill leg);
* `disaggpool_route_fallbacks_total{reason}`: decisions made without a trusted profile for
  every pod (``median-profile``: a pod scored with the median trusted profile;
  ``least-loaded``: none trusted, in-flight counts used);
* `disaggpool_requests_total{slo_class,outcome}`: finished requests, outcome ``met``,
  ``missed`` (completed outside its SLO), ``failed``, ``shed`` (a request of a sheddable class
  refused because it would miss its SLO), or ``aborted`` (the client left; not the router's
  doing, so outside goodput); goodput of a class is met / (met + missed + failed + shed);
* `disaggpool_goodput_ratio{slo_class}`: the same over the last `window` finished requests;
* `disaggpool_rejected_requests_total{reason}`: refused before routing (overload, no capacity,
  bad request) or at routing (shed);
* `disaggpool_prediction_relative_error{quantity}`: |predicted - observed| / observed for
  ``ttft`` and ``tpot`` (histogram), the calibration-drift signal;
* `disaggpool_traffic_heterogeneity`: CV of per-request token work over the window
  (`core.heterogeneity`);
* `disaggpool_demand_requests_per_second`, `disaggpool_demand_tokens_per_second` (the same
  times the mean prompt + output tokens of recent requests) and `disaggpool_demand_dispersion`
  (arrivals over the last minute, their index of dispersion over ten: `core.demand`, computed at
  scrape time), `disaggpool_demand_decode_context_tokens` and `disaggpool_demand_decode_context_cv`
  (the mean and CV of the context a decoding sequence holds, each request weighted by its output
  tokens: the spread the decode autoscaler's headroom is sized by); with `autoscaling`:
  `disaggpool_autoscaler_desired_decode_replicas` (what the decode autoscaler recommends),
  with `autoscaling.prefill` `disaggpool_autoscaler_desired_prefill_replicas` (the prefill one's);
  `disaggpool_pod_prediction_error{pod}` (the pod's drift error, `core.drift`: median relative
  error of its recent TTFT or TPOT predictions, the larger) and
  `disaggpool_pool_status_failures_total` (failed writes of `status.router` on the pool,
  `sidecar.pool_writer`);
* `disaggpool_inflight_requests`; per pod: `disaggpool_pod_healthy`,
  `disaggpool_pod_inflight_requests`, `disaggpool_profile_trusted`,
  `disaggpool_profile_age_seconds`, `disaggpool_profile_info{pod,profile,quality}` (value 1),
  `disaggpool_profile_rejected{pod}` (1 while the profile written for it is refused: it does not
  parse or is not physics) and `disaggpool_profile_distrusted{pod}` (1 while its drift error has
  exceeded `drift.max_error`), both kept by `sidecar.profile_trust`;
* with `prefix_index` on: `disaggpool_prefix_lookup_tokens_total{pod}` (prompt tokens routed
  to the prefill pod with their token ids) and `disaggpool_prefix_hit_tokens_total{pod}` (of
  those, what the router's index expected cached there; their ratio is the hit share the router
  counts on, to set beside the engine's `vllm:prefix_cache_hits`), and
  `disaggpool_prefix_index_blocks{pod}` (blocks the index holds for the pod);
* with `kv_events`: `disaggpool_prefix_index_source{pod,source}` (1 for the index read for the
  pod: ``events`` or ``routed``, the approximate one),
  `disaggpool_kv_events_batches_total{pod}`, `disaggpool_kv_events_malformed_total{pod}`
  (dropped) and `disaggpool_kv_events_gaps_total{pod}` (lost batches: its index started over);
* `disaggpool_frontdoor_requests_total{endpoint,code}`,
  `disaggpool_upstream_failures_total{stage}`, `disaggpool_prefill_retries_total`,
  `disaggpool_decode_retries_total{path}` (``kv``: the same KV on another decode pod, its first
  one never got the request; ``local``: another decode pod prefilling the prompt itself);
* with `listen.ext_proc` (the endpoint picker behind Envoy, `sidecar.epp`):
  `disaggpool_epp_decisions_total{endpoint,code}` (each request the picker answered: ``routed``,
  or the HTTP status of its refusal; endpoint ``completions``, ``chat``, ``models`` or
  ``other``) and `disaggpool_epp_responses_total{code}` (the statuses of the answers that went
  back through it, what Envoy served);
* the process: `disaggpool_loop_errors_total{loop}` and `disaggpool_loop_restarts_total{loop}`
  (`sidecar.supervise`), `disaggpool_scrape_failures_total{pod,reason}` (``refused``,
  ``timeout``, ``http``, ``malformed``), `disaggpool_auth_failures_total{port}` (``http``,
  ``grpc``, ``ext_proc``: Envoy's token on the picker's port, ``gateway``: a client's API key
  behind Envoy);
* with `shared_books` (registered by `sidecar.book_bus`, absent otherwise):
  `disaggpool_shared_books_connected`, `disaggpool_shared_books_events_total{outcome}`
  (``published``, ``applied``, ``ignored``, ``rejected``, ``dropped``) and
  `disaggpool_shared_books_malformed_messages_total`;
* with `leader_election` (registered by `sidecar.leader`): `disaggpool_leader` (1 while this
  replica holds the Lease) and `disaggpool_leader_election_errors_total`.

Per-pod gauges are read from the live `PoolState` at scrape time by a collector, so pods that
leave the pool leave the page too. One registry per sidecar (tests run several in a process).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from disaggpool.core.demand import Demand
from disaggpool.sidecar.state import PoolState

__all__ = ["SidecarMetrics"]

_DECISION_BUCKETS = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1,
)  # fmt: skip
_ERROR_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0)


class _PodCollector(Collector):
    def __init__(
        self, state: PoolState, now: Callable[[], float], stale_after_s: float | None
    ) -> None:
        self.state = state
        self.now = now
        self.stale_after_s = stale_after_s  # None: no KV events

    def collect(self) -> Iterator[Metric]:
        now = self.now()
        healthy = GaugeMetricFamily(
            "disaggpool_pod_healthy", "1 when the pod's last scrape or request succeeded",
            labels=["pod", "role"],
        )  # fmt: skip
        inflight = GaugeMetricFamily(
            "disaggpool_pod_inflight_requests", "requests routed to the pod and not finished",
            labels=["pod", "role"],
        )  # fmt: skip
        trusted = GaugeMetricFamily(
            "disaggpool_profile_trusted", "1 when the pod has a good or fair calibration profile",
            labels=["pod"],
        )  # fmt: skip
        age = GaugeMetricFamily(
            "disaggpool_profile_age_seconds", "seconds since the pod's profile was loaded",
            labels=["pod"],
        )  # fmt: skip
        info = GaugeMetricFamily(
            "disaggpool_profile_info", "the pod's calibration profile (value 1)",
            labels=["pod", "profile", "quality"],
        )  # fmt: skip
        blocks = GaugeMetricFamily(
            "disaggpool_prefix_index_blocks", "prompt blocks the router's prefix index holds",
            labels=["pod"],
        )  # fmt: skip
        source = GaugeMetricFamily(
            "disaggpool_prefix_index_source", "1 for the prefix index read for the pod",
            labels=["pod", "source"],
        )  # fmt: skip
        index = self.state.prefix
        accounts = self.state.ledger.accounts
        for inst in self.state.instances.values():
            if inst.removed:
                continue
            healthy.add_metric([inst.name, inst.role], 1.0 if inst.healthy else 0.0)
            acc = accounts.get(inst.name)
            inflight.add_metric([inst.name, inst.role], float(acc.inflight if acc else 0))
            p = inst.profile
            trusted.add_metric([inst.name], 1.0 if p is not None and p.trusted else 0.0)
            if p is not None:
                age.add_metric([inst.name], max(0.0, now - inst.profile_loaded_at))
                info.add_metric([inst.name, p.name, p.quality], 1.0)
            if index is not None and inst.role == "prefill":
                events = (
                    self.state.cached_index(inst.name, now, self.stale_after_s)
                    if self.stale_after_s is not None and inst.member.kv_events
                    else None
                )
                held = events.size() if events is not None else index.size(inst.name)
                blocks.add_metric([inst.name], float(held))
                if self.stale_after_s is not None and inst.member.kv_events:
                    live = events is not None
                    source.add_metric([inst.name, "events"], 1.0 if live else 0.0)
                    source.add_metric([inst.name, "routed"], 0.0 if live else 1.0)
        yield from (healthy, inflight, trusted, age, info)
        if index is not None:
            yield blocks
        if self.stale_after_s is not None:
            yield source


class _DemandCollector(Collector):
    """The demand window, read at scrape time (what the decode autoscaler reads)."""

    def __init__(self, demand: Callable[[], Demand]) -> None:
        self.demand = demand

    def collect(self) -> Iterator[Metric]:
        d = self.demand()
        tokens = d.arrival_rps * (d.mean_prompt + d.mean_output)
        for name, text, value in (
            ("requests_per_second", "arrivals per second over the last minute", d.arrival_rps),
            ("tokens_per_second", "arrivals x mean prompt + output tokens", tokens),
            ("dispersion", "index of dispersion of arrivals (1 = Poisson)", d.dispersion),
            ("decode_context_tokens", "mean context a decoding sequence holds", d.slot_context),
            ("decode_context_cv", "its CV, what the decode headroom is sized by", d.slot_cv),
        ):
            yield GaugeMetricFamily(f"disaggpool_demand_{name}", text, value=value)


class SidecarMetrics:
    """All series of one sidecar (see the module docstring)."""

    def __init__(
        self,
        state: PoolState,
        now: Callable[[], float],
        window: int = 512,
        kv_events_stale_s: float | None = None,
        demand: Callable[[], Demand] | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.decisions = Counter(
            "disaggpool_route_decisions", "routing decisions, by policy, role and chosen pod",
            ["policy", "role", "pod"], registry=r,
        )  # fmt: skip
        self.decision_seconds = Histogram(
            "disaggpool_route_decision_seconds", "time spent in the routing policy",
            buckets=_DECISION_BUCKETS, registry=r,
        )  # fmt: skip
        self.local_prefills = Counter(
            "disaggpool_local_prefills", "requests a decode pod prefilled itself (no prefill leg)",
            ["pod"], registry=r,
        )  # fmt: skip
        self.prefix_lookups = Counter(
            "disaggpool_prefix_lookup_tokens", "prompt tokens looked up in the prefix index",
            ["pod"], registry=r,
        )  # fmt: skip
        self.prefix_hits = Counter(
            "disaggpool_prefix_hit_tokens", "prompt tokens the prefix index expected cached",
            ["pod"], registry=r,
        )  # fmt: skip
        self.kv_events_batches = Counter(
            "disaggpool_kv_events_batches", "KV event batches applied to a pod's index",
            ["pod"], registry=r,
        )  # fmt: skip
        self.kv_events_malformed = Counter(
            "disaggpool_kv_events_malformed", "KV event messages dropped as malformed",
            ["pod"], registry=r,
        )  # fmt: skip
        self.kv_events_gaps = Counter(
            "disaggpool_kv_events_gaps", "gaps in a pod's KV event sequence (index restarted)",
            ["pod"], registry=r,
        )  # fmt: skip
        self.fallbacks = Counter(
            "disaggpool_route_fallbacks", "decisions made without a trusted profile for every pod",
            ["reason"], registry=r,
        )  # fmt: skip
        self.requests = Counter(
            "disaggpool_requests", "finished requests by SLO class and outcome",
            ["slo_class", "outcome"], registry=r,
        )  # fmt: skip
        self.goodput = Gauge(
            "disaggpool_goodput_ratio", "fraction of the window's finished requests meeting SLO",
            ["slo_class"], registry=r,
        )  # fmt: skip
        self.rejected = Counter(
            "disaggpool_rejected_requests", "requests refused before routing, by reason",
            ["reason"], registry=r,
        )  # fmt: skip
        self.prediction_error = Histogram(
            "disaggpool_prediction_relative_error", "|predicted - observed| / observed",
            ["quantity"], buckets=_ERROR_BUCKETS, registry=r,
        )  # fmt: skip
        self.heterogeneity = Gauge(
            "disaggpool_traffic_heterogeneity",
            "coefficient of variation of per-request token work over the window", registry=r,
        )  # fmt: skip
        self.inflight = Gauge(
            "disaggpool_inflight_requests", "requests routed and not finished", registry=r
        )
        self.desired_decode = Gauge(
            "disaggpool_autoscaler_desired_decode_replicas",
            "decode replicas the router's autoscaler recommends", registry=r,
        )  # fmt: skip
        self.desired_prefill = Gauge(
            "disaggpool_autoscaler_desired_prefill_replicas",
            "prefill replicas the router's autoscaler recommends", registry=r,
        )  # fmt: skip
        self.pod_prediction_error = Gauge(
            "disaggpool_pod_prediction_error",
            "median relative error of the pod's recent predictions (TTFT or TPOT, the larger)",
            ["pod"], registry=r,
        )  # fmt: skip
        self.profile_rejected = Gauge(
            "disaggpool_profile_rejected",
            "1 while the pod's profile is refused (it does not parse or is not physics)",
            ["pod"], registry=r,
        )  # fmt: skip
        self.profile_distrusted = Gauge(
            "disaggpool_profile_distrusted",
            "1 while the pod's profile is distrusted (its drift error exceeded drift.max_error)",
            ["pod"], registry=r,
        )  # fmt: skip
        self.pool_status_failures = Counter(
            "disaggpool_pool_status_failures",
            "writes of the router's status of its pool that failed", registry=r,
        )  # fmt: skip
        self.frontdoor = Counter(
            "disaggpool_frontdoor_requests", "front-door HTTP requests by endpoint and status",
            ["endpoint", "code"], registry=r,
        )  # fmt: skip
        self.upstream_failures = Counter(
            "disaggpool_upstream_failures", "failed upstream legs, by stage (prefill/decode)",
            ["stage"], registry=r,
        )  # fmt: skip
        self.prefill_retries = Counter(
            "disaggpool_prefill_retries", "prefill legs retried on another pod", registry=r
        )
        self.decode_retries = Counter(
            "disaggpool_decode_retries", "decode legs retried on another pod, by how",
            ["path"], registry=r,
        )  # fmt: skip
        self.epp_decisions = Counter(
            "disaggpool_epp_decisions", "endpoint-picker answers: routed, or the refusal's status",
            ["endpoint", "code"], registry=r,
        )  # fmt: skip
        self.epp_responses = Counter(
            "disaggpool_epp_responses", "statuses of the answers that passed the endpoint picker",
            ["code"], registry=r,
        )  # fmt: skip
        self.loop_errors = Counter(
            "disaggpool_loop_errors", "failed iterations of a background loop, by loop",
            ["loop"], registry=r,
        )  # fmt: skip
        self.loop_restarts = Counter(
            "disaggpool_loop_restarts", "long-running background tasks started again, by loop",
            ["loop"], registry=r,
        )  # fmt: skip
        self.scrape_failures = Counter(
            "disaggpool_scrape_failures", "failed scrapes of a pod's /metrics, by reason",
            ["pod", "reason"], registry=r,
        )  # fmt: skip
        self.auth_failures = Counter(
            "disaggpool_auth_failures", "calls refused for missing or wrong credentials, by port",
            ["port"], registry=r,
        )  # fmt: skip
        r.register(_PodCollector(state, now, kv_events_stale_s))
        if demand is not None:
            r.register(_DemandCollector(demand))
        self._window = window
        self._outcomes: dict[str, collections.deque[bool]] = {}
        self._met: dict[str, int] = {}

    def outcome(self, slo_class: str, outcome: str) -> None:
        """Count a finished request: outcome is met, missed, failed or shed (a sheddable request
        refused because it would miss its SLO; it counts against goodput like a miss)."""
        self.requests.labels(slo_class, outcome).inc()
        window = self._outcomes.setdefault(slo_class, collections.deque())
        met = self._met.get(slo_class, 0) + (outcome == "met")
        window.append(outcome == "met")
        if len(window) > self._window:
            met -= window.popleft()
        self._met[slo_class] = met
        self.goodput.labels(slo_class).set(met / len(window))

    def render(self) -> bytes:
        return generate_latest(self.registry)
