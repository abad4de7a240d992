"""Engine model of one vLLM decode instance: continuous batching advanced analytically.

Requests arrive with their KV cache still on a prefill instance. They wait FCFS for a sequence
slot (`max_num_seqs`) and KV blocks for their prompt, then pull the KV (NIXL transfer time from
the profile), then join the running batch at the next step boundary. Every step produces one token
per running sequence and takes ``d0 + d1 * B + d2 * K`` seconds (B sequences, K context tokens).
When the next step's tokens would not fit in the KV capacity, the most recently admitted sequence
is preempted and later recomputed (its prompt plus generated tokens prefilled on this instance),
as vLLM's v1 scheduler does. Under `scheduling="priority"` (vLLM's `--scheduling-policy
priority`) waiting requests are ordered by `priority`, then arrival, and the victim is the most
recently admitted of the highest priority value. A prompt computed here (a recompute, or the P/D
decider's local path) is prefilled in the step it joins, within vLLM's per-step token budget
(`max_num_batched_tokens`, one token per running sequence first): a burst of such prompts joins
over several steps (`_joining_now`).

Why analytic: between two changes of the batch, B is constant and K grows by B per step, so the
time of m steps from step S is ``m * alpha + beta * (m * S + m * (m - 1) / 2)`` with
``alpha = d0 + d1 * B + d2 * A`` and ``beta = d2 * B`` (A is sum of join contexts minus join
steps). The engine therefore wakes only when something happens (a completion, a preemption, a
join, a transfer finishing), never once per token, and keeps O(1) aggregates so that a snapshot
costs O(1). Its users (`sim.cluster`, `emulator.engine_driver`) call `enqueue`, `advance` and
`next_wakeup`; it reads no clock: time is always passed in.

A live server (the emulator) needs a little more, all of it here so that no caller reaches into
the bookkeeping: `abort` (a client gone, a KV pull failed; a running sequence cannot leave
mid-step, since the step's time depends on the batch, so it leaves at the next boundary, as an
abort reaches vLLM's scheduler between two steps), `next_boundary` and `produced` (a streaming
client needs every token, not only the events), `prefill_end` (the first token of a prompt
computed here is sampled by its prefill pass) and `jitter_per_step` (redraw the jitter factor
at every boundary instead of once per batch change).

With `prefix_caching`, requests that carry prompt block ids look up the instance's own prefix
cache (`engine.prefix_cache.PrefixCache`, vLLM's rules) each time they are admitted, as vLLM's
scheduler does for every waiting request: a request whose KV is remote pulls only the part not
found here (vLLM's NIXL connector asks for prompt - local hit tokens), and a prompt computed here
(the local path, a preempted sequence's recompute) computes only the uncached part, at the cost
the prefill engine charges a partial prefill. A request's prompt blocks stay cached after it
leaves, evicted least recently released first. KV use is still counted per sequence (a block
two running sequences share is counted twice, where vLLM holds it once), so the room left for
cached blocks is, if anything, smaller than vLLM's; it is trimmed at every admission and at every
boundary where sequences finish or are preempted, where use peaks.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque

from disaggpool.core.profile import CalibrationProfile
from disaggpool.engine.prefix_cache import PrefixCache, cache_for
from disaggpool.engine.request import (
    EngineRequest,
    SchedulingPolicy,
    queue_for,
    requeue_preempted,
)

__all__ = ["DecodeEngine"]

_EPS = 1e-12


def _tolerance(t: float) -> float:
    """Slack for comparing times near `t`: 1e-12 s, or a few ulps of t when that is larger.

    A fixed 1e-12 vanishes next to clock values above ~2**13 s (the emulator runs on the
    host's monotonic clock, i.e. its uptime): t - t_step then loses the last step to rounding,
    `next_wakeup` returns a time `advance` does not act on, and the engine never progresses.
    """
    return max(_EPS, abs(t) * 8.9e-16)


class DecodeEngine:
    """One decode instance (see module docstring). `jitter` is the relative std-dev of step time."""

    def __init__(
        self,
        name: str,
        profile: CalibrationProfile,
        *,
        jitter: float = 0.0,
        rng: random.Random | None = None,
        jitter_per_step: bool = False,
        scheduling: SchedulingPolicy = "fcfs",
        prefix_caching: bool = False,
    ) -> None:
        """`jitter_per_step` redraws the jitter factor at every step boundary, and so wakes at
        every one; the default draws once per batch change, which keeps the simulator's analytic
        chunks whole. A live server wakes at every boundary anyway (streaming clients need each
        token) and redraws, so that step times vary step by step as a GPU's do and a client
        timing many steps sees the profile's mean rather than one draw held for the batch."""
        self.name = name
        self.scheduling = scheduling
        self.profile = profile
        self._d0, self._d1, self._d2 = profile.decode.d0, profile.decode.d1, profile.decode.d2
        self.capacity = profile.kv_capacity_tokens
        self.max_seqs = profile.max_num_seqs
        self._jitter = jitter
        self._rng = rng or random.Random(0)
        self.step = 0  # S: index of the last step boundary the batch was synced to
        self.t_step = 0.0  # time of boundary S
        self.batch = 0  # B
        self._a = 0  # sum over running of (context at join - join step): K(S) = A + B * S
        self._gen_base = 0  # sum over running of (join step - tokens generated before joining)
        self.running_prompt_tokens = 0  # sum of prompt lengths of the running sequences
        self._extra = (
            0.0  # one-off time added to the step after S (recompute of rejoining requests)
        )
        self._g = 1.0  # jitter factor of the current chunk
        self.jitter_per_step = jitter_per_step
        self._jitter_step = -1  # the boundary whose steps' jitter factor was last drawn
        self.running: dict[int, EngineRequest] = {}  # admission order: the last one is the victim
        self._finish: list[tuple[int, int, EngineRequest]] = []  # (finish step, index, request)
        self.waiting: deque[EngineRequest] = deque()
        self._transfers: list[tuple[float, int, EngineRequest]] = []  # (done time, index, request)
        self._ready: list[tuple[float, EngineRequest]] = []  # KV here, joining at the next boundary
        self._reserved = 0  # KV tokens held by transferring and ready requests
        # Aborted running sequences (`abort`): index -> (request, the boundary where it leaves).
        self._leaving: dict[int, tuple[EngineRequest, int]] = {}
        self.preemptions = 0
        self.rejected: list[EngineRequest] = []
        self.prefix_caching = prefix_caching
        self.cache: PrefixCache | None = None  # made for the first request that has blocks
        self._holding: dict[int, EngineRequest] = {}  # admitted requests whose blocks it holds
        self.prefix_queries = 0  # prompt tokens looked up (admissions of requests with blocks)
        self.prefix_hits = 0

    # ------------------------------------------------------------------ timing of the batch
    def _steps_time(self, m: int) -> float:
        """Seconds from boundary S to boundary S + m for the current batch (m >= 1)."""
        b = self.batch
        alpha = self._d0 + self._d1 * b + self._d2 * self._a
        beta = self._d2 * b
        return self._extra + self._g * (m * alpha + beta * (m * self.step + m * (m - 1) * 0.5))

    def _steps_done_by(self, t: float) -> int:
        """Number of whole steps after S completed by time t (closed form, then exact fix-up)."""
        b = self.batch
        if b == 0:
            return 0
        g = self._g
        extra = self._extra
        elapsed = t - self.t_step + _tolerance(t)
        r = (elapsed - extra) / g
        if r <= 0:
            return 0
        alpha = self._d0 + self._d1 * b + self._d2 * self._a
        beta = self._d2 * b
        s0 = self.step
        c = alpha + beta * (s0 - 0.5)
        m = int(r / c) if beta == 0 else int((-c + math.sqrt(c * c + 2.0 * beta * r)) / beta)

        def span(k: int) -> float:  # _steps_time(k), inlined for the hot path
            return extra + g * (k * alpha + beta * (k * s0 + k * (k - 1) * 0.5))

        while span(m + 1) <= elapsed:
            m += 1
        while m > 0 and span(m) > elapsed:
            m -= 1
        return m

    def _kv_context(self, step: int) -> int:
        return self._a + self.batch * step

    # ------------------------------------------------------------------ observation (O(1))
    def kv_tokens_used(self, now: float) -> int:
        return self._kv_context(self.step + self._steps_done_by(now)) + self._reserved

    def observe(self, now: float) -> tuple[int, int]:
        """(KV tokens in use, output tokens produced by the running sequences) at `now`."""
        step = self.step + self._steps_done_by(now)
        return self._a + self.batch * step + self._reserved, self.batch * step - self._gen_base

    @property
    def num_running(self) -> int:
        return self.batch

    @property
    def num_waiting(self) -> int:
        """vLLM counts requests waiting for remote KV as waiting."""
        return len(self.waiting) + len(self._transfers) + len(self._ready)

    @property
    def num_deferred(self) -> int:
        """Of `num_waiting`, those whose KV is on its way or here (their blocks reserved)."""
        return len(self._transfers) + len(self._ready)

    @property
    def idle(self) -> bool:
        return not (self.batch or self.waiting or self._transfers or self._ready)

    def is_running(self, req: EngineRequest) -> bool:
        """Whether `req` is in the running batch (an aborted one is until the next boundary)."""
        return self.running.get(req.index) is req

    def produced(self, req: EngineRequest) -> int:
        """Output tokens `req` has produced by boundary `step` (it must be running)."""
        return req.generated + self.step - req.join_step

    def produced_by(self, now: float) -> list[tuple[EngineRequest, int]]:
        """Each running sequence with the output tokens it has produced by `now`: what a client
        streaming it has received (the simulator reports it to the router's ledger)."""
        step = self.step + self._steps_done_by(now)
        return [(req, req.generated + step - req.join_step) for req in self.running.values()]

    def next_boundary(self) -> float | None:
        """When the step in progress ends (None with no running batch)."""
        return self.t_step + self._steps_time(1) if self.batch else None

    def prefill_end(self) -> float:
        """When the prefill part of the step after boundary `step` ends: the requests that
        joined there with their prompt computed here (recompute) have their prefill done then."""
        return self.t_step + self._extra

    # ------------------------------------------------------------------ inputs
    def enqueue(
        self, req: EngineRequest, now: float, *, prefill_here: bool = False
    ) -> list[EngineRequest]:
        """A request arrives; returns the KV transfers started.

        Its prompt was prefilled elsewhere and its KV is pulled once it is admitted, or, with
        `prefill_here` (the P/D decider's local path), this instance prefills it in the step it
        joins, exactly as it recomputes a preempted sequence. A prompt that can never fit in this
        instance's KV cache is rejected (vLLM answers 400).
        """
        if req.prompt_tokens + 1 > self.capacity:
            req.rejected = True
            self.rejected.append(req)
            return []
        if prefill_here:
            req.recompute = True
        queue_for(self.waiting, req, self.scheduling)
        return self._admit(now)

    def abort(self, req: EngineRequest, now: float) -> tuple[bool, list[EngineRequest]]:
        """Stop `req` wherever it is; returns (gone now, transfers started by the room it left).

        A waiting, transferring or ready request leaves at once and gives back its KV. A running
        sequence cannot leave mid-step (the step time depends on the batch): it stays until the
        first step boundary after `now`, which `next_wakeup` then returns, leaves there without
        being reported finished, and (False, []) is returned now. A finished or unknown request:
        (True, []). Like `enqueue`, call it with no wake-up before `now` left unprocessed.
        """
        if self.is_running(req):
            if req.index not in self._leaving:
                self._leaving[req.index] = (req, self.step + self._steps_done_by(now) + 1)
            return False, []
        ctx = req.prompt_tokens + req.generated
        for i, r in enumerate(self.waiting):
            if r is req:
                del self.waiting[i]
                return True, self._admit(now)
        for i, (_, _, r) in enumerate(self._transfers):
            if r is req:
                self._transfers.pop(i)
                heapq.heapify(self._transfers)
                self._reserved -= ctx
                self._let_go(req)
                return True, self._admit(now)
        for i, (_, r) in enumerate(self._ready):
            if r is req:
                self._ready.pop(i)
                self._reserved -= ctx
                self._let_go(req)
                return True, self._admit(now)
        return True, []

    def _admit(self, now: float) -> list[EngineRequest]:
        if not self.waiting:
            return []
        started = []
        used = self.kv_tokens_used(now)
        while self.waiting:
            req = self.waiting[0]
            ctx = req.prompt_tokens + req.generated
            occupied = self.batch + len(self._transfers) + len(self._ready)
            # Room for the prompt and for one more step of every sequence, or admitting it would
            # force a preemption at the very next step.
            if occupied >= self.max_seqs or used + ctx + occupied + 1 > self.capacity:
                break
            self.waiting.popleft()
            used += ctx
            self._reserved += ctx
            hit = self._look_up(req, used)
            if req.recompute:
                self._ready.append((now, req))  # KV is recomputed here: no transfer
            else:
                done = now + self.profile.kv_transfer.time(req.prompt_tokens - hit)
                heapq.heappush(self._transfers, (done, req.index, req))
                started.append(req)
        return started

    # ------------------------------------------------------------------ the prefix cache
    def _look_up(self, req: EngineRequest, used: int) -> int:
        """Admit `req`'s prompt blocks to the cache (`used`: KV in use with it admitted);
        returns the prompt tokens found cached, also kept as `req.decode_cached_tokens`."""
        if not (self.prefix_caching and req.blocks):
            return 0
        cache = self.cache = cache_for(self.cache, req, self.name)
        n = req.prompt_tokens
        hit = cache.hit_tokens(req.blocks, n)
        cache.acquire(req.blocks, n)
        cache.evict_to(self.capacity - used)
        self._holding[req.index] = req
        self.prefix_queries += n
        self.prefix_hits += hit
        req.decode_cached_tokens = hit
        return hit

    def _let_go(self, req: EngineRequest) -> None:
        """`req` gave its KV back: its prompt blocks stay cached, no longer in use."""
        if self._holding.pop(req.index, None) is not None:
            assert self.cache is not None
            self.cache.release(req.blocks, req.prompt_tokens)

    def _trim_cache(self) -> None:
        """Evict cached blocks that no longer fit beside the KV in use at boundary S."""
        if self.cache is not None:
            self.cache.evict_to(self.capacity - self._kv_context(self.step) - self._reserved)

    def reset_prefix_cache(self) -> bool:
        """vLLM's `reset_prefix_cache`: False (nothing changes) while a request holds blocks."""
        return self.cache is None or self.cache.clear()

    # ------------------------------------------------------------------ the event step
    def next_wakeup(self) -> float | None:
        """When `advance` must next be called, or None when nothing is pending."""
        t = math.inf
        if self._transfers:
            t = self._transfers[0][0]
        if self.batch == 0:
            if self._ready:
                t = min(t, min(r for r, _ in self._ready))
            return None if t == math.inf else t
        finish = self._finish
        while finish and (
            self.running.get(finish[0][2].index) is not finish[0][2]
            or finish[0][2].finish_step != finish[0][0]
        ):
            heapq.heappop(finish)  # stale entries of preempted requests
        m = finish[0][0] - self.step
        free = self.capacity - self._reserved - self._a - self.batch
        m = min(m, free // self.batch - self.step + 1)  # first boundary where a step would not fit
        if self._ready:
            m = min(m, self._steps_done_by(min(r for r, _ in self._ready)) + 1)
        if self._leaving:
            m = min(m, min(step for _, step in self._leaving.values()) - self.step)
        if self.jitter_per_step:
            m = min(m, 1)  # its jitter factor is redrawn at every boundary
        m = max(m, 0)
        return min(t, self.t_step + (self._steps_time(m) if m else 0.0))

    def advance(
        self, now: float
    ) -> tuple[list[EngineRequest], list[EngineRequest], list[EngineRequest]]:
        """Bring the engine to time `now`.

        Returns (finished requests, requests whose KV transfer completed, transfers started).
        The caller releases the prefill KV of the second list and must call `next_wakeup` again.
        """
        finished: list[EngineRequest] = []
        transferred: list[EngineRequest] = []
        if self.batch:
            m = self._steps_done_by(now)
            if m:
                self.t_step += self._steps_time(m)
                self.step += m
                self._extra = 0.0
                self._trim_cache()  # before anything leaves: use peaks here
                if self._leaving:
                    self._drop_leaving()
                while self._finish and self._finish[0][0] <= self.step:
                    step, _, req = heapq.heappop(self._finish)
                    if self.running.get(req.index) is not req or req.finish_step != step:
                        continue  # stale entry of a preempted request
                    del self.running[req.index]
                    req.finish = self.t_step
                    self._remove(req)
                    self._let_go(req)
                    finished.append(req)
        if self.batch == 0:
            self.t_step = now
        at_boundary = abs(now - self.t_step) <= 1e-9
        while self._transfers and self._transfers[0][0] <= now + _tolerance(now):
            done, _, req = heapq.heappop(self._transfers)
            self._ready.append((done, req))
            transferred.append(req)
        if at_boundary:
            # As in vLLM, a step that had to preempt admits nothing new.
            preempted = self._preempt_until_fits()
            started = [] if preempted and self.batch else self._admit(now)
            self._join_ready(now)
        else:
            started = self._admit(now)
        if self.jitter_per_step and at_boundary and self.step != self._jitter_step:
            self._jitter_step = self.step
            if self._jitter and self.batch:
                self._g = max(0.5, min(1.5, self._rng.gauss(1.0, self._jitter)))
        return finished, transferred, started

    # ------------------------------------------------------------ batch changes (at boundaries)
    def _remove(self, req: EngineRequest) -> None:
        self.batch -= 1
        self._a -= req.prompt_tokens + req.generated - req.join_step
        self._gen_base -= req.join_step - req.generated
        self.running_prompt_tokens -= req.prompt_tokens

    def _drop_leaving(self) -> None:
        """Remove the aborted sequences due to leave by boundary S (their finish entries go
        stale, so they are never reported finished)."""
        for index, (req, step) in list(self._leaving.items()):
            if step <= self.step:
                del self._leaving[index]
                if self.running.get(index) is req:
                    del self.running[index]
                    self._remove(req)
                    self._let_go(req)

    def _preempt_until_fits(self) -> bool:
        """Preempt the newest sequences until the next step fits; True if any was preempted."""
        preempted = False
        while (
            self.batch and self._kv_context(self.step) + self.batch + self._reserved > self.capacity
        ):
            if self.scheduling == "fcfs":
                idx = next(reversed(self.running))
            else:  # the newest of the highest priority value (vLLM: max of priority, arrival)
                idx = max(reversed(self.running), key=lambda i: self.running[i].priority)
            victim = self.running.pop(idx)
            self._remove(victim)
            self._let_go(victim)
            if self._leaving.pop(idx, None) is not None:
                continue  # aborted anyway: its KV is freed, nothing to recompute
            victim.generated += self.step - victim.join_step
            victim.recompute = True
            victim.preemptions += 1
            self.preemptions += 1
            requeue_preempted(self.waiting, victim, self.scheduling)
            preempted = True
        return preempted

    def _joining_now(
        self, ready: list[tuple[float, EngineRequest]]
    ) -> tuple[list[EngineRequest], list[tuple[float, EngineRequest]]]:
        """Split the ready requests into those joining at this boundary and those left for a
        later one, by vLLM's token budget.

        vLLM schedules at most `max_num_batched_tokens` tokens per step: one per running
        sequence first, then the waiting requests in order, one token for a request whose KV
        was pulled and the uncached prompt for one prefilled here. A burst of prompts computed
        here is therefore spread over several steps, the first ones decoding while the later
        ones prefill. vLLM chunks the prompt that overflows the budget; here it waits whole
        for the next step, with everything behind it (FCFS). The first prompt of a step always
        joins, however long: it is prefilled in chunks (`partial_time`).
        """
        budget = self.profile.max_num_batched_tokens - self.batch
        prompt_joined = False
        for i, (_, req) in enumerate(ready):
            if not req.recompute:
                budget -= 1
                continue
            new = req.prompt_tokens + req.generated - req.decode_cached_tokens
            if prompt_joined and new > budget:
                return [r for _, r in ready[:i]], ready[i:]
            budget -= new
            prompt_joined = True
        return [r for _, r in ready], []

    def _join_ready(self, now: float) -> None:
        if not self._ready:
            return
        if self.batch == 0:
            self.t_step = now
        joining, self._ready = self._joining_now(self._ready)
        joined = []
        for req in joining:
            ctx = req.prompt_tokens + req.generated
            self._reserved -= ctx
            if req.recompute:  # the tokens not found in the cache, as a partial prefill
                h = req.decode_cached_tokens  # found at this admission
                mbt = self.profile.max_num_batched_tokens
                self._extra += self.profile.prefill.partial_time(ctx, h, mbt)
                req.recompute = False
            req.join_step = self.step
            req.finish_step = self.step + req.output_tokens - req.generated
            self.running[req.index] = req
            heapq.heappush(self._finish, (req.finish_step, req.index, req))
            self.batch += 1
            self._a += ctx - self.step
            self._gen_base += self.step - req.generated
            self.running_prompt_tokens += req.prompt_tokens
            joined.append(req)
        if self._jitter:
            self._g = max(0.5, min(1.5, self._rng.gauss(1.0, self._jitter)))
        first = self.t_step + self._steps_time(1)
        for req in joined:
            if req.first_token < 0:
                req.first_token = first
