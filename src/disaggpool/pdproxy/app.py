"""The P/D proxy's options and its process: one aiohttp server and one client session.

`ProxyConfig.check` enforces the project's rule for ports: a listen address beyond loopback needs
API keys (`api_keys_file`), or an explicit `allow_unauthenticated` from an operator who fences
the port otherwise (a NetworkPolicy that admits only the gateway). `start_proxy` returns a
`RunningProxy` with the bound port (0 picks a free one) and an async `close`; `run_forever`
serves until SIGINT/SIGTERM.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

from disaggpool.errors import InputError
from disaggpool.pdwire import POD_CONNECTION_REUSE_S
from disaggpool.sidecar.config import is_loopback

__all__ = ["ProxyConfig", "RunningProxy", "run_forever", "start_proxy"]

log = logging.getLogger("disaggpool.pdproxy")


@dataclasses.dataclass(frozen=True, slots=True)
class ProxyConfig:
    listen: str  # HOST:PORT
    model_server: str  # the local vLLM's base URL
    api_keys_file: str = ""  # clients' keys (Authorization: Bearer)
    upstream_api_key_file: str = ""  # the pods' key (vLLM's --api-key), on every leg
    allow_unauthenticated: bool = False
    connect_timeout_s: float = 5.0
    prefill_timeout_s: float = 60.0  # one prefill leg, whole
    decode_timeout_s: float = 600.0  # the decode leg (and any other request), whole
    idle_timeout_s: float = 60.0  # the longest silence inside a streamed answer
    max_body_bytes: int = 4 * 1024 * 1024
    debug_errors: bool = False  # error bodies name the prefill host

    def check(self) -> ProxyConfig:
        """Itself, or `InputError` naming the option."""
        src = "pd-proxy"
        host, sep, port = self.listen.rpartition(":")
        if not sep or not host or not port.isdigit() or int(port) > 65535:
            raise InputError(src, "--listen", f"must be HOST:PORT, got {self.listen!r}")
        parts = urlsplit(self.model_server)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise InputError(
                src, "--model-server", f"must be an http(s) URL, got {self.model_server!r}"
            )
        for name in ("connect_timeout_s", "prefill_timeout_s", "decode_timeout_s",
                     "idle_timeout_s"):  # fmt: skip
            if not getattr(self, name) > 0:
                raise InputError(src, "--" + name.replace("_", "-"), "must be positive")
        if self.max_body_bytes < 1:
            raise InputError(src, "--max-body-bytes", "must be positive")
        if (
            not is_loopback(host.strip("[]"))
            and not self.api_keys_file
            and not self.allow_unauthenticated
        ):
            raise InputError(
                src,
                "--listen",
                f"{self.listen} is reachable beyond this machine: give --api-keys-file, or "
                "--allow-unauthenticated where something else fences the port (a NetworkPolicy)",
            )
        return self

    @property
    def base_url(self) -> str:
        return self.model_server.rstrip("/")


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
    from disaggpool.pdproxy.proxy import PdProxy

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
