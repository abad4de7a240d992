"""The P/D proxy's process: one aiohttp server and one client session.

Its options are `config.ProxyConfig`, checked before it starts. `start_proxy` returns a
`RunningProxy` with the bound port (0 picks a free one) and an async `close`; `run_forever`
serves until SIGINT/SIGTERM.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal

import aiohttp
from aiohttp import web

from disaggpool.pdproxy.config import ProxyConfig
from disaggpool.pdproxy.proxy import PdProxy
from disaggpool.pdwire import POD_CONNECTION_REUSE_S

__all__ = ["RunningProxy", "run_forever", "start_proxy"]

log = logging.getLogger("disaggpool.pdproxy")


@dataclasses.dataclass
class RunningProxy:
    config: ProxyConfig
    port: int
    proxy: object  # the `PdProxy` (its metrics, for tests)
    _runner: web.AppRunner
    _session: aiohttp.ClientSession

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def close(self) -> None:
        await self._runner.cleanup()
        await self._session.close()


async def start_proxy(config: ProxyConfig) -> RunningProxy:

    config.check()
    # Pooled connections shorter-lived than vLLM's own keep-alive (pdwire says why).
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=POD_CONNECTION_REUSE_S)
    session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(None))
    proxy = PdProxy(config, session)
    runner = web.AppRunner(
        proxy.app(), handler_cancellation=True, access_log=None, shutdown_timeout=10.0
    )
    await runner.setup()
    host, _, port = config.listen.rpartition(":")
    site = web.TCPSite(runner, host.strip("[]"), int(port), reuse_address=True)
    await site.start()
    bound = int(runner.addresses[0][1])
    if not config.api_keys_file:
        log.warning("pd-proxy on %s takes requests without an API key", config.listen)
    log.info("pd-proxy up on port %d in front of %s", bound, config.base_url)
    return RunningProxy(config, bound, proxy, runner, session)


def run_forever(config: ProxyConfig) -> None:
    """Serve until SIGINT/SIGTERM."""

    async def main() -> None:
        running = await start_proxy(config)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await running.close()

    asyncio.run(main())
