"""Engine model of one vLLM prefill instance: FCFS chunked prefill with a token budget.

Under `scheduling="priority"` (vLLM's `--scheduling-policy priority`) requests wait in order of
their `priority`, then arrival; a prompt whose prefill has begun is never overtaken.

Each iteration takes prompt tokens from the head of the queue up to `max_num_batched_tokens`
(and `max_num_seqs` requests), splitting the last prompt into a chunk when it does not fit, and
lasts ``p0 + p1 * tokens + p2 * sum((offset + chunk)**2 - offset**2)`` seconds: the quadratic
attention term is charged exactly as if each prompt had been prefilled whole. A request's KV
blocks are allocated when its first chunk is scheduled and stay allocated until the decode
instance has pulled them (`release`), so a slow decode pool backs up into prefill, as in vLLM.

With `prefix_caching`, requests that carry prompt block ids (`EngineRequest.blocks`) go through
the instance's `engine.prefix_cache.PrefixCache` when their first chunk is scheduled: the cached
leading blocks are not computed, so prefill starts at offset h (the hit) and costs
``p0 + p1 * (n - h) + p2 * (n**2 - h**2)`` over the iterations it spans: the new tokens' linear
work, and their attention over the whole context, cached part included. Only the tokens that come
into use are allocated; blocks kept only as cache are evicted, least recently released first,
when the capacity is needed. Queries and hits are counted in tokens at admission, as vLLM counts
`vllm:prefix_cache_queries` / `_hits`.

One wake-up per iteration: prefill iterations are long (tens to hundreds of milliseconds), so
this costs little. Used by `sim.cluster` and `emulator.engine_driver` (which also `abort`s the
requests of clients that went away); time is always passed in.
"""

from __future__ import annotations

import random
from collections import deque

from disaggpool.core.profile import CalibrationProfile
from disaggpool.engine.prefix_cache import PrefixCache, cache_for
from disaggpool.engine.request import EngineRequest, SchedulingPolicy, queue_for

__all__ = ["PrefillEngine"]


class PrefillEngine:
    """One prefill instance (module docstring); `jitter`: relative std-dev of iteration time."""

    def __init__(
        self,
        name: str,
        profile: CalibrationProfile,
        *,
        jitter: float = 0.0,
        rng: random.Random | None = None,
        prefix_caching: bool = False,
        kv_events: bool = False,
        scheduling: SchedulingPolicy = "fcfs",
    ) -> None:
        self.name = name
        self.scheduling = scheduling
        self.prefix_caching = prefix_caching
        # With `kv_events`, what vLLM's KV events announce, in order, until the caller drains
        # it: ("stored", request, positions of its blocks stored anew) and ("removed", None,
        # evicted block ids). Off in the simulator, which has nobody to tell.
        self.kv_events: list[tuple[str, EngineRequest | None, list[int]]] | None = (
            [] if kv_events else None
        )
        self.cache: PrefixCache | None = None  # made for the first request that has blocks
        self.prefix_queries = 0  # prompt tokens looked up (admitted requests with blocks)
        self.prefix_hits = 0
        self.profile = profile
        self.capacity = profile.kv_capacity_tokens
        self._jitter = jitter
        self._rng = rng or random.Random(0)
        self.queue: deque[EngineRequest] = deque()
        self._offset: dict[int, int] = {}  # prompt tokens already prefilled, for started requests
        self.kv_used = 0
        self.busy_until: float | None = None
        self._batch: list[
            tuple[EngineRequest, int]
        ] = []  # (request, chunk) of the running iteration
        self.rejected: list[EngineRequest] = []

    @property
    def num_running(self) -> int:
        return len(self._batch)

    @property
    def num_waiting(self) -> int:
        return len(self.queue) - len(self._batch)

    def enqueue(self, req: EngineRequest, now: float) -> None:
        if req.prompt_tokens > self.capacity or req.prompt_tokens > self.profile.max_model_len:
            req.rejected = True
            self.rejected.append(req)
            return
        # Started prompts are the head of the queue and keep their place (vLLM runs a started
        # chunked prefill to its end whatever arrives).
        queue_for(self.queue, req, self.scheduling, start=len(self._offset))
        if self.busy_until is None:
            self._start(now)

    def abort(self, req: EngineRequest, now: float) -> bool:
        """Drop `req` and give back its KV, unless it is in the running iteration: then it
        finishes (its owner `release`s it after) and False is returned. A request that already
        finished, or was never queued, is a no-op (True)."""
        if any(r is req for r, _ in self._batch):
            return False
        try:
            self.queue.remove(req)  # EngineRequest compares by identity
        except ValueError:
            return True
        if self._offset.pop(req.index, None) is not None:
            self._free(req)  # its first chunk had allocated the prompt's KV
        if self.busy_until is None and self.queue:
            self._start(now)
        return True

    def release(self, req: EngineRequest, now: float) -> None:
        """The decode side pulled this request's KV: free its blocks."""
        self._free(req)
        if self.busy_until is None and self.queue:
            self._start(now)

    def _free(self, req: EngineRequest) -> None:
        if self.cache is not None and req.blocks:
            self.kv_used -= self.cache.release(req.blocks, req.prompt_tokens)
        else:
            self.kv_used -= req.prompt_tokens

    def _cache_for(self, req: EngineRequest) -> PrefixCache | None:
        if not (self.prefix_caching and req.blocks):
            return None
        self.cache = cache_for(self.cache, req, self.name)
        return self.cache

    def _admit(self, req: EngineRequest) -> int | None:
        """Allocate the prompt's KV at its first chunk; the offset prefill starts from (its
        cached tokens), or None when the KV does not fit yet."""
        n = req.prompt_tokens
        cache = self._cache_for(req)
        if cache is None:
            if self.kv_used + n > self.capacity:
                return None
            self.kv_used += n
            return 0
        need = cache.need_tokens(req.blocks, n)
        if self.kv_used + need > self.capacity:
            return None
        hit = cache.hit_tokens(req.blocks, n)
        stored = cache.acquire(req.blocks, n)
        self.kv_used += need
        removed = cache.evict_to(self.capacity - self.kv_used)
        if self.kv_events is not None:
            # vLLM hands out the evicted blocks to the new ones: removals come first.
            if removed:
                self.kv_events.append(("removed", None, removed))
            if stored:
                self.kv_events.append(("stored", req, stored))
        self.prefix_queries += n
        self.prefix_hits += hit
        req.cached_tokens = hit
        return hit

    def reset_prefix_cache(self) -> bool:
        """vLLM's `reset_prefix_cache`: fails (False) while any request holds KV blocks here;
        else the cache is emptied and, with `kv_events`, ("cleared", None, []) announced (vLLM's
        `AllBlocksCleared`, sent even when nothing was cached)."""
        if self.kv_used:
            return False
        if self.cache is not None:
            self.cache.clear()
        if self.kv_events is not None:
            self.kv_events.append(("cleared", None, []))
        return True

    def next_wakeup(self) -> float | None:
        return self.busy_until

    def advance(self, now: float) -> list[EngineRequest]:
        """Finish the iteration ending at `now`; returns the requests whose prefill completed."""
        done = []
        if self.busy_until is not None and now >= self.busy_until - max(1e-12, now * 8.9e-16):
            for req, chunk in self._batch:
                offset = self._offset[req.index] + chunk
                if offset >= req.prompt_tokens:
                    del self._offset[req.index]
                    self.queue.popleft()  # completed prompts are always a prefix of the queue
                    req.prefill_done = now
                    done.append(req)
                else:
                    self._offset[req.index] = offset
            self._batch = []
            self.busy_until = None
        if self.busy_until is None and self.queue:
            self._start(now)
        return done

    def _start(self, now: float) -> None:
        budget = self.profile.max_num_batched_tokens
        seqs = self.profile.max_num_seqs
        tokens = 0
        sq = 0.0
        batch: list[tuple[EngineRequest, int]] = []
        for req in self.queue:
            if budget <= 0 or len(batch) >= seqs:
                break
            offset = self._offset.get(req.index)
            if offset is None:  # first chunk: allocate the prompt's KV blocks
                offset = self._admit(req)
                if offset is None:
                    break  # FCFS: wait for the decode side to pull earlier prompts
                self._offset[req.index] = offset
            chunk = min(budget, req.prompt_tokens - offset)
            batch.append((req, chunk))
            budget -= chunk
            tokens += chunk
            sq += (offset + chunk) ** 2 - offset**2
        if not batch:
            return
        g = max(0.5, min(1.5, self._rng.gauss(1.0, self._jitter))) if self._jitter else 1.0
        self._batch = batch
        self.busy_until = now + g * self.profile.prefill.time(tokens, sq)
