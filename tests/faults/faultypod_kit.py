"""The misbehaving vLLM pod of tests/faults (`FaultyPod`) and the behaviours it can be told.

`FaultyPod` is a small aiohttp server on 127.0.0.1 (its own loop, in a daemon thread) that speaks
vLLM's HTTP API to the sidecar and breaks what a test tells it to. With an `upstream` (an
emulator's URL) it proxies everything it does not break, so the parts it leaves alone are a real
pod; without one it answers like a minimal vLLM (a canned metrics page, a prefill answer with
`kv_transfer_params`, a decode leg of `max_tokens` tokens). It tells the two legs of the prefill
-> decode handoff apart by `kv_transfer_params.do_remote_decode`, counts what it was sent
(`legs`, `scrapes`), and picks each answer from a per-leg script (one-shot behaviours, queued)
falling back to a standing behaviour: `Pass`, `Hang`, `HangAfterHeaders`, `Drip`, `Respond`,
`HugeLine`, `Reset`, `Rewrite`. `metrics_pages` queues raw pages for the next scrapes, one each.
`Kit.faulty` (faultkit) starts one for a test and stops it afterwards.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web

from disaggpool.loopthread import LoopThread

MODEL = "test/model"
LEGS = ("prefill", "decode")


# ----------------------------------------------------------------------------- behaviours
class Behaviour:
    """How a `FaultyPod` answers one leg; `await b(pod, request, body, raw)` -> the response."""

    async def __call__(
        self, pod: FaultyPod, request: web.Request, body: dict[str, Any], raw: bytes
    ) -> web.StreamResponse:
        raise NotImplementedError


class Pass(Behaviour):
    """Answer as a healthy pod would: proxied to the upstream, or synthesised."""

    async def __call__(
        self, pod: FaultyPod, request: web.Request, body: dict[str, Any], raw: bytes
    ) -> web.StreamResponse:
        if pod.upstream:
            return await pod.proxy(request, raw)
        if is_prefill_leg(body):
            return web.json_response(_completion(body, 1, kv=True))
        n = _max_tokens(body)
        if not body.get("stream"):
            return web.json_response(_completion(body, n))
        resp = await _sse_start(request)
        for i in range(n):
            await resp.write(_event(_chunk(body, f" w{i}")))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


class Hang(Behaviour):
    """Accept the request and never answer: not one byte, not even the status line."""

    async def __call__(
        self, pod: FaultyPod, request: web.Request, body: dict[str, Any], raw: bytes
    ) -> web.StreamResponse:
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")


class HangAfterHeaders(Behaviour):
    """Answer 200 with SSE headers, then never send an event."""

    async def __call__(
        self, pod: FaultyPod, request: web.Request, body: dict[str, Any], raw: bytes
    ) -> web.StreamResponse:
        await _sse_start(request)
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")


@dataclasses.dataclass
class Drip(Behaviour):
    """A stream that drips: one token every `interval_s`, `tokens` of them, then [DONE]."""

    interval_s: float
    tokens: int = 1000

    async def __call__(
        self, pod: FaultyPod, request: web.Request, body: dict[str, Any], raw: bytes
    ) -> web.StreamResponse:
        resp = await _sse_start(request)
        for i in range(self.tokens):
            await resp.write(_event(_chunk(body, f" d{i}")))
            await asyncio.sleep(self.interval_s)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


@dataclasses.dataclass
class Respond(Behaviour):
    """A fixed answer: any status, any bytes (garbage JSON, a 5xx, ...)."""

    status: int
    body: bytes
    content_type: str = "application/json"

    async def __call__(
        self, pod: FaultyPod, request: web.Request, body: dict[str, Any], raw: bytes
    ) -> web.StreamResponse:
        return web.Response(
            status=self.status, body=self.body, headers={"Content-Type": self.content_type}
        )


@dataclasses.dataclass
class HugeLine(Behaviour):
    """A decode stream: one good token, then one SSE line of `size` bytes, then [DONE]."""

    size: int = 600 * 1024

    async def __call__(
        self, pod: FaultyPod, request: web.Request, body: dict[str, Any], raw: bytes
    ) -> web.StreamResponse:
        resp = await _sse_start(request)
        await resp.write(_event(_chunk(body, " first")))
        head = _event(_chunk(body, ""))  # b'data: {...,"text": "", ...}\n\n'
        filler = b"x" * max(0, self.size - len(head))
        await resp.write(head.replace(b'"text": ""', b'"text": "' + filler + b'"', 1))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


class Reset(Behaviour):
    """Drop the connection without a byte of answer (what a crashing engine does)."""

    async def __call__(
        self, pod: FaultyPod, request: web.Request, body: dict[str, Any], raw: bytes
    ) -> web.StreamResponse:
        assert request.transport is not None
        request.transport.abort()
        raise asyncio.CancelledError


@dataclasses.dataclass
class Rewrite(Behaviour):
    """Proxy the leg to the upstream, then change its JSON answer with `edit` (in place)."""

    edit: Callable[[dict[str, Any]], None]

    async def __call__(
        self, pod: FaultyPod, request: web.Request, body: dict[str, Any], raw: bytes
    ) -> web.StreamResponse:
        resp = await pod.proxy(request, raw)
        assert isinstance(resp, web.Response) and resp.body is not None
        doc = json.loads(bytes(resp.body))  # type: ignore[arg-type]
        self.edit(doc)
        return web.json_response(doc, status=resp.status)


def is_prefill_leg(body: dict[str, Any]) -> bool:
    params = body.get("kv_transfer_params")
    return isinstance(params, dict) and params.get("do_remote_decode") is True


def _max_tokens(body: dict[str, Any]) -> int:
    n = body.get("max_completion_tokens") or body.get("max_tokens") or 16
    return int(n) if isinstance(n, int) else 16


def _completion(body: dict[str, Any], n: int, *, kv: bool = False) -> dict[str, Any]:
    text = "".join(f" w{i}" for i in range(n))
    out: dict[str, Any] = {
        "id": "cmpl-faulty",
        "object": "text_completion",
        "created": 0,
        "model": MODEL,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1},
    }
    if kv:
        out["kv_transfer_params"] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": "faulty",
            "remote_block_ids": [[0]],
            "remote_host": "127.0.0.1",
            "remote_port": 1,
            "remote_request_id": "faulty",
        }
    return out


def _chunk(body: dict[str, Any], text: str) -> dict[str, Any]:
    return {
        "id": "cmpl-faulty",
        "object": "text_completion",
        "created": 0,
        "model": MODEL,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": None}],
    }


def _event(doc: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


async def _sse_start(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
    await resp.prepare(request)
    return resp


def vllm_metrics_page(running: str = "0.0", waiting: str = "0.0") -> bytes:
    """A minimal vLLM V1 `/metrics` page with the series the router reads."""
    labels = f'engine="0",model_name="{MODEL}"'
    return (
        "# TYPE vllm:num_requests_running gauge\n"
        f"vllm:num_requests_running{{{labels}}} {running}\n"
        "# TYPE vllm:num_requests_waiting gauge\n"
        f"vllm:num_requests_waiting{{{labels}}} {waiting}\n"
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        f"vllm:kv_cache_usage_perc{{{labels}}} 0.0\n"
        "# TYPE vllm:num_preemptions_total counter\n"
        f"vllm:num_preemptions_total{{{labels}}} 0.0\n"
        "# TYPE vllm:cache_config_info gauge\n"
        f'vllm:cache_config_info{{block_size="16",engine="0",num_gpu_blocks="8192"}} 1.0\n'
    ).encode()


# ----------------------------------------------------------------------------- the faulty pod
class _Served:
    def __init__(self, runner: web.AppRunner, session: aiohttp.ClientSession, port: int) -> None:
        self.runner, self.session, self.port = runner, session, port

    async def close(self) -> None:
        await self.runner.cleanup()
        await self.session.close()


class FaultyPod(LoopThread[_Served]):
    """A programmable misbehaving vLLM pod (module docstring). Attributes are read by the
    server's loop on every request, so a test may change them between requests."""

    def __init__(self, upstream: str = "", *, max_model_len: int = 4096) -> None:
        self.upstream = upstream.rstrip("/")
        self.max_model_len = max_model_len
        self.behaviour: dict[str, Behaviour] = {leg: Pass() for leg in LEGS}
        self.script: dict[str, collections.deque[Behaviour]] = {
            leg: collections.deque() for leg in LEGS
        }
        self.metrics_pages: collections.deque[bytes] = collections.deque()
        self.legs: collections.Counter[str] = collections.Counter()
        self.scrapes = 0
        self.paths: list[str] = []  # every request's method and path, in order
        # Called (in a worker thread) after the upstream answered a prefill leg and before the
        # answer goes back: what a test does "after the prefill leg".
        self.after_prefill: Callable[[], None] | None = None
        super().__init__(self._serve, name="faulty-pod")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.service.port}"

    def once(self, leg: str, *behaviours: Behaviour) -> None:
        """The next requests of `leg` get these behaviours, one each, in order."""
        self.script[leg].extend(behaviours)

    async def _serve(self) -> _Served:
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        runner = web.AppRunner(
            app, access_log=None, handler_cancellation=True, shutdown_timeout=0.5
        )
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = int(runner.addresses[0][1])
        session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        self._session = session
        return _Served(runner, session, port)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.paths.append(f"{request.method} {request.path}")
        if request.path == "/metrics":
            self.scrapes += 1
            if self.metrics_pages:
                page = self.metrics_pages.popleft()
                return web.Response(
                    body=page, headers={"Content-Type": "text/plain; version=0.0.4"}
                )
        raw = await request.read()
        if request.method == "POST" and request.path.endswith("completions"):
            try:
                body = json.loads(raw)
            except ValueError:
                body = None
            if isinstance(body, dict):
                leg = "prefill" if is_prefill_leg(body) else "decode"
                self.legs[leg] += 1
                script = self.script[leg]
                behaviour = script.popleft() if script else self.behaviour[leg]
                return await behaviour(self, request, body, raw)
        if self.upstream:
            return await self.proxy(request, raw)
        return self._canned(request)

    def _canned(self, request: web.Request) -> web.Response:
        if request.path == "/metrics":
            return web.Response(
                body=vllm_metrics_page(), headers={"Content-Type": "text/plain; version=0.0.4"}
            )
        if request.path == "/v1/models":
            model = {"id": MODEL, "object": "model", "root": MODEL}
            model["max_model_len"] = self.max_model_len
            return web.json_response({"object": "list", "data": [model]})
        if request.path in ("/health", "/ping"):
            return web.Response(status=200)
        return web.json_response({"error": {"message": "not here", "code": 404}}, status=404)

    async def proxy(self, request: web.Request, raw: bytes) -> web.StreamResponse:
        """Forward the request to the upstream; stream an SSE answer back, else the whole one
        (then `after_prefill` runs first, on a prefill leg)."""
        headers = {
            k: v
            for k, v in request.headers.items()
            if k.lower() in ("content-type", "x-request-id", "authorization")
        }
        url = self.upstream + request.path_qs
        async with self._session.request(request.method, url, data=raw, headers=headers) as up:
            ctype = up.headers.get("Content-Type", "application/json")
            if not ctype.startswith("text/event-stream"):
                data = await up.read()
                if self.after_prefill is not None and request.path.endswith("completions"):
                    with contextlib.suppress(ValueError):
                        if is_prefill_leg(json.loads(raw)):
                            await asyncio.to_thread(self.after_prefill)
                return web.Response(status=up.status, body=data, headers={"Content-Type": ctype})
            resp = web.StreamResponse(status=up.status, headers={"Content-Type": ctype})
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp
