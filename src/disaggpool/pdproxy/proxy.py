"""The P/D proxy's generation requests: a prefill leg on a named prefill pod, then the decode leg
on the local vLLM, as the front door runs them (`sidecar.upstream`: the same prefill-leg body,
the same deadlines, the same stream reader).

For ``POST /v1/completions`` and ``/v1/chat/completions``:

1. ``x-prefiller-host-port`` is read (`hosts`: 400 naming the header when malformed) and never
   forwarded; the body is read within `max_body_bytes` (413) and must be a JSON object (a large
   one parsed off the loop) with a boolean ``stream`` and no ``kv_transfer_params``: those are the
   proxy's to set, and a client's would make the decode pod dial a host of the client's choosing;
2. with prefill hosts, the prefill leg goes to each in turn (same ``X-Request-Id`` on every leg,
   the client's or a new one): the first that answers 200 with ``kv_transfer_params`` wins; a
   4xx is the request's fault and goes back to the client as it is; a connection error, a
   timeout, another status or an answer without ``kv_transfer_params`` moves on to the next host,
   and after the last to a local prefill;
3. the decode leg: the client's body with the prefill answer's ``kv_transfer_params``, unchanged,
   to the local vLLM; with no prefill (no header, or every host failed) the client's bytes exactly
   as they came. If the local vLLM answers 500 to a leg that carries remote KV (vLLM's answer
   when the KV cannot be loaded), the request runs once more as a local prefill, since nothing
   has reached the client yet. vLLM's answer is passed back as it is (status, body; a stream
   event by event, starting when its first event arrives); a stream cut later ends with an
   error event and ``[DONE]``, as vLLM ends a failed stream.

Every outcome is counted (`metrics`); error bodies name no host unless `debug_errors`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web

from disaggpool.pdproxy.config import ProxyConfig
from disaggpool.pdproxy.forward import Forwarder
from disaggpool.pdproxy.hosts import PREFILLER_HEADER, BadHeader, prefill_hosts
from disaggpool.pdproxy.metrics import ProxyMetrics
from disaggpool.sidecar.auth import KeyFile, bearer_ok
from disaggpool.sidecar.config import UpstreamTimeouts
from disaggpool.sidecar.openai_errors import openai_error
from disaggpool.sidecar.openai_request import TooLarge, json_object, read_body
from disaggpool.sidecar.service import BadRequest
from disaggpool.sidecar.upstream import Upstream, UpstreamFailed, prefill_leg_body

__all__ = ["PdProxy"]

log = logging.getLogger("disaggpool.pdproxy")

LOCAL = "the model server"  # how the local vLLM is named in failures and logs
_OPEN_PATHS = ("/health", "/metrics")  # probes and scrapes, open as vLLM's are


class _BadRequest(Exception):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class PdProxy:
    """The aiohttp application (see the module docstring)."""

    def __init__(self, config: ProxyConfig, session: aiohttp.ClientSession) -> None:
        self.config = c = config
        self.metrics = ProxyMetrics()
        self.keys = KeyFile(c.api_keys_file)
        self.upstream_keys = KeyFile(c.upstream_api_key_file)
        # The prefill leg is bounded by --prefill-timeout-s as a whole, headers included.
        prefill = UpstreamTimeouts(
            c.connect_timeout_s, c.prefill_timeout_s, c.idle_timeout_s, c.prefill_timeout_s
        )
        self.prefill_up = Upstream(session, prefill)
        idle = min(c.idle_timeout_s, c.decode_timeout_s)
        decode = UpstreamTimeouts(c.connect_timeout_s, c.decode_timeout_s, idle, c.decode_timeout_s)
        self.decode_up = Upstream(session, decode)
        self.forward = Forwarder(c, session, self.authorization)

    def app(self) -> web.Application:
        app = web.Application(
            client_max_size=self.config.max_body_bytes, middlewares=[self._authenticate]
        )
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/health", self.forward.health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_route("*", "/{tail:.*}", self.forward.other)
        return app

    def authorization(self, request: web.Request) -> str | None:
        """The ``Authorization`` to send upstream: the pods' key when one is given; else, when
        the proxy has no keys of its own, the client's (vLLM then checks it); else none (the
        client's key is the proxy's and goes no further)."""
        keys = self.upstream_keys.keys()
        if keys:
            return f"Bearer {keys[0]}"
        if not self.config.api_keys_file:
            return request.headers.get("Authorization")
        return None

    @web.middleware
    async def _authenticate(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        guarded = self.config.api_keys_file and request.path not in _OPEN_PATHS
        if guarded and not bearer_ok(request.headers.get("Authorization"), self.keys.keys()):
            self.metrics.auth_failures.inc()
            return openai_error(
                401,
                "authorization: a valid API key is required (Authorization: Bearer <key>)",
                "authorization",
                headers={"WWW-Authenticate": "Bearer"},
            )
        return await handler(request)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4"}
        )

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._counted("completions", request)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._counted("chat", request)

    async def _counted(self, endpoint: str, request: web.Request) -> web.StreamResponse:
        response, prefill = await self._generate(request)
        self.metrics.requests.labels(endpoint, prefill, str(response.status)).inc()
        return response

    def _shown(self, what: str, exc: UpstreamFailed) -> str:
        return f"{what}: {exc}" if self.config.debug_errors else f"{what}: {exc.kind}"

    async def _generate(self, request: web.Request) -> tuple[web.StreamResponse, str]:
        """(the answer, where the prompt was prefilled: metrics' ``prefill`` label)."""
        try:
            hosts = prefill_hosts(request.headers.getall(PREFILLER_HEADER, []))
        except BadHeader as exc:
            self.metrics.rejected.labels("bad_header").inc()
            return openai_error(400, f"{PREFILLER_HEADER}: {exc}", PREFILLER_HEADER), "none"
        try:
            raw = await read_body(request, self.config.max_body_bytes)
            body = await _parse(raw)
        except TooLarge as exc:
            self.metrics.rejected.labels("too_large").inc()
            return openai_error(413, f"body: {exc}", "body"), "none"
        except _BadRequest as exc:
            self.metrics.rejected.labels("bad_request").inc()
            return openai_error(400, f"{exc.field}: {exc}", exc.field), "none"
        rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        headers = {"X-Request-Id": rid, "Content-Type": "application/json"}
        if auth := self.authorization(request):
            headers["Authorization"] = auth
        stream = bool(body.get("stream", False))
        if not hosts:
            local = await self._decode(request, raw, stream, headers, "local")
            assert local is not None, "a local decode leg always answers"
            return local, "local"
        params = await self._prefill(request.path, hosts, body, headers)
        if isinstance(params, web.Response):  # a 4xx from prefill: the request's own fault
            return params, "none"
        if params is not None:
            with_kv = {**body, "kv_transfer_params": params}
            answer = await self._decode(request, with_kv, stream, headers, "remote")
            if answer is not None:
                return answer, "remote"
            self.metrics.fallbacks.labels("kv_load", "local").inc()
            log.warning("decode leg of %s could not load the prefill's KV: prefilling here", rid)
        answer = await self._decode(request, raw, stream, headers, "local")
        assert answer is not None, "a local decode leg always answers"
        return answer, "fallback"

    async def _prefill(
        self, path: str, hosts: list[str], body: dict[str, Any], headers: dict[str, str]
    ) -> dict[str, Any] | web.Response | None:
        """P's `kv_transfer_params` from the first host that gives them; a 4xx answer to pass
        on; None when every host failed (the decode pod prefills itself)."""
        leg = prefill_leg_body(body)
        for i, host in enumerate(hosts):
            started = time.monotonic()
            try:
                params = await self.prefill_up.prefill_leg(
                    host, f"http://{host}{path}", leg, headers
                )
            except UpstreamFailed as exc:
                if exc.clients_fault:
                    self.metrics.prefill_legs.labels("client_error").inc()
                    assert exc.status is not None
                    return web.Response(
                        status=exc.status, body=exc.body, content_type="application/json"
                    )
                reason = _reason(exc)
                to = "next_host" if i + 1 < len(hosts) else "local"
                self.metrics.prefill_legs.labels(reason).inc()
                self.metrics.fallbacks.labels(reason, to).inc()
                log.warning("prefill leg of %s failed on %s; next: %s",
                            headers["X-Request-Id"], exc, to)  # fmt: skip
                continue
            self.metrics.prefill_legs.labels("ok").inc()
            self.metrics.prefill_seconds.observe(time.monotonic() - started)
            return params
        return None

    async def _decode(
        self,
        request: web.Request,
        body: dict[str, Any] | bytes,
        stream: bool,
        headers: dict[str, str],
        kv: str,
    ) -> web.StreamResponse | None:
        """The decode leg on the local vLLM, its answer passed back; None when a leg carrying
        remote KV (`kv` ``remote``) got a 500 before anything reached the client."""
        up_ = self.decode_up
        deadline = asyncio.get_running_loop().time() + self.config.decode_timeout_s
        url = self.config.base_url + request.path
        up: aiohttp.ClientResponse | None = None
        response: web.StreamResponse | None = None
        complete = False  # read to its end: the connection may be pooled again
        try:
            up = await up_.open(LOCAL, url, body, headers, first_byte=stream)
            content_type = up.headers.get("Content-Type", "application/json")
            if up.status != 200 or not stream:
                raw = await up_.read_whole(LOCAL, up, deadline)
                complete = True
                if up.status == 500 and kv == "remote":
                    return None
                outcome = "ok" if up.status == 200 else "http_error"
                self.metrics.decode_legs.labels(kv, outcome).inc()
                return web.Response(status=up.status, body=raw,
                                    headers={"Content-Type": content_type})  # fmt: skip
            lines = up_.sse_lines(LOCAL, up, deadline)
            line = await anext(lines, None)
            if line is None:
                raise UpstreamFailed(LOCAL, "a stream that ended before its first event")
            # Only now does the client's answer start: until here a failure is a status.
            response = web.StreamResponse(headers={"Content-Type": content_type})
            await response.prepare(request)
            while line is not None:
                await response.write(line)
                line = await anext(lines, None)
            complete = True
            with contextlib.suppress(ConnectionResetError):
                await response.write_eof()
            self.metrics.decode_legs.labels(kv, "ok").inc()
            return response
        except UpstreamFailed as exc:
            log.warning("decode leg of %s failed: %s", headers["X-Request-Id"], exc)
            if response is None:
                self.metrics.decode_legs.labels(kv, "failed").inc()
                return openai_error(
                    504 if exc.timed_out else 502, self._shown("decode failed", exc)
                )
            self.metrics.decode_legs.labels(kv, "stream_failed").inc()
            error = {"error": {"message": self._shown("decode failed", exc),
                               "type": "BadGatewayError", "param": None, "code": 502}}  # fmt: skip
            with contextlib.suppress(ConnectionResetError, RuntimeError):
                await response.write(f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode())
                await response.write_eof()
            return response
        finally:
            if up is not None and complete:
                up.release()
            elif up is not None:
                up.close()  # cut short (a failure, the client gone): vLLM aborts the request


async def _parse(raw: bytes) -> dict[str, Any]:
    try:
        body = await json_object(raw)
    except BadRequest as exc:
        raise _BadRequest(exc.field, str(exc)) from None
    if not isinstance(body.get("stream", False), bool):
        raise _BadRequest("stream", "must be a boolean")
    if "kv_transfer_params" in body:
        raise _BadRequest("kv_transfer_params", "is set by the proxy, not by clients")
    return body


def _reason(exc: UpstreamFailed) -> str:
    """A failed prefill leg's label: `timeout`, `server_error` (a status other than 200 and
    4xx), `bad_answer` (200 without usable `kv_transfer_params`) or `connection`."""
    if exc.timed_out:
        return "timeout"
    if exc.status == 200:
        return "bad_answer"
    if exc.status is not None:
        return "server_error"
    return "connection"
