"""Run an emulator in a background thread, for synchronous tests and tools.

    with EmulatorThread(EmulatorConfig(profile, port=0, side_channel_port=0)) as emu:
        urllib.request.urlopen(emu.url + "/health")

The instance lives on its own event loop in a daemon thread (`loopthread.LoopThread`); `call`
runs a function on that loop and returns its result, which is how a test inspects state (the
block pool, the engines) without racing the loop. Several emulators can run in one process
(ports 0 pick free ones).
"""

from __future__ import annotations

from disaggpool import precise_loop
from disaggpool.emulator.config import EmulatorConfig
from disaggpool.emulator.instance import EmulatorInstance
from disaggpool.emulator.server import RunningEmulator, serve
from disaggpool.loopthread import LoopThread

__all__ = ["EmulatorThread"]


class EmulatorThread(LoopThread[RunningEmulator]):
    """One emulator serving from a daemon thread (see the module docstring)."""

    def __init__(self, config: EmulatorConfig) -> None:
        self.config = config
        super().__init__(
            lambda: serve(config), name="emulator", loop_factory=precise_loop.new_event_loop
        )

    @property
    def running(self) -> RunningEmulator:
        return self.service

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
