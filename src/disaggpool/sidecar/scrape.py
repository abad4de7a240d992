"""Reading a vLLM pod's `/metrics`: the few gauges the router needs, fast.

A full Prometheus parse of vLLM's exposition (dozens of histograms) costs milliseconds; the
router scrapes every pod every interval, so this reads only the lines it needs by prefix and
sums them over the `engine` label (data-parallel pods expose one series per engine). Names are
vLLM's V1 names (`../shared/reference/vllm-pd-protocol.md` §3): `vllm:num_requests_running`,
`vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` (a 0-1 fraction despite the name),
`vllm:cache_config_info` (labels `num_gpu_blocks`, `block_size`), `vllm:num_preemptions_total`.
"""

from __future__ import annotations

import re

from disaggpool.sidecar.state import Gauges

__all__ = ["MetricsFormatError", "parse_gauges"]

_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


class MetricsFormatError(ValueError):
    """The text is not a vLLM metrics page (a required series is missing or malformed)."""


def _value(line: str) -> float:
    # "name{labels} value [timestamp]": the value is the first field after the closing brace.
    rest = line[line.rindex("}") + 1 :] if "}" in line else line.split(" ", 1)[1]
    try:
        return float(rest.split()[0])
    except (IndexError, ValueError):
        raise MetricsFormatError(f"malformed sample line: {line[:120]!r}") from None


def parse_gauges(text: str) -> Gauges:
    running = waiting = preemptions = 0.0
    usage: list[float] = []
    capacity = 0
    seen = set()
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name == "vllm:num_requests_running":
            running += _value(line)
        elif name == "vllm:num_requests_waiting":
            waiting += _value(line)
        elif name == "vllm:kv_cache_usage_perc":
            usage.append(_value(line))
        elif name == "vllm:num_preemptions_total":
            preemptions += _value(line)
        elif name == "vllm:cache_config_info":
            labels = dict(_LABEL.findall(line))
            try:
                capacity += int(labels["num_gpu_blocks"]) * int(labels["block_size"])
            except (KeyError, ValueError):
                raise MetricsFormatError(
                    "vllm:cache_config_info lacks integer num_gpu_blocks/block_size labels"
                ) from None
        else:
            continue
        seen.add(name)
    missing = {"vllm:num_requests_running", "vllm:num_requests_waiting"} - seen
    if missing:
        raise MetricsFormatError(f"no {', '.join(sorted(missing))} series: not a vLLM pod?")
    return Gauges(
        running=int(running),
        waiting=int(waiting),
        kv_usage=sum(usage) / len(usage) if usage else 0.0,
        kv_capacity_tokens=capacity,
        preemptions=preemptions,
    )
