"""Reading a vLLM pod's `/metrics`: the few gauges the router needs, every scrape interval.

The collectors call `parse_gauges` on each pod's page. Parsing is `promtext`'s (only the lines
of the series below are parsed, which keeps a scrape cheap); this module knows what they mean.
Values are summed over the `engine` label (data-parallel pods expose one series per engine).
Names are vLLM's V1 names (`docs/vllm-protocol.md` §3):
`vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` (a 0-1
fraction despite the name), `vllm:cache_config_info` (labels `num_gpu_blocks`, `block_size`),
`vllm:num_preemptions_total`, and, where the engine has it, the part of the waiting that waits
for remote KV (`vllm:num_requests_waiting_by_reason{reason="deferred"}`).
"""

from __future__ import annotations

import math

from disaggpool import promtext
from disaggpool.sidecar.state import Gauges

__all__ = ["MetricsFormatError", "parse_gauges"]

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
PREEMPTIONS = "vllm:num_preemptions_total"
CACHE_CONFIG = "vllm:cache_config_info"
WAITING_BY_REASON = "vllm:num_requests_waiting_by_reason"
_NAMES = (RUNNING, WAITING, KV_USAGE, PREEMPTIONS, CACHE_CONFIG, WAITING_BY_REASON)
MAX_COUNT = 2.0**31  # more requests, or preemptions, than any engine has seen


class MetricsFormatError(ValueError):
    """The text is not a vLLM metrics page (a required series is missing or malformed, or a
    value is NaN, infinite or negative)."""


def parse_gauges(text: str) -> Gauges:
    """The router's gauges from one vLLM `/metrics` page; `MetricsFormatError` if it is not one."""
    try:
        samples = promtext.parse(text, _NAMES)
    except promtext.PromTextError as exc:
        raise MetricsFormatError(str(exc)) from None
    missing = sorted({RUNNING, WAITING} - {s.name for s in samples})
    if missing:
        raise MetricsFormatError(f"no {', '.join(missing)} series: not a vLLM pod?")
    capacity = 0
    for s in samples:
        if s.name == CACHE_CONFIG:
            try:
                blocks, size = int(s.labels["num_gpu_blocks"]), int(s.labels["block_size"])
                if blocks < 0 or size < 0:
                    raise ValueError("negative")
                capacity += blocks * size
            except (KeyError, ValueError):
                raise MetricsFormatError(
                    f"{CACHE_CONFIG} lacks integer num_gpu_blocks/block_size labels"
                ) from None
    for s in samples:
        # NaN, infinities, negative or absurd counts are legal exposition but no state of a pod:
        # one such value makes the whole page unusable (it would poison every sum the router
        # makes, and a count of 1e300 overflows the cost model's arithmetic).
        if not math.isfinite(s.value) or not 0 <= s.value <= MAX_COUNT:
            raise MetricsFormatError(f"{s.name} is {s.value}: not a count or fraction")
    usage = [s.value for s in samples if s.name == KV_USAGE]
    kv_usage = sum(usage) / len(usage) if usage else 0.0
    if kv_usage > 1.01:  # a 0-1 fraction; a hair above 1 is float noise, more is not vLLM's
        raise MetricsFormatError(f"{KV_USAGE} is {kv_usage}: not a 0-1 fraction")
    waiting = promtext.total(samples, WAITING)
    return Gauges(
        running=int(promtext.total(samples, RUNNING)),
        waiting=int(waiting),
        kv_usage=min(1.0, kv_usage),
        kv_capacity_tokens=capacity,
        preemptions=promtext.total(samples, PREEMPTIONS),
        # Part of the waiting (vLLM's two reasons add up to it): a page that says more is
        # clamped, not refused, since the series is optional and the rest of the page is sound.
        deferred=int(
            min(waiting, promtext.total(samples, WAITING_BY_REASON, {"reason": "deferred"}))
        ),
    )
