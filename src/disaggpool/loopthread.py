"""A service running on its own asyncio loop in a daemon thread, for synchronous callers.

Tests, benchmarks and tools start an emulator (`emulator.harness.EmulatorThread`) or a sidecar
(`sidecar.harness.SidecarThread`) this way: `start` runs the service's start-up coroutine on the
thread's loop and waits for it; `stop` stops the loop and awaits the service's `close`; `call`
runs a function on that loop, which is how a caller reads the service's state without racing it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Awaitable, Callable, Coroutine
from types import TracebackType
from typing import Any, Generic, Protocol, Self, TypeVar

__all__ = ["LoopThread"]

T = TypeVar("T")


class Closable(Protocol):
    async def close(self) -> None: ...


S = TypeVar("S", bound=Closable)


class LoopThread(Generic[S]):
    """Runs `start()` (a coroutine returning the running service) in a daemon thread."""

    def __init__(
        self,
        start: Callable[[], Coroutine[Any, Any, S]],
        name: str,
        loop_factory: Callable[[], asyncio.AbstractEventLoop] = asyncio.new_event_loop,
    ) -> None:
        self._start = start
        self._loop = loop_factory()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._service: S | None = None
        self._ready = concurrent.futures.Future[S]()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._service = self._loop.run_until_complete(self._start())
        except BaseException as exc:
            self._ready.set_exception(exc)
            return
        self._ready.set_result(self._service)
        self._loop.run_forever()
        self._loop.run_until_complete(self._service.close())
        self._loop.close()

    def start(self, timeout: float = 30.0) -> Self:
        self._thread.start()
        self._ready.result(timeout)
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30.0)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def service(self) -> S:
        assert self._service is not None, "start() first"
        return self._service

    def call(self, fn: Callable[[], T], timeout: float = 10.0) -> T:
        """Run `fn` on the service's loop and return its result."""

        async def run() -> T:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout)

    def run(self, coro_fn: Callable[[], Awaitable[T]], timeout: float = 30.0) -> T:
        """Await `coro_fn()` on the service's loop and return its result."""

        async def run() -> T:
            return await coro_fn()

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout)
