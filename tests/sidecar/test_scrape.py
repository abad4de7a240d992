"""Reading vLLM's /metrics: the emulator's real page (checked against real vLLM's names in
tests/emulator), data-parallel engines summed, and clear errors for pages that are not vLLM's."""

from __future__ import annotations

import urllib.request

import pytest
from sidecar_testkit import A40

from disaggpool.emulator.config import EmulatorConfig
from disaggpool.emulator.harness import EmulatorThread
from disaggpool.sidecar.scrape import MetricsFormatError, parse_gauges


def test_reads_the_emulators_metrics_page() -> None:
    cfg = EmulatorConfig(A40, port=0, side_channel_port=0, jitter=0.0)
    with EmulatorThread(cfg) as emu:
        text = urllib.request.urlopen(f"{emu.url}/metrics").read().decode()
    g = parse_gauges(text)
    assert (g.running, g.waiting, g.kv_usage) == (0, 0, 0.0)
    assert g.kv_capacity_tokens == cfg.num_gpu_blocks * cfg.block_size


DP = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 4.0
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 0.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="deferred"} 1.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="100"} 1.0
vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="100"} 1.0
vllm:num_preemptions_total{engine="0",model_name="m"} 2.0
"""


def test_data_parallel_engines_are_summed() -> None:
    g = parse_gauges(DP)
    assert (g.running, g.waiting, g.kv_capacity_tokens, g.preemptions) == (7, 1, 3200, 2.0)
    assert g.kv_usage == pytest.approx(0.5)  # the mean fraction over engines of equal size
    assert g.deferred == 1  # waiting for remote KV: part of the waiting, never more than it
    assert parse_gauges(DP.replace('"deferred"} 1.0', '"deferred"} 9.0')).deferred == 1
    assert parse_gauges(DP.replace('"deferred"} 1.0', '"capacity"} 1.0')).deferred == 0


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("", "num_requests_running"),
        ("<html>not metrics</html>", "not a vLLM pod"),
        ('vllm:num_requests_running{engine="0"} lots\nvllm:num_requests_waiting 0', "malformed"),
        (DP.replace('num_gpu_blocks="100"', 'num_gpu_blocks="x"'), "cache_config_info"),
        (DP.replace('num_gpu_blocks="100"', 'num_gpu_blocks="-5"'), "cache_config_info"),
        # Legal exposition, impossible states: each once ended the scrape loop (int(NaN)).
        (DP.replace('"m"} 3.0', '"m"} NaN'), "running is nan"),
        (DP.replace('"m"} 3.0', '"m"} +Inf'), "running is inf"),
        (DP.replace('"m"} 1.0', '"m"} -1'), "waiting is -1"),
        (DP.replace('"m"} 1.0', '"m"} 1e300'), "waiting is 1e"),
        (DP.replace('"m"} 0.25', '"m"} -Inf'), "usage_perc is -inf"),
        (DP.replace('"m"} 0.25', '"m"} 2.5'), "not a 0-1 fraction"),
    ],
)
def test_pages_that_are_not_vllm_are_refused(text: str, match: str) -> None:
    with pytest.raises(MetricsFormatError, match=match):
        parse_gauges(text)
