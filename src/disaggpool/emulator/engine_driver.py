"""Runs the engine models (`disaggpool.engine`) on the asyncio clock, for the emulator.

The simulator's event loop and this driver share one contract with the engines: call
``engine.advance(t)`` at ``engine.next_wakeup()``, and after every enqueue ask again. Here the
"event heap" is one `loop.call_at` timer per engine, re-armed after every change. Timers fire a
little late (tens of microseconds on `precise_loop`), so the driver never advances an engine to
the wall clock: it replays every due wake-up at its exact model time, in order, and only then
enqueues at "now". The engine therefore sees the same sequence of calls the simulator would make,
and timing differs from the model only by delivery latency, which `lead` takes out (timers fire
that much early, the engine still acts at the model time).

The decode engine is advanced analytically and wakes only on events; a streaming client needs
every token, so the decode driver also wakes at every step boundary while a batch is running
(one wake-up per step per instance, not per request). Advancing at a boundary where nothing
happens changes nothing but the jitter factor of the next step (the decode engine runs with
`jitter_per_step`, so that step times vary step by step as a GPU's do): admission can only get
harder as contexts grow.

What a live server needs and the simulator does not (the next step boundary, the tokens a
running request has produced, aborting a request whose client went away or whose KV pull failed,
a jitter factor redrawn at every step) is the engines' own public API; the drivers only time it.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import random
from collections.abc import Callable
from typing import Protocol

from disaggpool.core.profile import CalibrationProfile
from disaggpool.engine.decode import DecodeEngine
from disaggpool.engine.prefill import PrefillEngine
from disaggpool.engine.request import EngineRequest, SchedulingPolicy

__all__ = ["DecodeDriver", "DecodeListener", "PrefillDriver", "PrefillListener"]

log = logging.getLogger(__name__)

# Wake-ups replayed in one go before the driver yields to the loop. Far above any real burst (one
# per step boundary, transfer or completion); only an engine bug that stops making progress hits it.
_MAX_REPLAY = 100_000


class PrefillListener(Protocol):
    def on_prefilled(self, t: float) -> None: ...


class DecodeListener(Protocol):
    """Tokens are decode steps' output; a request prefilled here (`submit(local=True)`) also
    gets the token its prefill sampled, as one `on_tokens(1, t)` before the others."""

    def on_tokens(self, n: int, t: float) -> None: ...

    def on_finished(self, t: float) -> None: ...

    def on_transfer_started(self, t: float) -> None: ...

    def on_transferred(self, t: float) -> None: ...


class _Driver:
    """The timer and replay logic shared by both drivers (see the module docstring)."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._handle: asyncio.TimerHandle | None = None
        self._armed_for: float | None = None
        self.time = self._loop.time()  # the last time handed to the engine
        # How much before its model time a wake-up fires, so that the server has handled it by
        # then: the instance learns it from its own delivery (`EmulatorInstance.resumed`).
        self.lead = 0.0

    # subclasses: when the engine next needs attention, and what to do then
    def _next(self) -> float | None:
        raise NotImplementedError

    def _advance(self, t: float) -> None:
        raise NotImplementedError

    def now(self) -> float:
        return max(self._loop.time(), self.time)

    def sync(self, at: float = 0.0) -> float:
        """Replay every wake-up due by now (or `at`), in order; returns the time to act at."""
        now = max(self.now(), at)
        for _ in range(_MAX_REPLAY):
            t = self._next()
            if t is None or t > now:
                break
            self.time = max(self.time, t)
            self._advance(self.time)
        else:
            log.error("engine driver: %d wake-ups at one instant; engine stuck?", _MAX_REPLAY)
        self.time = now
        return now

    def arm(self) -> None:
        """(Re)schedule the timer for the engine's next wake-up."""
        t = self._next()
        if t == self._armed_for:
            return
        if self._handle is not None:
            self._handle.cancel()
        self._handle = None if t is None else self._loop.call_at(t - self.lead, self._fire, t)
        self._armed_for = t

    def _fire(self, t: float) -> None:
        self._handle = None
        self._armed_for = None
        try:
            # Act at the wake-up's model time: `lead` fired it early, the loop maybe late.
            self.sync(t)
        except Exception:  # a bug must not silently stop the clock of every request
            log.exception("engine driver failed")
        finally:
            self.arm()

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._handle = None
        self._armed_for = None


class PrefillDriver(_Driver):
    """Drives one `PrefillEngine`; tells each request's listener when its prefill ends."""

    def __init__(
        self,
        profile: CalibrationProfile,
        *,
        jitter: float,
        rng_seed: int,
        name: str = "prefill",
        prefix_caching: bool = False,
        scheduling: SchedulingPolicy = "fcfs",
        on_kv_events: Callable[[list[tuple[str, EngineRequest | None, list[int]]]], None]
        | None = None,
    ) -> None:
        super().__init__()
        self.engine = PrefillEngine(
            name,
            profile,
            jitter=jitter,
            rng=random.Random(rng_seed),
            prefix_caching=prefix_caching,
            scheduling=scheduling,
            kv_events=on_kv_events is not None,
        )
        self._listeners: dict[int, PrefillListener] = {}
        self._on_kv_events = on_kv_events  # after each step that changed the prefix cache

    def _next(self) -> float | None:
        return self.engine.next_wakeup()

    def _flush_kv_events(self) -> None:
        """Hand what the engine announced since the last flush to the publisher."""
        events = self.engine.kv_events
        if events and self._on_kv_events is not None:
            self._on_kv_events(list(events))
            events.clear()

    def _advance(self, t: float) -> None:
        done = self.engine.advance(t)
        self._flush_kv_events()
        for req in done:
            listener = self._listeners.pop(req.index, None)
            if listener is not None:
                listener.on_prefilled(t)

    def reset_prefix_cache(self) -> bool:
        """The engine's `reset_prefix_cache`, its event published at once."""
        self.sync()
        ok = self.engine.reset_prefix_cache()
        self._flush_kv_events()
        return ok

    def submit(self, req: EngineRequest, listener: PrefillListener) -> bool:
        """Queue a prompt; False if the engine refuses it (longer than it can ever hold)."""
        now = self.sync()
        self.engine.enqueue(req, now)
        if req.rejected:
            self.engine.rejected.clear()  # the emulator answers 400 instead; keep nothing
            return False
        self._listeners[req.index] = listener
        self.arm()
        return True

    def release(self, req: EngineRequest) -> None:
        """The prompt's KV is no longer held (pulled, expired or abandoned)."""
        now = self.sync()
        self.engine.release(req, now)
        self.arm()

    def abort(self, req: EngineRequest) -> bool:
        """Drop a queued prompt; False if it is being prefilled (the listener still hears)."""
        now = self.sync()
        removed = self.engine.abort(req, now)
        if removed:
            self._listeners.pop(req.index, None)
        self.arm()
        return removed


class DecodeDriver(_Driver):
    """Drives one `DecodeEngine` and reports tokens, transfers and completions."""

    def __init__(
        self,
        profile: CalibrationProfile,
        *,
        jitter: float,
        rng_seed: int,
        name: str = "decode",
        scheduling: SchedulingPolicy = "fcfs",
        prefix_caching: bool = False,
        on_preempt: Callable[[int], None] | None = None,
    ) -> None:
        super().__init__()
        self.engine = DecodeEngine(
            name,
            profile,
            jitter=jitter,
            rng=random.Random(rng_seed),
            jitter_per_step=True,
            scheduling=scheduling,
            prefix_caching=prefix_caching,
        )
        self._listeners: dict[int, tuple[EngineRequest, DecodeListener]] = {}
        self._emitted: dict[int, int] = {}
        # Requests prefilled here whose prefill-sampled first token is not out yet; once they
        # join, the time it is due (the end of the prefill part of their first step).
        self._unprefilled: dict[int, EngineRequest] = {}
        self._first_due: list[tuple[float, int]] = []  # heap of (time, index)
        self._preemptions = 0
        self._on_preempt = on_preempt

    def _next(self) -> float | None:
        times = [
            x
            for x in (
                self.engine.next_wakeup(),
                self.engine.next_boundary(),
                self._first_due[0][0] if self._first_due else None,
            )
            if x is not None
        ]
        return min(times) if times else None

    def _advance(self, t: float) -> None:
        engine = self.engine
        finished, transferred, started = engine.advance(t)
        if engine.preemptions != self._preemptions and self._on_preempt is not None:
            self._on_preempt(engine.preemptions - self._preemptions)
        self._preemptions = engine.preemptions
        if self._unprefilled:
            for index, req in list(self._unprefilled.items()):
                if engine.is_running(req):  # joined at this boundary: its prefill is under way
                    del self._unprefilled[index]
                    heapq.heappush(self._first_due, (engine.prefill_end(), index))
        while self._first_due and self._first_due[0][0] <= t:
            due, index = heapq.heappop(self._first_due)
            entry = self._listeners.get(index)
            if entry is not None:
                entry[1].on_tokens(1, due)
        for req in finished:
            entry = self._listeners.pop(req.index, None)
            emitted = self._emitted.pop(req.index, 0)
            if entry is not None:
                if req.output_tokens > emitted:
                    entry[1].on_tokens(req.output_tokens - emitted, t)
                entry[1].on_finished(t)
        for req in engine.running.values():
            entry = self._listeners.get(req.index)
            if entry is None:
                continue
            n = engine.produced(req) - self._emitted.get(req.index, 0)
            if n > 0:
                self._emitted[req.index] = engine.produced(req)
                entry[1].on_tokens(n, t)
        for req in transferred:
            entry = self._listeners.get(req.index)
            if entry is not None:
                entry[1].on_transferred(t)
        self._started(started, t)

    def _started(self, started: list[EngineRequest], t: float) -> None:
        for req in started:
            entry = self._listeners.get(req.index)
            if entry is not None:
                entry[1].on_transfer_started(t)

    def reset_prefix_cache(self) -> bool:
        """The engine's `reset_prefix_cache` (the decode engine publishes no KV events)."""
        self.sync()
        return self.engine.reset_prefix_cache()

    def submit(self, req: EngineRequest, listener: DecodeListener, *, local: bool = False) -> bool:
        """Queue a request whose KV is remote, or with `local` one whose prompt is computed
        here (the engine's recompute path: the prefill is charged to the step it joins).

        A local request's first token comes from its prefill, so `req.output_tokens` counts
        only the tokens of the decode steps after it (the caller passes max_tokens - 1).
        """
        now = self.sync()
        self._listeners[req.index] = (req, listener)
        if local:
            req.recompute = True
            self._unprefilled[req.index] = req
        started = self.engine.enqueue(req, now)
        if req.rejected:
            self.engine.rejected.clear()
            del self._listeners[req.index]
            self._unprefilled.pop(req.index, None)
            return False
        self._started(started, now)
        self.arm()
        return True

    def abort(self, req: EngineRequest) -> None:
        """Stop a request wherever it is; a running one leaves at the next step boundary."""
        if req.index not in self._listeners:
            return
        now = self.sync()
        del self._listeners[req.index]
        self._emitted.pop(req.index, None)
        self._unprefilled.pop(req.index, None)  # a stale `_first_due` entry finds no listener
        _, started = self.engine.abort(req, now)  # a running one leaves at the next boundary
        self._started(started, now)
        self.arm()

    def kv_tokens_used(self) -> int:
        return self.engine.kv_tokens_used(self.now())
