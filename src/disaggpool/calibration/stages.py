"""The calibration probe's measurement stages and their share of its time budget.

`probe` calls `measure` once discovery is done; it runs, in this order:

1. prefill: single streaming requests with `max_tokens=1` on the idle pod, prompt lengths on a
   log grid -> TTFT(n); on a pod that caches prefixes, every third prompt is followed by one
   sharing its leading half -> TTFT(n, h cached), which checks the prefill model's cache credit;
2. KV transfer (with a peer, the prefill pod): prefill legs on the peer, decode legs here, as
   vLLM's P/D proxy does -> decode-leg TTFT(n);
3. decode: B concurrent streams with prompts of L tokens, `ignore_eos` -> mean inter-token gap
   at batch B and context K = B * (L + generated / 2), for B on a doubling grid and two L, timed
   only while all B streams decode (a point whose streams never did, joining them having taken
   longer than their tokens, streams more tokens on its next pass); last, as it can always use
   more time: what the other stages leave over goes to it;
4. the request path: the rejected twins timed alongside prefill and transfer requests, fitted as
   a line in the prompt length (or a `/tokenize` round trip if the server accepted the twins).

Each stage has a share of the budget and stops early when it runs out (a fit needs only a few
points per coefficient, so an early stop still yields a profile, with its held-out error saying
how good). Each grid is repeated, reshuffled, until its stage's time is up. A stage short of the
samples a fit needs runs on, to `HARD_STOP` times the budget at most: there every request still
in flight is cut (closing it aborts it on the pod, as vLLM aborts a request whose client went
away) and its point dropped, so that a slow point (a batch of 64 streams, an 8k-token prompt)
cannot carry the probe seconds past the cap. All requests go through `client.Client`; the
samples go to `assemble` (pure) for fitting.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import random
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence

import numpy as np

from disaggpool.calibration import fit
from disaggpool.calibration.client import Client
from disaggpool.calibration.common import Measured, Pod, ProbeConfig, Progress, RequestPath

__all__ = [
    "Budget",
    "Stop",
    "decode_stage",
    "interpolated",
    "measure",
    "prefill_stage",
    "read_as_sent",
    "request_path",
    "transfer_stage",
]

# Budget shares of the stages (the rest is discovery and fitting).
PREFILL_SHARE = 0.30
TRANSFER_SHARE = 0.20  # the decode stage has the rest, up to 95% of the budget
DECODE_END = 0.95
# A stage short of samples may run on, but the probe, its fits included, ends within this share
# of the budget: measuring stops `FIT_RESERVE_S` before it (never before the budget itself), as
# the fits of a few samples on a busy machine take up to about that (a bootstrap refit of a few
# repeated points runs all its Huber iterations).
HARD_STOP = 1.25
FIT_RESERVE_S = 1.0
DECODE_TOKENS = 24  # tokens per stream in the decode stage, at first
DECODE_TOKENS_MAX = 96  # a grid point whose streams never all decoded together gets up to this
DECODE_PASSES = 8  # most passes through the decode grid (fewer when the budget runs out)
DECODE_JOIN_SHARE = 0.1  # most of the decode stage one run may spend prefilling its prompts
PREFILL_PASSES = 24  # most passes through the prefill grid
TRANSFER_PASSES = 16  # most passes through the KV-transfer grid
PARTIAL_EVERY = 3  # every this many prefill prompts, one partial prefill after it
MIN_TWINS = 4  # rejected twins needed to fit the request path


@dataclasses.dataclass(frozen=True)
class Stop:
    """When a stage stops: at `soft` once it has the samples a fit needs, at `hard` regardless
    (a pod too slow, or a probe too starved of CPU, to give them in time must not hold the Job;
    the fit then says there are too few)."""

    soft: float
    hard: float
    need: int

    def due(self, have: int) -> bool:
        now = time.perf_counter()
        return now > self.hard or (now > self.soft and have >= self.need)

    async def within(self, work: Awaitable[object], have: int) -> bool:
        """Await one grid point's `work`, cut where the stage ends: at `soft` when the stage
        already has the samples it needs (`have`), else at `hard`. False when it was cut (its
        requests closed), True when it finished. A request's own timeout still raises.

        Cutting at `soft` keeps a stage to its share: a long point in flight there (an 8k-token
        prompt and its partial twin: two seconds on an A40) would take the next stage's time."""
        end = self.soft if have >= self.need else self.hard
        deadline = asyncio.timeout(end - time.perf_counter())
        try:
            async with deadline:
                await work
        except TimeoutError:
            if deadline.expired():
                return False
            raise
        return True


@dataclasses.dataclass(frozen=True)
class Budget:
    """The probe's time budget from `start` (a `time.perf_counter` reading)."""

    start: float
    seconds: float

    @property
    def hard(self) -> float:
        """When measuring stops whatever it has (a `time.perf_counter` reading)."""
        return self.start + max(HARD_STOP * self.seconds - FIT_RESERVE_S, self.seconds)

    def stop(self, share: float, need: int) -> Stop:
        """A stage that ends at `share` of the budget once it has `need` samples."""
        return Stop(self.start + share * self.seconds, self.hard, need)


async def prefill_stage(
    client: Client,
    pod: Pod,
    stop: Stop,
    progress: Progress | None,
    overheads: list[fit.OverheadSample],
    partial: list[fit.PrefillSample] | None = None,
) -> list[fit.PrefillSample]:
    """TTFTs of single requests on the idle pod; appends the rejected twins' times to
    `overheads`. With `partial` and a pod that caches prefixes, every `PARTIAL_EVERY`-th prompt
    of at least two blocks is followed by one sharing its leading half (whole blocks) and new
    after it, whose TTFT goes to `partial` with the cached tokens."""
    top = max(16, min(pod.max_model_len - 8, 8192))  # long prompts pin down the quadratic term
    lengths = sorted({round(16 * (top / 16) ** (i / 9)) for i in range(10)})
    # Two more of the shortest and three of the longest per pass: the fixed cost is read off the
    # first, the quadratic term off the second, where it is a fifth of the TTFT or more. Not in
    # the first pass, which visits each length once: a stage cut short (a short budget, a pod
    # whose long prompts take a second each) then has the whole range for the price of one
    # pass, where three more of the longest would cost it most of its samples.
    extras = lengths[:1] * 2 + lengths[-1:] * 3
    shuffle = random.Random(1)
    plan = []
    for n in range(PREFILL_PASSES):  # each pass shuffled: an early stop keeps the spread
        grid = lengths + (extras if n else [])
        shuffle.shuffle(grid)
        plan += grid
    samples: list[fit.PrefillSample] = []

    async def point(i: int, n: int) -> None:
        prompt = client.prompt(n)
        overhead = await client.rejected(pod, prompt)
        if overhead is not None:
            overheads.append(fit.OverheadSample(n, overhead))
        times = await client.stream(pod, prompt, 1)
        if len(times) >= 2:
            samples.append(fit.PrefillSample(n, times[1] - times[0]))
        cached = (n // 2) // pod.block_size * pod.block_size
        if partial is not None and pod.prefix_caching and cached and i % PARTIAL_EVERY == 0:
            # vLLM cached the prompt's full blocks when it finished: the new prompt finds its
            # first `cached` tokens there and computes only the rest.
            times = await client.stream(pod, prompt[:cached] + client.prompt(n - cached), 1)
            if len(times) >= 2:
                partial.append(fit.PrefillSample(n, times[1] - times[0], cached))

    for i, n in enumerate(plan):
        if stop.due(len(samples)) or not await stop.within(point(i, n), len(samples)):
            break
        if progress:
            progress("prefill", i + 1, len(plan))
    return samples


def interpolated(samples: Sequence[fit.PrefillSample]) -> Callable[[int], float]:
    """Measured TTFT as a function of prompt length: per-length medians, interpolated."""
    by_length: dict[int, list[float]] = {}
    for s in samples:
        by_length.setdefault(s.prompt_tokens, []).append(s.ttft_s)
    if not by_length:
        return lambda n: 0.0  # nothing measured: the fit will say so
    lengths = sorted(by_length)
    medians = [statistics.median(by_length[n]) for n in lengths]
    return lambda n: float(np.interp(n, lengths, medians))


async def decode_stage(
    client: Client,
    pod: Pod,
    cfg: ProbeConfig,
    stop: Stop,
    progress: Progress | None,
    prefill_time: Callable[[int], float],
) -> tuple[list[fit.DecodeSample], int]:
    """(samples, how many of them the server's histogram timed: see below)."""
    batches = [b for b in (1, 2, 4, 8, 16, 32, 64) if b <= cfg.max_num_seqs]
    # Two context lengths far apart separate the per-sequence and per-context-token costs.
    contexts = [c for c in (32, 1536) if c + DECODE_TOKENS_MAX < pod.max_model_len]
    # A run first prefills its B prompts, which at long contexts and large batches costs more
    # than everything else (64 prompts of 1536 tokens: 14 s on an A40). Such a run is left
    # out when that would take more than a tenth of the stage: repeats of the others buy more.
    stage = max(stop.soft - time.perf_counter(), 0.0)
    grid = [
        (b, c)
        for b in batches
        for c in contexts
        if b * (c + DECODE_TOKENS_MAX) <= 0.8 * pod.kv_capacity_tokens  # else it would preempt
        and (b * prefill_time(c) <= DECODE_JOIN_SHARE * stage or (b, c) == (1, contexts[0]))
    ]
    # Through the grid again and again while the budget lasts: step noise averages out.
    plan = grid * DECODE_PASSES
    tokens = dict.fromkeys(grid, DECODE_TOKENS)
    samples: list[fit.DecodeSample] = []
    server_timed = 0

    async def point(b: int, ctx: int) -> None:
        nonlocal server_timed
        n = tokens[b, ctx]
        before = await client.itl_totals(pod)
        runs = await asyncio.gather(*(client.stream(pod, ctx, n) for _ in range(b)))
        # Only the window in which all B streams decode: before the last one joined, steps also
        # carried prefill work; after the first one finished, the batch was smaller. Per stream,
        # elapsed time over tokens in the window: a delivery stall followed by a burst of tokens
        # does not change it, where a per-gap statistic would.
        joined = max(t[1] for t in runs if len(t) > 1)
        leaving = min(t[-1] for t in runs)
        windows = [[x for x in t[1:] if joined <= x <= leaving] for t in runs]
        rates = sorted(
            (inside[-1] - inside[0]) / (len(inside) - 1)
            for t, inside in zip(runs, windows, strict=True)
            if len(inside) >= 4 and read_as_sent(t, inside)
        )
        if rates:
            samples.append(fit.DecodeSample(b, b * (ctx + n / 2), rates[len(rates) // 2]))
        elif max(map(len, windows)) < 4 and any(
            len(t) > 4 and read_as_sent(t, t[1:]) for t in runs
        ):
            # Streams read as sent show that the B never decoded together: the first finished
            # before the last joined. Joining took more steps than a stream has tokens (B long
            # prompts prefilled a token budget per step; an API server admitting B requests one
            # after another on a busy CPU). The run says nothing of a batch of B, and the
            # server's inter-token histogram over it, mostly steps that carried prefill, read
            # several times the decode step on real vLLM on CPU: no sample; the point's next
            # pass streams twice as many tokens.
            tokens[b, ctx] = min(2 * n, DECODE_TOKENS_MAX)
        else:
            # The probe read no stream as sent (a starved client): its clock says nothing of
            # the steps, so the server's own inter-token histogram over the run instead (its
            # join steps, which carried prefill work, make it read a little high; the held-out
            # error says how much that matters).
            after = await client.itl_totals(pod)
            if before and after and after[1] > before[1]:
                itl = (after[0] - before[0]) / (after[1] - before[1])
                samples.append(fit.DecodeSample(b, b * (ctx + n / 2), itl))
                server_timed += 1

    for i, (b, ctx) in enumerate(plan):
        if stop.due(len(samples)) or not await stop.within(point(b, ctx), len(samples)):
            break
        if progress:
            progress("decode", i + 1, len(plan))
    return samples, server_timed


def read_as_sent(stream: Sequence[float], inside: Sequence[float]) -> bool:
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


async def transfer_stage(
    client: Client,
    pod: Pod,
    peer: Pod,
    stop: Stop,
    progress: Progress | None,
    overheads: list[fit.OverheadSample],
) -> list[fit.TransferSample]:
    """Decode-leg TTFTs of prompts prefilled on `peer`; appends the rejected twins' times to
    `overheads`."""
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

    async def point(i: int, n: int) -> None:
        request_id = f"probe-xfer-{i}-{client.rng.getrandbits(32):08x}"
        prompt = client.prompt(n)
        params = await client.prefill_leg(peer, prompt, request_id)
        # The twin carries the same KV coordinates (a larger body, parsed the same way); vLLM
        # rejects it before anything is scheduled, so P's blocks wait for the real decode leg.
        overhead = await client.rejected(pod, prompt, {"kv_transfer_params": params})
        if overhead is not None:
            overheads.append(fit.OverheadSample(n, overhead))
        ttft = await client.decode_leg(pod, prompt, params, request_id)
        if ttft is not None:
            samples.append(fit.TransferSample(n, ttft))

    # A point cut between its legs leaves the peer's blocks leased until the lease expires.
    for i, n in enumerate(plan):
        if stop.due(len(samples)) or not await stop.within(point(i, n), len(samples)):
            break
        if progress:
            progress("transfer", i + 1, len(plan))
    return samples


async def request_path(
    client: Client, pod: Pod, overheads: Sequence[fit.OverheadSample]
) -> RequestPath:
    """The request path's cost from the rejected twins, or, for a server that accepted them,
    a constant from a trivial call."""
    if len(overheads) >= MIN_TWINS:
        base, per_token = fit.fit_overhead(overheads)
        return RequestPath("rejected twin requests", base, per_token, len(overheads))
    base = await client.http_overhead(pod)
    return RequestPath("/tokenize round trip", base, 0.0, len(overheads))


async def measure(
    client: Client,
    pod: Pod,
    peer: Pod | None,
    budget: Budget,
    progress: Progress | None,
) -> Measured:
    """Run every stage on `pod` (and `peer`, if any) within `budget`."""
    overheads: list[fit.OverheadSample] = []
    partial: list[fit.PrefillSample] = []
    pre = await prefill_stage(
        client, pod, budget.stop(PREFILL_SHARE, 8), progress, overheads, partial
    )
    # The KV transfer before the decode stage, whose grid never runs short of work: time the
    # other stages leave over goes to it.
    xfer = (
        await transfer_stage(
            client, pod, peer, budget.stop(PREFILL_SHARE + TRANSFER_SHARE, 6), progress, overheads
        )
        if peer
        else []
    )
    dec, server_timed = await decode_stage(
        client, pod, client.cfg, budget.stop(DECODE_END, 6), progress, interpolated(pre)
    )
    path = await request_path(client, pod, overheads)
    return Measured(pre, xfer, dec, server_timed, path, partial)
