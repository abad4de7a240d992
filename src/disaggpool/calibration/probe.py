"""The calibration probe: drive one vLLM pod over HTTP with a designed workload, fit its profile.

`disaggpool calibrate` runs this against a pod (real vLLM or our emulator). Stages, each given a
share of the time budget and stopped early when it runs out (a fit needs only a few points per
coefficient, so an early stop still yields a profile, with its held-out error saying how good):

1. discovery: `/v1/models` (served name, max_model_len) and `/metrics`
   (`vllm:cache_config_info`: num_gpu_blocks x block_size = KV capacity in tokens);
2. prefill: single streaming requests with `max_tokens=1` on the idle pod, prompt lengths on a log
   grid -> TTFT(n);
3. decode: B concurrent streams with prompts of L tokens, `ignore_eos` -> mean inter-token gap
   at batch B and context K = B * (L + generated / 2), for B on a doubling grid and two L;
4. KV transfer (with `--peer`, the prefill pod): prefill legs on the peer, decode legs here, as
   vLLM's P/D proxy does -> decode-leg TTFT(n).

Prompts are sent as token-id lists, so their lengths are exact whatever the tokenizer. All I/O
of the probe lives here; the fitting is `calibration.fit` (pure).
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import math
import random
import re
import time
import uuid
from collections.abc import Callable
from typing import Any

import aiohttp

from disaggpool.calibration import fit
from disaggpool.core.profile import CalibrationProfile, DecodeModel, KVTransferModel, PrefillModel
from disaggpool.pdwire import prefill_leg_params

__all__ = ["ProbeConfig", "ProbeError", "ProbeResult", "run_probe"]

Progress = Callable[[str, int, int], None]

# Budget shares of the stages (the rest is discovery and fitting).
PREFILL_SHARE = 0.30
DECODE_SHARE = 0.45
TRANSFER_SHARE = 0.20
DECODE_TOKENS = 24  # tokens per stream in the decode stage
TOKEN_IDS = range(100, 400)  # valid ids for any vocabulary of 512 tokens or more


class ProbeError(RuntimeError):
    """The pod could not be probed (unreachable, errors, or too few measurements)."""


@dataclasses.dataclass(frozen=True)
class ProbeConfig:
    endpoint: str
    role: str = "decode"
    peer: str | None = None
    name: str = "probed"
    budget_s: float = 60.0
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    kv_bytes_per_token: int = 128 * 1024
    gpu: str = ""
    request_timeout_s: float = 60.0
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    profile: CalibrationProfile
    report: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class _Pod:
    url: str
    model: str
    max_model_len: int
    kv_capacity_tokens: int
    block_size: int


_INFO = re.compile(r"^vllm:cache_config_info\{(?P<labels>[^}]*)\}", re.MULTILINE)
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def parse_cache_config(metrics_text: str) -> tuple[int, int]:
    """(num_gpu_blocks, block_size) from vLLM's `vllm:cache_config_info` series."""
    m = _INFO.search(metrics_text)
    if not m:
        raise ProbeError("/metrics has no vllm:cache_config_info series")
    labels = dict(_LABEL.findall(m.group("labels")))
    try:
        return int(labels["num_gpu_blocks"]), int(labels["block_size"])
    except (KeyError, ValueError) as exc:
        raise ProbeError(f"vllm:cache_config_info lacks a usable {exc} label") from None


class _Client:
    def __init__(self, session: aiohttp.ClientSession, cfg: ProbeConfig) -> None:
        self.session = session
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)

    async def discover(self, url: str) -> _Pod:
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
        blocks, block_size = parse_cache_config(metrics)
        return _Pod(url, model, max_len, blocks * block_size, block_size)

    async def http_overhead(self, pod: _Pod, rounds: int = 7) -> float:
        """Median latency of a trivial API call: the HTTP and API-server cost in every TTFT.

        It is subtracted from the measured TTFTs, so that the constants describe the engine and
        the same profile fits a pod measured through a slower or faster network path.
        """
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
        self, pod: _Pod, n: int, max_tokens: int, extra: dict[str, Any] | None = None
    ) -> list[float]:
        """Send one streaming completion; return the arrival time of every token chunk."""
        body = {
            "model": pod.model,
            "prompt": self.prompt(n),
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

    async def prefill_leg(self, pod: _Pod, prompt: list[int], request_id: str) -> dict[str, Any]:
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


async def _prefill_stage(
    client: _Client, pod: _Pod, deadline: float, progress: Progress | None
) -> list[fit.PrefillSample]:
    top = max(16, min(pod.max_model_len - 8, 8192))  # long prompts pin down the quadratic term
    grid = sorted({round(16 * (top / 16) ** (i / 9)) for i in range(10)})
    plan = grid * 3
    random.Random(1).shuffle(plan)  # interleave lengths so an early stop keeps the spread
    samples: list[fit.PrefillSample] = []
    for i, n in enumerate(plan):
        if time.perf_counter() > deadline and len(samples) >= 8:
            break
        times = await client.stream(pod, n, 1)
        if len(times) >= 2:
            samples.append(fit.PrefillSample(n, times[1] - times[0]))
        if progress:
            progress("prefill", i + 1, len(plan))
    return samples


async def _decode_stage(
    client: _Client, pod: _Pod, cfg: ProbeConfig, deadline: float, progress: Progress | None
) -> list[fit.DecodeSample]:
    batches = [b for b in (1, 2, 4, 8, 16, 32, 64) if b <= cfg.max_num_seqs]
    # Two context lengths far apart separate the per-sequence and per-context-token costs.
    contexts = [c for c in (32, 1536) if c + DECODE_TOKENS < pod.max_model_len]
    # Twice through the grid, the second pass only if the budget allows: step noise averages out.
    plan = [(b, c) for b in batches for c in contexts] * 2
    samples: list[fit.DecodeSample] = []
    for i, (b, ctx) in enumerate(plan):
        if time.perf_counter() > deadline and len(samples) >= 6:
            break
        if b * (ctx + DECODE_TOKENS) > 0.8 * pod.kv_capacity_tokens:
            continue  # would preempt: the step model does not describe preemption
        runs = await asyncio.gather(*(client.stream(pod, ctx, DECODE_TOKENS) for _ in range(b)))
        # Only the window in which all B streams decode: before the last one joined, steps also
        # carried prefill work; after the first one finished, the batch was smaller. Per stream,
        # elapsed time over tokens in the window: a delivery stall followed by a burst of tokens
        # does not change it, where a per-gap statistic would.
        joined = max(t[1] for t in runs if len(t) > 1)
        leaving = min(t[-1] for t in runs)
        rates = []
        for t in runs:
            inside = [x for x in t[1:] if joined <= x <= leaving]
            if len(inside) >= 4:
                rates.append((inside[-1] - inside[0]) / (len(inside) - 1))
        if rates:
            rates.sort()
            itl = rates[len(rates) // 2]
            samples.append(fit.DecodeSample(b, b * (ctx + DECODE_TOKENS / 2), itl))
        if progress:
            progress("decode", i + 1, len(plan))
    return samples


async def _transfer_stage(
    client: _Client, pod: _Pod, peer: _Pod, deadline: float, progress: Progress | None
) -> list[fit.TransferSample]:
    top = max(32, min(pod.max_model_len - 8, peer.max_model_len - 8, 4096))
    grid = sorted({round(32 * (top / 32) ** (i / 5)) for i in range(6)})
    plan = grid * 3
    random.Random(2).shuffle(plan)
    samples: list[fit.TransferSample] = []
    for i, n in enumerate(plan):
        if time.perf_counter() > deadline and len(samples) >= 6:
            break
        request_id = f"probe-xfer-{i}-{client.rng.getrandbits(32):08x}"
        prompt = client.prompt(n)
        params = await client.prefill_leg(peer, prompt, request_id)
        start = time.perf_counter()
        body = {
            "model": pod.model,
            "prompt": prompt,
            "max_tokens": 1,
            "stream": True,
            "kv_transfer_params": params,
        }
        async with client.session.post(
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
        if first is not None:
            samples.append(fit.TransferSample(n, first - start))
        if progress:
            progress("transfer", i + 1, len(plan))
    return samples


async def _probe(cfg: ProbeConfig, progress: Progress | None) -> ProbeResult:
    start = time.perf_counter()
    timeout = aiohttp.ClientTimeout(total=cfg.request_timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        client = _Client(session, cfg)
        pod = await client.discover(cfg.endpoint.rstrip("/"))
        peer = await client.discover(cfg.peer.rstrip("/")) if cfg.peer else None
        budget = cfg.budget_s
        try:
            overhead = await client.http_overhead(pod)
            pre = await _prefill_stage(client, pod, start + PREFILL_SHARE * budget, progress)
            dec = await _decode_stage(
                client, pod, cfg, start + (PREFILL_SHARE + DECODE_SHARE) * budget, progress
            )
            xfer = (
                await _transfer_stage(client, pod, peer, start + (1 - 0.05) * budget, progress)
                if peer
                else []
            )
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise ProbeError(f"probe requests failed: {exc!r}") from None
    elapsed = time.perf_counter() - start
    pre = [fit.PrefillSample(s.prompt_tokens, max(1e-6, s.ttft_s - overhead)) for s in pre]
    xfer = [fit.TransferSample(s.prompt_tokens, max(1e-6, s.ttft_s - overhead)) for s in xfer]
    try:
        pre_fit = fit.fit_prefill(pre, cfg.max_num_batched_tokens, cfg.seed)
        dec_fit = fit.fit_decode(dec, cfg.seed)
        xfer_fit = fit.fit_transfer(xfer, dec_fit, cfg.seed) if xfer else None
    except ValueError as exc:
        raise ProbeError(f"too few measurements to fit: {exc}") from None
    fits = [pre_fit, dec_fit] + ([xfer_fit] if xfer_fit else [])
    quality, reason = fit.verdict(fits)
    if xfer_fit is None:
        reason += "; KV transfer not measured (no --peer): default 2 ms + 20 GB/s"
        k0, bandwidth = 0.002, 20e9
    else:
        k0 = xfer_fit.coef[0]
        bandwidth = cfg.kv_bytes_per_token / max(xfer_fit.coef[1], 1e-15)
    profile = CalibrationProfile(
        name=cfg.name,
        gpu=cfg.gpu,
        model=pod.model,
        prefill=PrefillModel(*pre_fit.coef),
        decode=DecodeModel(*dec_fit.coef),
        kv_transfer=KVTransferModel(k0, float(cfg.kv_bytes_per_token), bandwidth),
        kv_capacity_tokens=pod.kv_capacity_tokens,
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        block_size=pod.block_size,
        max_model_len=pod.max_model_len,
        source="probe",
        quality=quality,
        fitted_at=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        ttft_mape=round(pre_fit.holdout_mape, 4),
        tpot_mape=round(dec_fit.holdout_mape, 4),
        notes=reason,
    )
    report = {
        "endpoint": cfg.endpoint,
        "peer": cfg.peer,
        "role": cfg.role,
        "elapsed_s": round(elapsed, 3),
        "http_overhead_s": round(overhead, 6),
        "budget_s": cfg.budget_s,
        "samples": {"prefill": len(pre), "decode": len(dec), "transfer": len(xfer)},
        "fits": {
            "prefill": pre_fit.as_dict(),
            "decode": dec_fit.as_dict(),
            **({"transfer": xfer_fit.as_dict()} if xfer_fit else {}),
        },
        "quality": quality,
        "reason": reason,
    }
    if not all(math.isfinite(c) for f in fits for c in f.coef):
        raise ProbeError("fit produced non-finite constants")
    return ProbeResult(profile, report)


def run_probe(cfg: ProbeConfig, progress: Progress | None = None) -> ProbeResult:
    """Probe one pod (blocking); raises ProbeError when it cannot."""
    return asyncio.run(_probe(cfg, progress))
