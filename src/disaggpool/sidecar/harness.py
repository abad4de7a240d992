"""Run a sidecar in a background thread, for synchronous tests, benchmarks and tools.

    with SidecarThread(config) as sc:
        openai.OpenAI(base_url=sc.url + "/v1", api_key="x").completions.create(...)

Like `emulator.harness.EmulatorThread`: the sidecar lives on its own event loop in a daemon
thread and `call` runs a function on that loop (to read the routing service's state without
racing it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable
from types import TracebackType
from typing import TypeVar

from disaggpool.sidecar.app import RunningSidecar, start_sidecar
from disaggpool.sidecar.config import SidecarConfig

__all__ = ["SidecarThread"]

T = TypeVar("T")


class SidecarThread:
    def __init__(self, config: SidecarConfig, seed: int = 0) -> None:
        self.config = config
        self.seed = seed
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="sidecar", daemon=True)
        self._running: RunningSidecar | None = None
        self._ready = concurrent.futures.Future[RunningSidecar]()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._running = self._loop.run_until_complete(
                start_sidecar(self.config, seed=self.seed)
            )
        except BaseException as exc:
            self._ready.set_exception(exc)
            return
        self._ready.set_result(self._running)
        self._loop.run_forever()
        self._loop.run_until_complete(self._running.close())
        self._loop.close()

    def start(self, timeout: float = 30.0) -> SidecarThread:
        self._thread.start()
        self._ready.result(timeout)
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30.0)

    def __enter__(self) -> SidecarThread:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def running(self) -> RunningSidecar:
        assert self._running is not None, "start() first"
        return self._running

    @property
    def url(self) -> str:
        return self.running.url

    @property
    def grpc_target(self) -> str:
        return self.running.grpc_target

    def call(self, fn: Callable[[], T], timeout: float = 10.0) -> T:
        """Run `fn` on the sidecar's loop and return its result."""

        async def run() -> T:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout)

    def run(self, coro_fn: Callable[[], object], timeout: float = 30.0) -> object:
        """Await `coro_fn()` on the sidecar's loop (e.g. one scrape) and return its result."""

        async def run() -> object:
            return await coro_fn()  # type: ignore[misc]

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout)
