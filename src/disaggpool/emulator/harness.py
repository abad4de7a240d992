"""Run an emulator in a background thread, for synchronous tests and tools.

    with EmulatorThread(EmulatorConfig(profile, port=0, side_channel_port=0)) as emu:
        urllib.request.urlopen(emu.url + "/health")

The instance lives on its own event loop in a daemon thread; `call` runs a function on that loop
and returns its result, which is how a test inspects state (the block pool, the engines) without
racing the loop. Several emulators can run in one process (ports 0 pick free ones).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable
from types import TracebackType
from typing import TypeVar

from disaggpool.emulator.config import EmulatorConfig
from disaggpool.emulator.instance import EmulatorInstance
from disaggpool.emulator.server import RunningEmulator, serve

__all__ = ["EmulatorThread"]

T = TypeVar("T")


class EmulatorThread:
    """One emulator serving from a daemon thread (see the module docstring)."""

    def __init__(self, config: EmulatorConfig) -> None:
        self.config = config
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="emulator", daemon=True)
        self._running: RunningEmulator | None = None
        self._ready = concurrent.futures.Future[RunningEmulator]()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._running = self._loop.run_until_complete(serve(self.config))
        except BaseException as exc:
            self._ready.set_exception(exc)
            return
        self._ready.set_result(self._running)
        self._loop.run_forever()
        self._loop.run_until_complete(self._running.close())
        self._loop.close()

    def start(self, timeout: float = 30.0) -> EmulatorThread:
        self._thread.start()
        self._ready.result(timeout)
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30.0)

    def __enter__(self) -> EmulatorThread:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def running(self) -> RunningEmulator:
        assert self._running is not None, "start() first"
        return self._running

    @property
    def instance(self) -> EmulatorInstance:
        return self.running.instance

    @property
    def port(self) -> int:
        return self.running.port

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    @property
    def side_channel_port(self) -> int:
        return self.running.side_channel_port

    def call(self, fn: Callable[[], T], timeout: float = 10.0) -> T:
        """Run `fn` on the emulator's loop and return its result."""

        async def run() -> T:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout)
