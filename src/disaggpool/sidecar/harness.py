"""Run a sidecar in a background thread, for synchronous tests, benchmarks and tools.

    with SidecarThread(config) as sc:
        openai.OpenAI(base_url=sc.url + "/v1", api_key="x").completions.create(...)

The sidecar lives on its own event loop in a daemon thread (`loopthread.LoopThread`); `call`
runs a function on that loop (to read the routing service's state without racing it) and `run`
awaits a coroutine there (e.g. one scrape).
"""

from __future__ import annotations

from disaggpool.loopthread import LoopThread
from disaggpool.sidecar.app import RunningSidecar, start_sidecar
from disaggpool.sidecar.config import SidecarConfig

__all__ = ["SidecarThread"]


class SidecarThread(LoopThread[RunningSidecar]):
    def __init__(self, config: SidecarConfig, seed: int = 0) -> None:
        self.config = config
        super().__init__(lambda: start_sidecar(config, seed=seed), name="sidecar")

    @property
    def running(self) -> RunningSidecar:
        return self.service

    @property
    def url(self) -> str:
        return self.running.url

    @property
    def grpc_target(self) -> str:
        return self.running.grpc_target
