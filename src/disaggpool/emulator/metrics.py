"""`/metrics` in Prometheus text format with vLLM 0.33's names, types, labels and buckets.

What a router or the Gateway API Inference Extension scrapes from a vLLM pod must read the same
from the emulator: every engine series carries ``{model_name, engine="0"}`` (`cache_config_info`
only ``engine``, `admission_rejections` only ``model_name``), counters are exposed with the
``_total`` suffix and, like a single-process vLLM server (recorded in
`tests/realvllm/fixtures`), with ``_created`` series; histogram buckets are copied from
`vllm/v1/metrics/loggers.py` and the NIXL connector's `stats.py`. The process and Python
collectors are there too; the FastAPI instrumentator's ``http_*`` series are not. Rendering goes
through prometheus_client itself, so the text format (float formatting, escaping, label order)
is the library's, as in vLLM.

State is plain Python updated by `instance`; gauges are read from a snapshot callback at scrape
time, so they are never stale. One registry per instance: two emulators can share a process.
"""

from __future__ import annotations

import bisect
import dataclasses
import time
from collections.abc import Callable, Iterator, Mapping, Sequence

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

__all__ = [
    "CONTENT_TYPE",
    "FINISH_REASONS",
    "EmulatorMetrics",
    "GaugeSnapshot",
    "Histogram",
    "build_1_2_5_buckets",
]

CONTENT_TYPE = CONTENT_TYPE_LATEST

# vllm/v1/engine/__init__.py FINISH_REASON_STRINGS: vLLM pre-creates one series per reason.
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")

TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
NIXL_TIME_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
NIXL_BYTES_BUCKETS = tuple(float(2 ** (10 + i)) for i in range(1, 25, 2))  # 2 KiB .. 8 GiB
NIXL_DESCRIPTOR_BUCKETS = (
    10, 20, 30, 50, 75, 100, 200, 400, 1000, 2000, 4000, 10000, 20000, 50000,
)  # fmt: skip


def build_1_2_5_buckets(max_value: int) -> tuple[float, ...]:
    """vLLM's 1, 2, 5, 10, 20, 50, ... buckets up to `max_value` (token-count histograms)."""
    out: list[float] = []
    exponent = 0
    while True:
        for m in (1, 2, 5):
            value = m * 10**exponent
            if value > max_value:
                return tuple(out)
            out.append(float(value))
        exponent += 1


def _go_float(value: float) -> str:
    """A bucket bound as prometheus_client writes it (``1.0``, ``+Inf``)."""
    text: str = floatToGoString(value)  # type: ignore[no-untyped-call]
    return text


class Histogram:
    """Cumulative-on-render bucket counts, a sum and a count."""

    def __init__(self, buckets: Sequence[float]) -> None:
        self.bounds = tuple(float(b) for b in buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, float]]:
        out = []
        acc = 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            acc += n
            out.append((_go_float(bound), float(acc)))
        return out


@dataclasses.dataclass(frozen=True, slots=True)
class GaugeSnapshot:
    """Scheduler state at scrape time."""

    running: int
    waiting_capacity: int  # queued for a slot or KV blocks
    waiting_deferred: int  # waiting for remote KV (vLLM's WAITING_FOR_REMOTE_KVS)
    kv_cache_usage: float  # 0..1
    # decode legs by KV fetch stage (vllm:num_requests_kv_fetch_by_stage, on KV consumers)
    fetch_waiting_to_start: int = 0
    fetch_in_progress: int = 0
    fetch_completed_waiting: int = 0


class EmulatorMetrics:
    """Every series one instance exports; `render` gives the `/metrics` body."""

    def __init__(
        self,
        *,
        model_name: str,
        max_model_len: int,
        cache_info: Mapping[str, str],
        snapshot: Callable[[], GaugeSnapshot],
    ) -> None:
        self.labels = (model_name, "0")
        self._cache_info = dict(cache_info)
        self._snapshot = snapshot
        self._created = time.time()
        self.prompt_tokens = 0
        self.prompt_tokens_by_source = dict.fromkeys(
            ("local_compute", "local_cache_hit", "external_kv_transfer"), 0
        )
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.prompt_tokens_cached_by_source = dict.fromkeys(
            ("device", "host", "disk", "p2p", "external_unspecified"), 0
        )
        self.admission_rejections = dict.fromkeys(
            ("max_num_queued_reqs", "max_num_queued_tokens"), 0
        )
        self.generation_tokens = 0
        self.preemptions = 0
        self.request_success = dict.fromkeys(FINISH_REASONS, 0)
        self.nixl_failed_transfers = 0
        self.nixl_failed_notifications = 0
        self.nixl_kv_expired_reqs = 0
        self.nixl_notifications_after_expiry = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.tpot = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(REQUEST_LATENCY_BUCKETS)
        token_buckets = build_1_2_5_buckets(max_model_len)
        self.request_prompt_tokens = Histogram(token_buckets)
        self.request_generation_tokens = Histogram(token_buckets)
        self.request_max_tokens = Histogram(token_buckets)
        self.request_max_generation_tokens = Histogram(token_buckets)
        self.request_params_n = Histogram((1, 2, 5, 10, 20))
        self.request_num_preemptions = Histogram((1, 2, 3, 4, 5, 10, 20))
        self.nixl_xfer_time = Histogram(NIXL_TIME_BUCKETS[1:])
        self.nixl_post_time = Histogram(NIXL_TIME_BUCKETS)
        self.nixl_bytes = Histogram(NIXL_BYTES_BUCKETS)
        self.nixl_descriptors = Histogram(NIXL_DESCRIPTOR_BUCKETS)
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(_Collector(self))
        # The process-wide collectors vLLM's /metrics also shows (shared, read-only).
        for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            self._registry.register(collector)

    def snapshot(self) -> GaugeSnapshot:
        return self._snapshot()

    def render(self) -> bytes:
        return generate_latest(self._registry)

    # ------------------------------------------------------------------ the series
    def families(self) -> Iterator[Metric]:
        labelnames = ["model_name", "engine"]
        lv = list(self.labels)
        snap = self._snapshot()

        created = self._created

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labelnames)
            g.add_metric(lv, value)
            return g

        def with_created(family: Metric, labelsets: list[dict[str, str]]) -> Metric:
            # prometheus_client writes these as a separate `<name>_created` gauge family.
            for labels in labelsets:
                family.samples.append(Sample(family.name + "_created", labels, created))
            return family

        std = dict(zip(labelnames, lv, strict=True))

        def counter(name: str, doc: str, value: float) -> Metric:
            c = CounterMetricFamily(name, doc, labels=labelnames)
            c.add_metric(lv, value)
            return with_created(c, [std])

        def counter_by(name: str, doc: str, label: str, values: Mapping[str, int]) -> Metric:
            c = CounterMetricFamily(name, doc, labels=[*labelnames, label])
            for key, n in values.items():
                c.add_metric([*lv, key], n)
            return with_created(c, [{**std, label: key} for key in values])

        def histogram(name: str, doc: str, h: Histogram) -> Metric:
            f = HistogramMetricFamily(name, doc, labels=labelnames)
            f.add_metric(lv, h.cumulative(), h.sum)
            return with_created(f, [std])

        yield gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            snap.running,
        )
        yield gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            snap.waiting_capacity + snap.waiting_deferred,
        )
        by_reason = GaugeMetricFamily(
            "vllm:num_requests_waiting_by_reason",
            "Number of requests waiting to be processed, by reason.",
            labels=[*labelnames, "reason"],
        )
        by_reason.add_metric([*lv, "capacity"], snap.waiting_capacity)
        by_reason.add_metric([*lv, "deferred"], snap.waiting_deferred)
        yield by_reason
        yield gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            snap.kv_cache_usage,
        )
        fetch = GaugeMetricFamily(
            "vllm:num_requests_kv_fetch_by_stage",
            "Number of requests fetching KV from a remote instance, by stage.",
            labels=[*labelnames, "stage"],
        )
        fetch.add_metric([*lv, "waiting_to_start"], snap.fetch_waiting_to_start)
        fetch.add_metric([*lv, "in_progress"], snap.fetch_in_progress)
        fetch.add_metric([*lv, "completed_waiting"], snap.fetch_completed_waiting)
        yield fetch
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=list(self._cache_info),
        )
        info.add_metric(list(self._cache_info.values()), 1.0)
        yield info
        rejections = CounterMetricFamily(
            "vllm:admission_rejections",
            "Requests rejected by the API server before reaching the engine, by reason.",
            labels=["model_name", "reason"],
        )
        for reason, n in self.admission_rejections.items():
            rejections.add_metric([lv[0], reason], n)
        yield with_created(
            rejections, [{"model_name": lv[0], "reason": r} for r in self.admission_rejections]
        )
        yield counter(
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            self.preemptions,
        )
        yield counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", self.prompt_tokens
        )
        yield counter_by(
            "vllm:prompt_tokens_by_source",
            "Number of prompt tokens by source.",
            "source",
            self.prompt_tokens_by_source,
        )
        yield counter(
            "vllm:prompt_tokens_cached",
            "Number of cached prompt tokens (local and external).",
            sum(self.prompt_tokens_cached_by_source.values()),
        )
        yield counter_by(
            "vllm:prompt_tokens_cached_by_source",
            "Number of cached prompt tokens by source.",
            "source",
            self.prompt_tokens_cached_by_source,
        )
        yield counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            self.prefix_cache_queries,
        )
        yield counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            self.prefix_cache_hits,
        )
        yield counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            self.generation_tokens,
        )
        yield counter_by(
            "vllm:request_success",
            "Count of successfully processed requests.",
            "finished_reason",
            self.request_success,
        )
        yield histogram(
            "vllm:request_prompt_tokens",
            "Number of prefill tokens processed.",
            self.request_prompt_tokens,
        )
        yield histogram(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            self.request_generation_tokens,
        )
        yield histogram(
            "vllm:request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            self.request_max_tokens,
        )
        yield histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            self.request_max_generation_tokens,
        )
        yield histogram(
            "vllm:request_params_n",
            "Histogram of the n request parameter.",
            self.request_params_n,
        )
        yield histogram(
            "vllm:request_num_preemptions",
            "Number of preemptions per request.",
            self.request_num_preemptions,
        )
        yield histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            self.ttft,
        )
        yield histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            self.itl,
        )
        yield histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            self.tpot,
        )
        yield histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            self.e2e,
        )
        yield histogram(
            "vllm:nixl_xfer_time_seconds",
            "Histogram of transfer duration for NIXL KV Cache transfers.",
            self.nixl_xfer_time,
        )
        yield histogram(
            "vllm:nixl_post_time_seconds",
            "Histogram of transfer post time for NIXL KV Cache transfers.",
            self.nixl_post_time,
        )
        yield histogram(
            "vllm:nixl_bytes_transferred",
            "Histogram of bytes transferred per NIXL KV Cache transfers.",
            self.nixl_bytes,
        )
        yield histogram(
            "vllm:nixl_num_descriptors",
            "Histogram of number of descriptors per NIXL  KV Cache transfers.",
            self.nixl_descriptors,
        )
        yield counter(
            "vllm:nixl_num_failed_transfers",
            "Number of failed NIXL KV Cache transfers.",
            self.nixl_failed_transfers,
        )
        yield counter(
            "vllm:nixl_num_failed_notifications",
            "Number of failed NIXL KV Cache notifications.",
            self.nixl_failed_notifications,
        )
        yield counter(
            "vllm:nixl_num_kv_expired_reqs",
            "Number of requests that had their KV expire. "
            "NOTE: This metric is tracked on the P instance.",
            self.nixl_kv_expired_reqs,
        )
        yield counter(
            "vllm:nixl_num_notifications_after_expiry",
            "Number of notifications received for requests whose KV had already expired.",
            self.nixl_notifications_after_expiry,
        )


class _Collector(Collector):
    def __init__(self, metrics: EmulatorMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        return self._metrics.families()
