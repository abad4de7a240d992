"""The calibration probe's HTTP client against one vLLM pod (or our emulator).

`stages` measures through it and `probe` opens it; every request the probe sends is here:
discovery (`/v1/models`, `/metrics`), streaming completions timed per token chunk, the twin of a
measured request that the server rejects unprocessed (the request path's own cost), the legs of
a prefill/decode handoff, and the server's own inter-token histogram. `/metrics` is read with
`promtext`. Prompts are sent as token-id lists, so their lengths are exact whatever the tokenizer.
"""

from __future__ import annotations

import random
import time
import uuid
from typing import Any

import aiohttp

from disaggpool import promtext
from disaggpool.calibration.common import Pod, ProbeConfig, ProbeError
from disaggpool.pdwire import prefill_leg_params

__all__ = ["Client", "cache_config", "itl_totals", "prefix_caching_enabled"]

TOKEN_IDS = range(100, 400)  # valid ids for any vocabulary of 512 tokens or more
CACHE_CONFIG = "vllm:cache_config_info"
ITL_SUM = "vllm:inter_token_latency_seconds_sum"
ITL_COUNT = "vllm:inter_token_latency_seconds_count"


def cache_config(metrics_text: str) -> tuple[int, int]:
    """(num_gpu_blocks, block_size) from vLLM's `vllm:cache_config_info` series (its first
    engine's); `ProbeError` when the page has no usable one."""
    try:
        samples = promtext.parse(metrics_text, [CACHE_CONFIG])
    except promtext.PromTextError as exc:
        raise ProbeError(f"/metrics: {exc}") from None
    if not samples:
        raise ProbeError(f"/metrics has no {CACHE_CONFIG} series")
    labels = samples[0].labels
    try:
        return int(labels["num_gpu_blocks"]), int(labels["block_size"])
    except (KeyError, ValueError) as exc:
        raise ProbeError(f"{CACHE_CONFIG} lacks a usable {exc} label") from None


def prefix_caching_enabled(metrics_text: str) -> bool:
    """Whether vLLM's `vllm:cache_config_info` says prefix caching is on (its first engine's)."""
    try:
        samples = promtext.parse(metrics_text, [CACHE_CONFIG])
    except promtext.PromTextError:
        return False
    return bool(samples) and samples[0].labels.get("enable_prefix_caching") == "True"


def itl_totals(metrics_text: str) -> tuple[float, float] | None:
    """(sum, count) of the server's `vllm:inter_token_latency_seconds` histogram over its
    engines; None when it has observed nothing yet or the page does not say."""
    try:
        samples = promtext.parse(metrics_text, [ITL_SUM, ITL_COUNT])
    except promtext.PromTextError:
        return None  # the caller then times the run itself or not at all
    count = promtext.total(samples, ITL_COUNT)
    return (promtext.total(samples, ITL_SUM), count) if count else None


class Client:
    """Requests to the pods of one probe run, over one session; prompts drawn from `cfg.seed`."""

    def __init__(self, session: aiohttp.ClientSession, cfg: ProbeConfig) -> None:
        self.session = session
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.twins_accepted = False  # a server that does not validate: no more twins

    async def discover(self, url: str) -> Pod:
        try:
            async with self.session.get(f"{url}/v1/models") as resp:
                models = await resp.json()
            async with self.session.get(f"{url}/metrics") as resp:
                metrics = await resp.text()
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise ProbeError(f"{url} is not answering like vLLM: {exc}") from None
        try:
            entry = models["data"][0]
            model, max_len = str(entry["id"]), int(entry.get("max_model_len") or 2048)
        except (KeyError, IndexError, TypeError, ValueError):
            raise ProbeError(f"{url}/v1/models: unexpected body {str(models)[:200]}") from None
        blocks, block_size = cache_config(metrics)
        return Pod(
            url, model, max_len, blocks * block_size, block_size, prefix_caching_enabled(metrics)
        )

    async def rejected(
        self, pod: Pod, prompt: list[int], extra: dict[str, Any] | None = None
    ) -> float | None:
        """Round trip of the measured request's twin that the server refuses unprocessed.

        The same endpoint, body and prompt, but ``min_tokens > max_tokens``, which vLLM rejects
        with a 400 after parsing and validating the prompt and before its engine sees it: the
        HTTP and API-server share of that request's TTFT. Sent just before its twin, so both
        find the connection and the machine in the same state; and twice, the first time only to
        wake the server: a process idle for a few milliseconds answers its next request up to a
        millisecond slower (measured on a virtual machine here), where the twin, right behind,
        finds it awake. None if the server accepted it; then no twin is sent again (one that
        carries KV coordinates would have the real decode leg's blocks pulled).
        """
        if self.twins_accepted:
            return None
        body = {
            "model": pod.model,
            "prompt": prompt,
            "max_tokens": 1,
            "min_tokens": 2,
            "stream": True,
            **(extra or {}),
        }
        for _ in range(2):
            start = time.perf_counter()
            async with self.session.post(f"{pod.url}/v1/completions", json=body) as resp:
                await resp.read()
            elapsed = time.perf_counter() - start
            if not 400 <= resp.status < 500:
                self.twins_accepted = True
                return None
        return elapsed

    async def http_overhead(self, pod: Pod, rounds: int = 7) -> float:
        """Median latency of a trivial API call: the fallback overhead estimate for a server
        that accepts `rejected`'s twins."""
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            async with self.session.post(
                f"{pod.url}/tokenize", json={"model": pod.model, "prompt": "hi"}
            ) as resp:
                await resp.read()
            times.append(time.perf_counter() - start)
        times.sort()
        return times[len(times) // 2]

    def prompt(self, n: int) -> list[int]:
        return [self.rng.choice(TOKEN_IDS) for _ in range(n)]

    async def stream(
        self,
        pod: Pod,
        prompt: int | list[int],
        max_tokens: int,
        extra: dict[str, Any] | None = None,
    ) -> list[float]:
        """Send one streaming completion (a prompt, or its length); return the send time and
        the arrival time of every token chunk."""
        body = {
            "model": pod.model,
            "prompt": self.prompt(prompt) if isinstance(prompt, int) else prompt,
            "max_tokens": max_tokens,
            "min_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
            "temperature": 0.0,
            **(extra or {}),
        }
        headers = {"X-Request-Id": f"probe-{uuid.UUID(int=self.rng.getrandbits(128))}"}
        times = [time.perf_counter()]
        async with self.session.post(
            f"{pod.url}/v1/completions", json=body, headers=headers
        ) as resp:
            if resp.status != 200:
                raise ProbeError(f"{pod.url}: HTTP {resp.status}: {(await resp.text())[:300]}")
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                if b'"text"' in line:
                    times.append(time.perf_counter())
        return times

    async def itl_totals(self, pod: Pod) -> tuple[float, float] | None:
        """(sum, count) of the server's own `vllm:inter_token_latency_seconds` histogram; None
        when unreachable or nothing observed yet."""
        try:
            async with self.session.get(f"{pod.url}/metrics") as resp:
                text = await resp.text()
        except (aiohttp.ClientError, TimeoutError):
            return None
        return itl_totals(text)

    async def prefill_leg(self, pod: Pod, prompt: list[int], request_id: str) -> dict[str, Any]:
        """The prefill leg of a P/D handoff; returns the KV coordinates for the decode leg."""
        body = {
            "model": pod.model,
            "prompt": prompt,
            "max_tokens": 1,
            "stream": False,
            "kv_transfer_params": prefill_leg_params(),
        }
        async with self.session.post(
            f"{pod.url}/v1/completions", json=body, headers={"X-Request-Id": request_id}
        ) as resp:
            data = await resp.json()
            if resp.status != 200 or not isinstance(data.get("kv_transfer_params"), dict):
                raise ProbeError(
                    f"{pod.url}: prefill leg failed: HTTP {resp.status} {str(data)[:300]}"
                )
            return dict(data["kv_transfer_params"])

    async def decode_leg(
        self, pod: Pod, prompt: list[int], params: dict[str, Any], request_id: str
    ) -> float | None:
        """The decode leg of a P/D handoff (`params` from `prefill_leg`): seconds from sending
        it to its first token, None if no token came."""
        start = time.perf_counter()
        body = {
            "model": pod.model,
            "prompt": prompt,
            "max_tokens": 1,
            "stream": True,
            "kv_transfer_params": params,
        }
        async with self.session.post(
            f"{pod.url}/v1/completions", json=body, headers={"X-Request-Id": request_id}
        ) as resp:
            if resp.status != 200:
                raise ProbeError(
                    f"{pod.url}: decode leg failed: HTTP {resp.status} {(await resp.text())[:300]}"
                )
            first = None
            async for raw in resp.content:
                if first is None and b'"text"' in raw:
                    first = time.perf_counter()
        return None if first is None else first - start
