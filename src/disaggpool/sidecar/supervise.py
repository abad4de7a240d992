"""Supervised background loops: one failure is logged and counted, never the end of a loop.

Every background task of the sidecar (scrapes, Kubernetes watches, profile reloads, KV-event
subscribers, the pool writer, the health publisher, in-flight expiry) runs under one `Supervisor`:

* `periodic(name, step, period_s)`: `step` every `period_s`. An exception in one step is logged
  (once per distinct message, so a pod that keeps failing does not flood the log), counted in
  `disaggpool_loop_errors_total{loop}`, and the next step waits a growing backoff (doubling up to
  `MAX_BACKOFF_S`) until a step succeeds again;
* `task(name, run)`: a long-running coroutine (a watch, a subscriber) that should never return.
  If it raises or returns it is counted as an error and started again after the backoff
  (`disaggpool_loop_restarts_total{loop}`).

A name may carry an instance after a slash (``kv_events/prefill-0``): the metrics' `loop` label is
the part before it, so per-pod tasks do not make a series per pod; `cancel(name)` ends one.

`/livez` reads `alive`: true while every loop runs or waits to be restarted. A loop is `dead`
when its supervising task itself ended (cancelled from outside, or a `BaseException` such as
`MemoryError` escaped), or when it failed `GIVE_UP_AFTER` times in a row without one success:
then the process is better restarted by the kubelet than kept limping, which is the one thing a
liveness probe is for. A pool without healthy pods is not a liveness matter (`/readyz` says it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Literal

from prometheus_client import Counter

__all__ = ["GIVE_UP_AFTER", "MAX_BACKOFF_S", "LoopState", "Supervisor"]

log = logging.getLogger("disaggpool.sidecar")

MAX_BACKOFF_S = 30.0
GIVE_UP_AFTER = 20  # consecutive failures (minutes of backoff) before /livez asks for a restart
HEALTHY_RUN_S = 60.0  # a long-running task that ran this long before failing had recovered

LoopState = Literal["running", "restarting", "dead"]


@dataclasses.dataclass
class _Loop:
    name: str
    task: asyncio.Task[None] | None = None
    failures: int = 0  # consecutive, reset by a success
    backing_off: bool = False
    last_error: str = ""


class Supervisor:
    """Starts, watches and stops the named loops of one process (module docstring)."""

    def __init__(self, errors: Counter, restarts: Counter) -> None:
        self._errors = errors
        self._restarts = restarts
        self._loops: dict[str, _Loop] = {}

    # ------------------------------------------------------------------ starting
    def periodic(
        self,
        name: str,
        step: Callable[[], Awaitable[object]],
        period_s: float | Callable[[], float],
    ) -> None:
        """Run `step` every `period_s` (a number, or a function read before each wait)."""
        period = period_s if callable(period_s) else (lambda: float(period_s))

        async def run(loop: _Loop) -> None:
            while True:
                started = asyncio.get_running_loop().time()
                try:
                    await step()
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    self._failed(loop, exc)
                else:
                    self._succeeded(loop)
                elapsed = asyncio.get_running_loop().time() - started
                await asyncio.sleep(max(0.0, self._delay(loop, period()) - elapsed))

        self._start(name, run)

    def task(self, name: str, run_once: Callable[[], Awaitable[object]]) -> None:
        """Run `run_once` and start it again whenever it raises or returns."""

        async def run(loop: _Loop) -> None:
            while True:
                started = asyncio.get_running_loop().time()
                try:
                    await run_once()
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    self._failed(loop, exc)
                else:
                    self._failed(loop, RuntimeError("returned, and it should run until stopped"))
                if asyncio.get_running_loop().time() - started > HEALTHY_RUN_S:
                    loop.failures = 1  # it ran well for a while: this failure starts a new series
                self._restarts.labels(_label(name)).inc()
                await asyncio.sleep(self._delay(loop, 1.0))
                loop.backing_off = False

        self._start(name, run)

    def _start(self, name: str, run: Callable[[_Loop], Coroutine[Any, Any, None]]) -> None:
        if name in self._loops:
            raise ValueError(f"loop {name!r} is already supervised")
        loop = _Loop(name)
        loop.task = asyncio.get_running_loop().create_task(run(loop), name=f"disaggpool:{name}")
        self._loops[name] = loop

    # ------------------------------------------------------------------ bookkeeping
    def _failed(self, loop: _Loop, exc: BaseException) -> None:
        loop.failures += 1
        loop.backing_off = True
        self._errors.labels(_label(loop.name)).inc()
        message = f"{type(exc).__name__}: {exc}"
        if message != loop.last_error:  # the same error again is counted, not logged again
            loop.last_error = message
            log.error("loop %s failed (%d in a row): %s", loop.name, loop.failures, message,
                      exc_info=exc)  # fmt: skip
        if loop.failures == GIVE_UP_AFTER:
            log.critical("loop %s failed %d times in a row: /livez now fails", loop.name,
                         loop.failures)  # fmt: skip

    @staticmethod
    def _succeeded(loop: _Loop) -> None:
        if loop.failures:
            log.info("loop %s recovered after %d failures", loop.name, loop.failures)
        loop.failures, loop.backing_off, loop.last_error = 0, False, ""

    @staticmethod
    def _delay(loop: _Loop, period: float) -> float:
        if not loop.failures:
            return period
        return min(MAX_BACKOFF_S, max(period, 0.5) * 2.0 ** min(loop.failures - 1, 16))

    # ------------------------------------------------------------------ reading and stopping
    def states(self) -> dict[str, LoopState]:
        """Each loop's state, by name."""
        return {name: self._state(loop) for name, loop in sorted(self._loops.items())}

    @staticmethod
    def _state(loop: _Loop) -> LoopState:
        if loop.task is None or loop.task.done() or loop.failures >= GIVE_UP_AFTER:
            return "dead"
        return "restarting" if loop.backing_off else "running"

    @property
    def alive(self) -> bool:
        """What `/livez` answers: no loop is dead."""
        return all(self._state(loop) != "dead" for loop in self._loops.values())

    async def cancel(self, name: str) -> None:
        """Stop one loop and forget it (a pod left: its subscriber goes)."""
        loop = self._loops.pop(name, None)
        if loop is not None and loop.task is not None:
            loop.task.cancel()
            await asyncio.gather(loop.task, return_exceptions=True)

    def names(self, prefix: str = "") -> list[str]:
        """The supervised loops whose name starts with `prefix`."""
        return [name for name in self._loops if name.startswith(prefix)]

    async def stop(self) -> None:
        tasks = [loop.task for loop in self._loops.values() if loop.task is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._loops.clear()


def _label(name: str) -> str:
    return name.partition("/")[0]
