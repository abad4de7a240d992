"""The calibration probe: drive one vLLM pod over HTTP with a designed workload, fit its profile.

`disaggpool calibrate` runs this against a pod (real vLLM or our emulator). Stages, each given a
share of the time budget and stopped early when it runs out (a fit needs only a few points per
coefficient, so an early stop still yields a profile, with its held-out error saying how good):

1. discovery: `/v1/models` (served name, max_model_len) and `/metrics`
   (`vllm:cache_config_info`: num_gpu_blocks x block_size = KV capacity in tokens);
2. prefill: single streaming requests with `max_tokens=1` on the idle pod, prompt lengths on a log
   grid -> TTFT(n);
3. KV transfer (with `--peer`, the prefill pod): prefill legs on the peer, decode legs here, as
   vLLM's P/D proxy does -> decode-leg TTFT(n);
4. decode: B concurrent streams with prompts of L tokens, `ignore_eos` -> mean inter-token gap
   at batch B and context K = B * (L + generated / 2), for B on a doubling grid and two L; last,
   as it can always use more time: what the other stages leave over goes to it.

Each grid is repeated, reshuffled, until its stage's time is up. Every TTFT is taken net of the
request path outside the engine, measured by a twin of the request that the server rejects
unprocessed (`_Client.rejected`). Prompts are sent as token-id lists, so their lengths are exact
whatever the tokenizer. All I/O of the probe lives here; the fitting is `calibration.fit` (pure).
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import itertools
import math
import random
import re
import statistics
import time
import uuid
from collections.abc import Callable
from typing import Any

import aiohttp
import numpy as np

from disaggpool import precise_loop
from disaggpool.calibration import fit
from disaggpool.core.profile import CalibrationProfile, DecodeModel, KVTransferModel, PrefillModel
from disaggpool.pdwire import prefill_leg_params

__all__ = ["ProbeConfig", "ProbeError", "ProbeResult", "run_probe"]

Progress = Callable[[str, int, int], None]

# Budget shares of the stages (the rest is discovery and fitting).
PREFILL_SHARE = 0.30
TRANSFER_SHARE = 0.20  # the decode stage has the rest, up to 95% of the budget
HARD_STOP = 1.25  # a stage short of samples may run on to this share of the budget, no further
DECODE_TOKENS = 24  # tokens per stream in the decode stage
DECODE_PASSES = 8  # most passes through the decode grid (fewer when the budget runs out)
DECODE_JOIN_SHARE = 0.1  # most of the decode stage one run may spend prefilling its prompts
PREFILL_PASSES = 24  # most passes through the prefill grid
TRANSFER_PASSES = 16  # most passes through the KV-transfer grid
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
    # Poll instead of sleeping while waiting for answers (`precise_loop.BusyPollSelector`):
    # sub-millisecond constants come out right on virtual machines whose idle CPUs wake slowly,
    # at the price of one busy core for the probe's duration. Not in a process it shares.
    busy_poll: bool = False


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


@dataclasses.dataclass(frozen=True)
class _Stop:
    """When a stage stops: at `soft` once it has the samples a fit needs, at `hard` regardless
    (a pod too slow, or a probe too starved of CPU, to give them in time must not hold the Job;
    the fit then says there are too few)."""

    soft: float
    hard: float
    need: int

    def due(self, have: int) -> bool:
        now = time.perf_counter()
        return now > self.hard or (now > self.soft and have >= self.need)


_ITL = re.compile(r"^vllm:inter_token_latency_seconds_(sum|count)(?:\{[^}]*\})? (\S+)", re.M)
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
        self.twins_accepted = False  # a server that does not validate: no more twins

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

    async def rejected(
        self, pod: _Pod, prompt: list[int], extra: dict[str, Any] | None = None
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

    async def http_overhead(self, pod: _Pod, rounds: int = 7) -> float:
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
        pod: _Pod,
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

    async def itl_totals(self, pod: _Pod) -> tuple[float, float] | None:
        """(sum, count) of the server's own `vllm:inter_token_latency_seconds` histogram."""
        try:
            async with self.session.get(f"{pod.url}/metrics") as resp:
                text = await resp.text()
        except (aiohttp.ClientError, TimeoutError):
            return None
        totals = {"sum": 0.0, "count": 0.0}
        for kind, value in _ITL.findall(text):
            totals[kind] += float(value)
        return (totals["sum"], totals["count"]) if totals["count"] else None

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
    client: _Client,
    pod: _Pod,
    stop: _Stop,
    progress: Progress | None,
    overheads: list[fit.OverheadSample],
) -> list[fit.PrefillSample]:
    top = max(16, min(pod.max_model_len - 8, 8192))  # long prompts pin down the quadratic term
    grid = sorted({round(16 * (top / 16) ** (i / 9)) for i in range(10)})
    # Two more of the shortest and three of the longest per pass: the fixed cost is read off the
    # first, the quadratic term off the second, where it is a fifth of the TTFT or more.
    grid += grid[:1] * 2 + grid[-1:] * 3
    shuffle = random.Random(1)
    plan = []
    for _ in range(PREFILL_PASSES):  # each pass shuffled: an early stop keeps the spread
        shuffle.shuffle(grid)
        plan += grid
    samples: list[fit.PrefillSample] = []
    for i, n in enumerate(plan):
        if stop.due(len(samples)):
            break
        prompt = client.prompt(n)
        overhead = await client.rejected(pod, prompt)
        if overhead is not None:
            overheads.append(fit.OverheadSample(n, overhead))
        times = await client.stream(pod, prompt, 1)
        if len(times) >= 2:
            samples.append(fit.PrefillSample(n, times[1] - times[0]))
        if progress:
            progress("prefill", i + 1, len(plan))
    return samples


def _interpolated(samples: list[fit.PrefillSample]) -> Callable[[int], float]:
    """Measured TTFT as a function of prompt length: per-length medians, interpolated."""
    by_length: dict[int, list[float]] = {}
    for s in samples:
        by_length.setdefault(s.prompt_tokens, []).append(s.ttft_s)
    if not by_length:
        return lambda n: 0.0  # nothing measured: the fit will say so
    lengths = sorted(by_length)
    medians = [statistics.median(by_length[n]) for n in lengths]
    return lambda n: float(np.interp(n, lengths, medians))


async def _decode_stage(
    client: _Client,
    pod: _Pod,
    cfg: ProbeConfig,
    stop: _Stop,
    progress: Progress | None,
    prefill_time: Callable[[int], float],
) -> tuple[list[fit.DecodeSample], int]:
    """(samples, how many of them the server's histogram timed: see below)."""
    batches = [b for b in (1, 2, 4, 8, 16, 32, 64) if b <= cfg.max_num_seqs]
    # Two context lengths far apart separate the per-sequence and per-context-token costs.
    contexts = [c for c in (32, 1536) if c + DECODE_TOKENS < pod.max_model_len]
    # A run first prefills its B prompts, which at long contexts and large batches costs more
    # than everything else (64 prompts of 1536 tokens: 14 s on an A40). Such a run is left
    # out when that would take more than a tenth of the stage: repeats of the others buy more.
    stage = max(stop.soft - time.perf_counter(), 0.0)
    grid = [
        (b, c)
        for b in batches
        for c in contexts
        if b * (c + DECODE_TOKENS) <= 0.8 * pod.kv_capacity_tokens  # else it would preempt
        and (b * prefill_time(c) <= DECODE_JOIN_SHARE * stage or (b, c) == (1, contexts[0]))
    ]
    # Through the grid again and again while the budget lasts: step noise averages out.
    plan = grid * DECODE_PASSES
    samples: list[fit.DecodeSample] = []
    server_timed = 0
    for i, (b, ctx) in enumerate(plan):
        if stop.due(len(samples)):
            break
        before = await client.itl_totals(pod)
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
            if len(inside) >= 4 and _read_as_sent(t, inside):
                rates.append((inside[-1] - inside[0]) / (len(inside) - 1))
        context = b * (ctx + DECODE_TOKENS / 2)
        if rates:
            rates.sort()
            samples.append(fit.DecodeSample(b, context, rates[len(rates) // 2]))
        else:
            # The probe could not time any stream itself: the server's own inter-token
            # histogram over the run instead (its join steps, which carried prefill work, make
            # it read a little high; the held-out error says how much that matters).
            after = await client.itl_totals(pod)
            if before and after and after[1] > before[1]:
                itl = (after[0] - before[0]) / (after[1] - before[1])
                samples.append(fit.DecodeSample(b, context, itl))
                server_timed += 1
        if progress:
            progress("decode", i + 1, len(plan))
    return samples, server_timed


def _read_as_sent(stream: list[float], inside: list[float]) -> bool:
    """Whether the chunks of a stream (send time, then arrivals) that fall in the measuring
    window (`inside`) reached the probe spread out as they were sent, one per step.

    A probe starved of CPU (a contended host) reads a stream's chunks from its socket in bursts,
    and then their arrival times say nothing about the steps. Two signs: most gaps are
    microseconds and a few long (a decoding stream's gaps are all about one step, so their
    median is near their mean); or the whole window went by in a flash, its time per token a
    tenth or less of the request's own time per token.
    """
    gaps = [b - a for a, b in itertools.pairwise(inside)]
    per_token = (stream[-1] - stream[0]) / (len(stream) - 1)
    return (
        statistics.median(gaps) >= 0.25 * statistics.fmean(gaps)
        and statistics.fmean(gaps) > 0.1 * per_token
    )


async def _transfer_stage(
    client: _Client,
    pod: _Pod,
    peer: _Pod,
    stop: _Stop,
    progress: Progress | None,
    overheads: list[fit.OverheadSample],
) -> list[fit.TransferSample]:
    top = max(32, min(pod.max_model_len - 8, peer.max_model_len - 8, 4096))
    grid = sorted({round(32 * (top / 32) ** (i / 5)) for i in range(6)})
    # The short prompts pin down k0 and cost little: three more of them per pass.
    grid += [grid[0]] * 3
    shuffle = random.Random(2)
    plan = []
    for _ in range(TRANSFER_PASSES):
        shuffle.shuffle(grid)
        plan += grid
    samples: list[fit.TransferSample] = []
    for i, n in enumerate(plan):
        if stop.due(len(samples)):
            break
        request_id = f"probe-xfer-{i}-{client.rng.getrandbits(32):08x}"
        prompt = client.prompt(n)
        params = await client.prefill_leg(peer, prompt, request_id)
        # The twin carries the same KV coordinates (a larger body, parsed the same way); vLLM
        # rejects it before anything is scheduled, so P's blocks wait for the real decode leg.
        overhead = await client.rejected(pod, prompt, {"kv_transfer_params": params})
        if overhead is not None:
            overheads.append(fit.OverheadSample(n, overhead))
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
        overheads: list[fit.OverheadSample] = []
        hard = start + HARD_STOP * budget

        def stop(share: float, need: int) -> _Stop:
            return _Stop(start + share * budget, hard, need)

        try:
            pre = await _prefill_stage(client, pod, stop(PREFILL_SHARE, 8), progress, overheads)
            # The KV transfer before the decode stage, whose grid never runs short of work:
            # time the other stages leave over goes to it.
            xfer = (
                await _transfer_stage(
                    client,
                    pod,
                    peer,
                    stop(PREFILL_SHARE + TRANSFER_SHARE, 6),
                    progress,
                    overheads,
                )
                if peer
                else []
            )
            dec, server_timed = await _decode_stage(
                client, pod, cfg, stop(1 - 0.05, 6), progress, _interpolated(pre)
            )
            if len(overheads) >= 4:
                path = "rejected twin requests"
                base, per_token = fit.fit_overhead(overheads)
            else:  # the server accepted the twins: a constant from a trivial call instead
                path = "/tokenize round trip"
                base, per_token = await client.http_overhead(pod), 0.0
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise ProbeError(f"probe requests failed: {exc!r}") from None
    elapsed = time.perf_counter() - start

    def engine_time(n: int, ttft: float) -> float:
        return max(1e-6, ttft - base - per_token * n)

    pre = [fit.PrefillSample(s.prompt_tokens, engine_time(s.prompt_tokens, s.ttft_s)) for s in pre]
    xfer = [
        fit.TransferSample(s.prompt_tokens, engine_time(s.prompt_tokens, s.ttft_s)) for s in xfer
    ]
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
        "http_overhead": {
            "from": path,
            "seconds": round(base, 6),
            "seconds_per_prompt_token": per_token,
            "samples": len(overheads),
        },
        "budget_s": cfg.budget_s,
        "samples": {
            "prefill": len(pre),
            "decode": len(dec),
            "decode_timed_by_server": server_timed,
            "transfer": len(xfer),
        },
        # What was fitted (TTFTs net of the request path), for anyone who doubts a fit.
        "measurements": {
            "prefill": [[s.prompt_tokens, round(s.ttft_s, 6)] for s in pre],
            "decode": [[s.batch, s.context_tokens, round(s.itl_s, 6)] for s in dec],
            "transfer": [[s.prompt_tokens, round(s.ttft_s, 6)] for s in xfer],
        },
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
    factory = precise_loop.busy_poll_event_loop if cfg.busy_poll else None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(_probe(cfg, progress))
