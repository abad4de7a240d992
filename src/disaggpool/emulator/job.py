"""A request's life inside an emulated instance: its state, its engine listener, its events.

`EmulatorInstance.submit` creates a `Job` per validated request. The engine drivers call its
`on_*` listener methods as the engine model prefills, transfers and decodes it; a decode leg's
tokens are held back (`gate_open`) until its KV read from the prefill side has succeeded, then
released in order (`open_gate`). `server` iterates `events()` (`Tokens`, then `Done` or
`Failed`) and calls `cancel()` when the client goes away.

What a job cannot do alone (sample and account tokens, lend KV, free engine state) it asks of
its owner through `JobHost`, the small public interface `EmulatorInstance` implements.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal, Protocol

from disaggpool.emulator.requests import GenerationRequest
from disaggpool.engine.request import EngineRequest

__all__ = ["Done", "Event", "Failed", "Job", "JobHost", "Tokens"]

_POLL = 0.1  # seconds between checks that a client is still connected


@dataclasses.dataclass(frozen=True, slots=True)
class Tokens:
    """New output tokens, produced at model time `t` (loop clock)."""

    ids: list[int]
    t: float


@dataclasses.dataclass(frozen=True, slots=True)
class Done:
    finish_reason: str
    t: float
    kv_transfer_params: dict[str, Any] | None


@dataclasses.dataclass(frozen=True, slots=True)
class Failed:
    status: int
    message: str


Event = Tokens | Done | Failed


class JobHost(Protocol):
    """What a `Job` asks of the instance that owns it (`EmulatorInstance`)."""

    def prefilled(self, job: Job, t: float) -> None:
        """The job's prompt was prefilled on the prefill engine at `t`."""

    def emit_tokens(self, job: Job, n: int, t: float) -> None:
        """Sample and account `n` output tokens produced at `t`, and push them to the job."""

    def finish(
        self, job: Job, t: float, reason: str, kv_transfer_params: dict[str, Any] | None
    ) -> None:
        """End the job successfully at `t`."""

    def transfer_started(self, job: Job, t: float) -> None:
        """The decode engine started the job's modelled KV transfer at `t`."""

    def resumed(self, t: float) -> None:
        """A request's handler has just taken up its event of model time `t`."""

    def cancel(self, job: Job) -> None:
        """The client is gone: stop the job wherever it is and give back its KV."""


class Job:
    """One request inside the instance (see the module docstring)."""

    def __init__(
        self,
        host: JobHost,
        spec: GenerationRequest,
        request_id: str,
        internal_id: str,
        req: EngineRequest,
        seed: int,
    ) -> None:
        self.host = host
        self.spec = spec
        self.request_id = request_id  # the response id: cmpl-<id> / chatcmpl-<id>
        self.internal_id = internal_id  # with vLLM's random suffix; P advertises it
        self.req = req
        self.rng = random.Random(seed)
        self._events: deque[Event] = deque()
        self._waiter: asyncio.Future[None] | None = None  # the consumer, while it waits
        self.done = False
        self.generated = 0
        self.last_token_t = -1.0
        self.first_token_t = -1.0
        # Decode legs: tokens wait behind the KV read (`gate`); the pull's progress is tracked.
        self.gate_open = spec.kind != "decode"
        self.deferred: list[tuple[Literal["tokens", "finished"], int, float]] = []
        self.state = "queued"  # queued -> transferring -> transferred (decode legs)
        self.transfer_started = -1.0
        self.transferred = asyncio.Event()
        self.notified = False
        self.pull: asyncio.Task[None] | None = None
        self.on_prefill_engine = False  # prefill legs and one-token plain requests
        self.held_by_read = False  # a late KV read, not the engine, timed its first tokens
        self.prefill_cancelled = False

    @property
    def prompt_tokens(self) -> int:
        return self.req.prompt_tokens

    @property
    def output_tokens(self) -> int:
        """Tokens this request answers (the engine's `output_tokens` may exclude the first)."""
        return 1 if self.spec.kind == "prefill" else self.spec.max_tokens

    # ---------------------------------------------------------------- listener (engine drivers)
    def on_prefilled(self, t: float) -> None:
        self.host.prefilled(self, t)

    def on_tokens(self, n: int, t: float) -> None:
        if not self.gate_open:
            self.deferred.append(("tokens", n, t))
            return
        self.host.emit_tokens(self, n, t)

    def on_finished(self, t: float) -> None:
        if not self.gate_open:
            self.deferred.append(("finished", 0, t))
            return
        self.host.finish(self, t, "length", None)

    def on_transfer_started(self, t: float) -> None:
        self.host.transfer_started(self, t)

    def on_transferred(self, t: float) -> None:
        self.state = "transferred"
        self.transferred.set()

    # ---------------------------------------------------------------- consumer (server)
    def push(self, ev: Event) -> None:
        self._events.append(ev)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def events(self, gone: Callable[[], bool] | None = None) -> AsyncIterator[Event]:
        """The request's events until `Done` or `Failed`.

        `gone` is polled every 0.1 s; when it says the client has left,
        the request is cancelled and the iteration ends, as vLLM aborts on disconnect.
        The consumer awaits a bare future that `push` resolves: it resumes on the very next loop
        iteration (a queue getter behind `asyncio.wait` took several, each a ~30 us system call,
        all of it added to the token's delivery time).
        """
        loop = asyncio.get_running_loop()
        next_poll = loop.time() + _POLL
        while True:
            woke = False
            while not self._events:
                if gone is not None and loop.time() >= next_poll:
                    next_poll = loop.time() + _POLL
                    if gone():
                        self.cancel()
                        return
                waiter = self._waiter = loop.create_future()
                timer = None if gone is None else loop.call_at(next_poll, _resolve, waiter)
                try:
                    await waiter
                    woke = True
                finally:
                    self._waiter = None
                    if timer is not None:
                        timer.cancel()
            ev = self._events.popleft()
            if woke and not isinstance(ev, Failed) and not self.held_by_read:
                self.host.resumed(ev.t)
            yield ev
            if not isinstance(ev, Tokens):
                return

    def cancel(self) -> None:
        self.host.cancel(self)

    def open_gate(self) -> None:
        """The KV read succeeded: release the tokens (and the finish) the engine produced."""
        self.gate_open = True
        self.held_by_read = bool(self.deferred)
        deferred, self.deferred = self.deferred, []
        for what, n, t in deferred:
            if what == "tokens":
                self.host.emit_tokens(self, n, t)
            else:
                self.host.finish(self, t, "length", None)


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
