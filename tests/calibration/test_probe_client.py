"""Pieces of the probe's client: twin requests (`Client.rejected`), which the emulator refuses as
vLLM does and which a server that accepts them gets no more of (a twin carrying KV coordinates
would pull the real decode leg's blocks); the filter that drops streams read in bursts
(`stages.read_as_sent`); and what the client reads off `/metrics`."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from disaggpool.calibration.client import Client, cache_config, itl_totals
from disaggpool.calibration.common import Pod, ProbeConfig, ProbeError
from disaggpool.calibration.stages import read_as_sent
from disaggpool.core.hardware import builtin_profile
from disaggpool.emulator.config import EmulatorConfig
from disaggpool.emulator.harness import EmulatorThread


async def twice(url: str, *, discover: bool) -> tuple[float | None, float | None, bool]:
    """Two twins in a row: their round trips, and whether the probe saw one accepted."""
    async with aiohttp.ClientSession() as session:
        client = Client(session, ProbeConfig(endpoint=url))
        pod = await client.discover(url) if discover else Pod(url, "m", 4096, 1, 16)
        first = await client.rejected(pod, client.prompt(32))
        second = await client.rejected(pod, client.prompt(32))
        return first, second, client.twins_accepted


def test_the_emulator_rejects_twins_and_the_probe_times_them() -> None:
    cfg = EmulatorConfig(builtin_profile("h100-llama3-8b"), port=0, side_channel_port=0)
    with EmulatorThread(cfg) as emu:
        first, second, accepted = asyncio.run(twice(emu.url, discover=True))
        assert emu.call(lambda: emu.instance.active_requests) == 0  # nothing was queued
    assert first is not None and second is not None and first > 0
    assert not accepted


def test_a_server_that_accepts_twins_gets_no_more() -> None:
    hits: list[dict[str, object]] = []

    async def completions(request: web.Request) -> web.Response:
        hits.append(await request.json())
        return web.json_response({"choices": [{"text": "x"}]})

    async def run() -> tuple[float | None, float | None, bool]:
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            return await twice(f"http://127.0.0.1:{port}", discover=False)
        finally:
            await runner.cleanup()

    first, second, accepted = asyncio.run(run())
    assert (first, second, accepted) == (None, None, True)
    assert len(hits) == 1 and hits[0]["min_tokens"] == 2  # the second call sent nothing


def test_streams_read_in_bursts_are_not_timed() -> None:
    # Sent at 0, first token after a 30 ms prefill, then one chunk per 10 ms step.
    steady = [0.0, *(0.030 + 0.010 * i + 0.0003 * (i % 3) for i in range(24))]
    assert read_as_sent(steady, steady[3:20])
    # A starved reader: a few chunks, then the rest in one go after a long stall.
    bursty = [0.0, 0.030, 0.040, 0.050, *(0.250 + 4e-6 * i for i in range(21))]
    assert not read_as_sent(bursty, bursty[2:20])
    # All of it read at once at the end: evenly spaced, but by microseconds.
    at_once = [0.0, *(0.270 + 4e-6 * i for i in range(24))]
    assert not read_as_sent(at_once, at_once[3:20])


def test_the_servers_inter_token_histogram_is_read() -> None:
    cfg = EmulatorConfig(builtin_profile("h100-llama3-8b"), port=0, side_channel_port=0)

    async def run(url: str) -> tuple[tuple[float, float] | None, tuple[float, float] | None]:
        async with aiohttp.ClientSession() as session:
            client = Client(session, ProbeConfig(endpoint=url))
            pod = await client.discover(url)
            before = await client.itl_totals(pod)
            await client.stream(pod, 16, 6)
            return before, await client.itl_totals(pod)

    with EmulatorThread(cfg) as emu:
        before, after = asyncio.run(run(emu.url))
    assert before is None  # nothing observed yet
    assert after is not None and after[1] == 5 and after[0] > 0  # 6 tokens, 5 gaps


DP_PAGE = """# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="100"} 1.0
vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="100"} 1.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="+Inf"} 4.0
vllm:inter_token_latency_seconds_sum{engine="0"} 0.5
vllm:inter_token_latency_seconds_count{engine="0"} 4.0
vllm:inter_token_latency_seconds_sum{engine="1"} 0.25
vllm:inter_token_latency_seconds_count{engine="1"} 1.0
"""


def test_the_kv_cache_configuration_is_read_off_metrics() -> None:
    assert cache_config(DP_PAGE) == (100, 16)  # the first engine's


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("<html>not metrics</html>", "no vllm:cache_config_info"),
        ('vllm:cache_config_info{block_size="16"} 1.0', "'num_gpu_blocks'"),
        ('vllm:cache_config_info{block_size="x",num_gpu_blocks="1"} 1', "lacks a usable"),
        ('vllm:cache_config_info{block_size="16",num_gpu_blocks="1" 1', "malformed"),
    ],
)
def test_pages_without_a_usable_cache_configuration_are_a_probe_error(
    text: str, match: str
) -> None:
    with pytest.raises(ProbeError, match=match):
        cache_config(text)


def test_the_inter_token_histogram_is_summed_over_engines() -> None:
    assert itl_totals(DP_PAGE) == (0.75, 5.0)
    assert (
        itl_totals(
            DP_PAGE.replace('count{engine="0"} 4.0', 'count{engine="0"} 0.0').replace(
                'count{engine="1"} 1.0', 'count{engine="1"} 0.0'
            )
        )
        is None
    )  # nothing observed yet
    assert itl_totals("vllm:inter_token_latency_seconds_count{engine=0} 1") is None  # malformed
    assert itl_totals("") is None
