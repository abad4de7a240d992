"""The P/D proxy's own Prometheus metrics, on its `/metrics` (one registry per proxy).

* `disaggpool_pd_proxy_requests_total{endpoint,prefill,code}`: generation requests answered;
  ``prefill`` says where the prompt was prefilled: ``remote`` (a prefill pod, its KV pulled),
  ``local`` (no prefill pod named), ``fallback`` (every named prefill pod failed, or the KV could
  not be loaded: the local vLLM prefilled) or ``none`` (answered before any decode leg: a bad
  request, or a prefill pod's 4xx passed on);
* `disaggpool_pd_proxy_prefill_legs_total{outcome}`: ``ok``, ``client_error`` (a 4xx, passed
  to the client), ``connection``, ``timeout``, ``server_error`` (any other status),
  ``bad_answer`` (200 without `kv_transfer_params`);
* `disaggpool_pd_proxy_prefill_fallbacks_total{reason,to}`: a failed prefill leg (``reason`` as
  above, or ``kv_load``: the local vLLM answered 500 to the decode leg carrying the prefill pod's
  KV) and what came next: ``next_host`` (the next entry of the header) or ``local``;
* `disaggpool_pd_proxy_decode_legs_total{kv,outcome}`: decode legs to the local vLLM, ``kv``
  ``remote`` or ``local``; ``outcome`` ``ok``, ``http_error`` (vLLM's error passed on),
  ``failed`` (before the client saw anything: 502/504) or ``stream_failed`` (an error event);
* `disaggpool_pd_proxy_prefill_leg_seconds` (histogram, successful prefill legs);
* `disaggpool_pd_proxy_rejected_total{reason}` (``bad_request``, ``too_large``,
  ``bad_header``) and `disaggpool_pd_proxy_auth_failures_total`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

__all__ = ["ProxyMetrics"]


class ProxyMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        p = "disaggpool_pd_proxy_"
        self.requests = Counter(
            f"{p}requests", "Generation requests answered, by where they were prefilled.",
            ["endpoint", "prefill", "code"], registry=r,
        )  # fmt: skip
        self.prefill_legs = Counter(
            f"{p}prefill_legs", "Prefill legs, by outcome.", ["outcome"], registry=r
        )
        self.fallbacks = Counter(
            f"{p}prefill_fallbacks", "Failed prefill legs and what came next.",
            ["reason", "to"], registry=r,
        )  # fmt: skip
        self.decode_legs = Counter(
            f"{p}decode_legs", "Decode legs to the local vLLM, by outcome.",
            ["kv", "outcome"], registry=r,
        )  # fmt: skip
        self.prefill_seconds = Histogram(
            f"{p}prefill_leg_seconds", "Duration of successful prefill legs.", registry=r,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )  # fmt: skip
        self.rejected = Counter(
            f"{p}rejected", "Requests refused before any leg.", ["reason"], registry=r
        )
        self.auth_failures = Counter(
            f"{p}auth_failures", "Requests without a valid API key.", registry=r
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
