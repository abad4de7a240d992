"""What the P/D proxy passes to the local vLLM untouched: `/health`, and every path that is not a
generation request (`/v1/models`, `/tokenize`, vLLM's own `/metrics` is not among them: the
proxy's `/metrics` is its own).

Bounded as the legs are: the request body within `max_body_bytes` (413), connecting within
`connect_timeout_s`, the whole exchange within `decode_timeout_s`, no silence longer than
`idle_timeout_s`. Hop-by-hop headers, ``Host``, ``Accept-Encoding`` (so that bytes pass as they
come) and ``x-prefiller-host-port`` are not forwarded; ``Authorization`` follows the proxy's
rule (`PdProxy.authorization`). vLLM's answer (status, headers, body) is streamed back as it is.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import aiohttp
from aiohttp import web

from disaggpool.pdproxy.config import ProxyConfig
from disaggpool.pdproxy.hosts import PREFILLER_HEADER
from disaggpool.sidecar.openai_errors import openai_error
from disaggpool.sidecar.openai_request import TooLarge, read_body

__all__ = ["Forwarder"]

log = logging.getLogger("disaggpool.pdproxy")

# Hop-by-hop headers (RFC 9110 §7.6.1) and those aiohttp sets itself.
_DROPPED = frozenset(
    h.lower()
    for h in (
        "Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "TE",
        "Trailer", "Transfer-Encoding", "Upgrade", "Host", "Content-Length",
        "Accept-Encoding", "Authorization", PREFILLER_HEADER,
    )
)  # fmt: skip
_DROPPED_BACK = frozenset(
    h.lower()
    for h in ("Connection", "Keep-Alive", "Transfer-Encoding", "Content-Length", "Upgrade")
)


class Forwarder:
    def __init__(
        self,
        config: ProxyConfig,
        session: aiohttp.ClientSession,
        authorization: Callable[[web.Request], str | None],
    ) -> None:
        self.config = config
        self.session = session
        self.authorization = authorization

    async def health(self, request: web.Request) -> web.Response:
        """The local vLLM's `/health`, within the connect timeout plus a few seconds: a probe
        must not hang on an engine that no longer answers."""
        c = self.config
        timeout = aiohttp.ClientTimeout(total=c.connect_timeout_s + 5.0,
                                        sock_connect=c.connect_timeout_s)  # fmt: skip
        try:
            async with self.session.get(f"{c.base_url}/health", timeout=timeout) as up:
                body = await up.read()
                return web.Response(status=up.status, body=body)
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            log.warning("health of %s: %s", c.base_url, exc or type(exc).__name__)
            return web.json_response({"status": "the model server does not answer"}, status=503)

    async def other(self, request: web.Request) -> web.StreamResponse:
        c = self.config
        try:
            raw = await read_body(request, c.max_body_bytes)
        except TooLarge as exc:
            return openai_error(413, f"body: {exc}", "body")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROPPED}
        auth = self.authorization(request)
        if auth:
            headers["Authorization"] = auth
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=c.connect_timeout_s, sock_read=c.idle_timeout_s
        )
        response: web.StreamResponse | None = None
        try:
            async with asyncio.timeout(c.decode_timeout_s):
                async with self.session.request(
                    request.method,
                    c.base_url + request.rel_url.raw_path_qs,
                    data=raw or None,
                    headers=headers,
                    allow_redirects=False,
                    timeout=timeout,
                ) as up:
                    back = {k: v for k, v in up.headers.items() if k.lower() not in _DROPPED_BACK}
                    response = web.StreamResponse(status=up.status, reason=up.reason, headers=back)
                    await response.prepare(request)
                    async for chunk in up.content.iter_any():
                        await response.write(chunk)
                    await response.write_eof()
                    return response
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            log.warning("%s %s to %s: %s", request.method, request.path, c.base_url,
                        exc or type(exc).__name__)  # fmt: skip
            if response is not None:  # cut mid-answer: the client sees a truncated body
                response.force_close()
                return response
            status = 504 if isinstance(exc, TimeoutError) else 502
            return openai_error(status, "the model server did not answer")
