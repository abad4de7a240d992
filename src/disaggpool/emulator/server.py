"""The aiohttp application: vLLM 0.33's HTTP routes over one `EmulatorInstance`.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON or SSE), ``GET
/v1/models``, ``GET /health``, ``GET|POST /ping``, ``GET /version``, ``POST /tokenize``,
``POST /detokenize`` and ``GET /metrics``. Every error leaves as JSON: vLLM's
``{"error": {...}}`` for API errors and FastAPI's ``{"detail": ...}`` for an unknown route or
method; an unexpected exception becomes a 500, never a dropped connection.

A streaming response starts (200, ``text/event-stream``) before the engine produces anything, as
Starlette's does, so a failure after that point is an error ``data:`` chunk, then ``[DONE]``.

`serve` starts an instance and its listener (after `startup_delay`, during which nothing
listens, like vLLM loading a model); `harness` and `cli` use it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import hmac
import logging
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from disaggpool.emulator import requests, responses
from disaggpool.emulator.config import EmulatorConfig, cannot_listen
from disaggpool.emulator.errors import ApiError, error_body
from disaggpool.emulator.instance import EmulatorInstance
from disaggpool.emulator.job import Done, Failed, Job, Tokens
from disaggpool.emulator.metrics import CONTENT_TYPE
from disaggpool.emulator.requests import GenerationRequest
from disaggpool.emulator.responses import VLLM_VERSION

__all__ = ["RunningEmulator", "build_app", "serve"]

log = logging.getLogger(__name__)

_MAX_BODY = (
    64 * 1024 * 1024
)  # vLLM sets no limit; aiohttp's 1 MiB default would refuse long prompts
_INSTANCE = web.AppKey("instance", EmulatorInstance)
_META = web.AppKey("meta", dict)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _json(obj: Any, status: int = 200) -> web.Response:
    # Exactly "application/json", without aiohttp's "; charset=utf-8", as Starlette sends it.
    return web.Response(
        body=responses.dumps(obj).encode(),
        status=status,
        headers={"Content-Type": "application/json"},
    )


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        return _json(exc.body(), exc.status)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        # FastAPI's shape for routing errors (404 unknown path, 405 wrong method, 413 ...).
        response = _json({"detail": exc.reason}, exc.status)
        if "Allow" in exc.headers:
            response.headers["Allow"] = exc.headers["Allow"]
        return response
    except (asyncio.CancelledError, ConnectionError):
        raise
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return _json(error_body(500, "Internal server error"), 500)


_GUARDED = ("/v1", "/v2", "/inference", "/cohere")  # what vLLM's --api-key protects


def _authenticate(
    keys: tuple[str, ...],
) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    """vLLM's AuthenticationMiddleware: a Bearer key under the guarded prefixes, else 401."""
    digests = [hashlib.sha256(k.encode()).digest() for k in keys]

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method != "OPTIONS" and request.path.startswith(_GUARDED):
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            presented = hashlib.sha256(token.encode()).digest()
            matched = sum(hmac.compare_digest(presented, d) for d in digests)
            if scheme.lower() != "bearer" or not matched:
                return _json({"error": "Unauthorized"}, 401)
        return await handler(request)

    return check


def build_app(instance: EmulatorInstance) -> web.Application:
    middlewares: list[Any] = [_errors]
    if instance.config.api_keys:
        middlewares.insert(0, _authenticate(instance.config.api_keys))
    app = web.Application(middlewares=middlewares, client_max_size=_MAX_BODY)
    app[_INSTANCE] = instance
    # vLLM's system_fingerprint is "vllm-<version>-<hash of the engine configuration>".
    digest = hashlib.sha256(
        f"{instance.config.model_path}|{instance.config.model_len}|{instance.profile.name}".encode()
    ).hexdigest()[:16]
    app[_META] = {
        "created": int(time.time()),
        "perm": uuid.uuid4().hex,
        "fingerprint": f"vllm-{VLLM_VERSION}-{digest}",
    }
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_route("*", "/ping", _ping)
    app.router.add_get("/version", _version)
    app.router.add_post("/tokenize", _tokenize)
    app.router.add_post("/detokenize", _detokenize)
    app.router.add_get("/metrics", _metrics)
    if instance.config.server_dev_mode:
        app.router.add_post("/reset_prefix_cache", _reset_prefix_cache)
    return app


# ---------------------------------------------------------------------------- simple routes
async def _health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def _ping(request: web.Request) -> web.Response:
    if request.method not in ("GET", "POST", "HEAD"):
        raise web.HTTPMethodNotAllowed(request.method, ["GET", "POST"])
    return web.Response(status=200)


async def _version(request: web.Request) -> web.Response:
    return _json({"version": VLLM_VERSION})


async def _models(request: web.Request) -> web.Response:
    inst = request.app[_INSTANCE]
    meta = request.app[_META]
    cfg = inst.config
    return _json(
        responses.models_response(
            cfg.served_names, cfg.model_path, cfg.model_len, meta["created"], meta["perm"]
        )
    )


async def _metrics(request: web.Request) -> web.Response:
    body = request.app[_INSTANCE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def _body(request: web.Request) -> Any:
    requests.check_content_type(request.headers.get("Content-Type"))
    return requests.parse_json(await request.read())


async def _tokenize(request: web.Request) -> web.Response:
    inst = request.app[_INSTANCE]
    body = await _body(request)
    ids, pieces = requests.parse_tokenize(body, inst.tokenizer, inst.config.served_names)
    strs = pieces if isinstance(body, dict) and body.get("return_token_strs") is True else None
    return _json(
        {
            "count": len(ids),
            "max_model_len": inst.config.model_len,
            "tokens": ids,
            "token_strs": strs,
        }
    )


async def _detokenize(request: web.Request) -> web.Response:
    inst = request.app[_INSTANCE]
    ids = requests.parse_detokenize(await _body(request), inst.tokenizer, inst.config.served_names)
    return _json({"prompt": inst.tokenizer.decode(ids)})


# ---------------------------------------------------------------------------- generation
async def _completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completions")


async def _chat(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


def _gone(request: web.Request) -> bool:
    """Whether the client has closed its connection.

    aiohttp stops reading a connection while its handler runs, so it never sees the client's
    FIN; peeking at the socket does (an empty read means end of stream), as uvicorn's
    disconnect detection does for vLLM.
    """
    transport = request.transport
    if transport is None or transport.is_closing():
        return True
    sock = transport.get_extra_info("socket")
    flags = socket.MSG_PEEK | getattr(socket, "MSG_DONTWAIT", 0)
    if sock is None or not getattr(socket, "MSG_DONTWAIT", 0):
        return False
    try:
        with socket.fromfd(sock.fileno(), sock.family, sock.type) as dup:
            return dup.recv(1, flags) == b""
    except BlockingIOError:
        return False  # open, nothing to read
    except OSError:
        return True


def _request_id(request: web.Request, spec: GenerationRequest) -> str:
    """vLLM: the X-Request-Id header, else the body's `request_id`, else a random uuid."""
    return request.headers.get("X-Request-Id") or spec.body_request_id or uuid.uuid4().hex


async def _reset_prefix_cache(request: web.Request) -> web.Response:
    """vLLM's development endpoint: empty both engines' prefix caches, unless a request holds
    blocks there (then ``{"success": false}``; callers may retry)."""
    inst = request.app[_INSTANCE]
    ok = inst.decode.reset_prefix_cache() and inst.prefill.reset_prefix_cache()
    return _json({"success": ok}, 200)


async def _generate(request: web.Request, endpoint: requests.Endpoint) -> web.StreamResponse:
    inst = request.app[_INSTANCE]
    body = await _body(request)
    parse = requests.parse_completion if endpoint == "completions" else requests.parse_chat
    spec = parse(body, inst.tokenizer, inst.config.served_names, inst.config.model_len)
    header = request.headers.get("X-Vllm-Priority")
    if header is not None:  # vLLM: the header overrides the body's `priority`
        try:
            spec = dataclasses.replace(spec, priority=int(header))
        except ValueError:
            raise ApiError(
                400, f"X-Vllm-Priority must be an integer, got {header[:40]!r}.", "priority"
            ) from None
    request_id = _request_id(request, spec)
    job = inst.submit(spec, request_id)
    out = _Output(inst, job, responses.SHAPES[endpoint], request.app[_META]["fingerprint"])
    try:
        if spec.stream:
            return await out.stream(request)
        return await out.whole(request)
    finally:
        job.cancel()  # no-op once finished; frees everything if we left early


@dataclasses.dataclass
class _Output:
    """Turns a job's events into one JSON response or an SSE stream."""

    inst: EmulatorInstance
    job: Job
    shape: responses.Shape
    fingerprint: str

    def __post_init__(self) -> None:
        self.rid = f"{self.shape.id_prefix}-{self.job.request_id}"
        self.created = int(time.time())
        self.model = self.job.spec.model or self.inst.config.served_name

    def _usage(self, completion: int, *, details: bool = True) -> dict[str, Any]:
        return responses.usage(self.job.prompt_tokens, completion, details=details)

    async def whole(self, request: web.Request) -> web.Response:
        ids: list[int] = []
        async for ev in self.job.events(gone=lambda: _gone(request)):
            if isinstance(ev, Tokens):
                ids.extend(ev.ids)
            elif isinstance(ev, Failed):
                return _json(error_body(ev.status, ev.message), ev.status)
            else:
                return _json(
                    responses.response(
                        self.shape,
                        self.rid,
                        self.created,
                        self.model,
                        self.inst.tokenizer.decode(ids),
                        ev.finish_reason,
                        self._usage(len(ids)),
                        ev.kv_transfer_params,
                        self.fingerprint,
                    )
                )
        # The client left: the request was aborted and nobody reads this answer.
        return _json(error_body(500, "Request aborted: the client disconnected"), 500)

    def _chunk(
        self, text: str, finish: Done | None = None, use: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        reason = finish.finish_reason if finish else None
        kv = finish.kv_transfer_params if finish else None
        return responses.chunk(
            self.shape, self.rid, self.created, self.model, text, reason, use, kv
        )

    async def stream(self, request: web.Request) -> web.StreamResponse:
        spec = self.job.spec
        resp = web.StreamResponse(
            status=200, headers={"Content-Type": "text/event-stream; charset=utf-8"}
        )
        await resp.prepare(request)

        async def send(obj: dict[str, Any]) -> None:
            await resp.write(f"data: {responses.dumps(obj)}\n\n".encode())

        def use(n: int) -> dict[str, Any] | None:
            return self._usage(n, details=False) if spec.continuous_usage else None

        sent = 0
        try:
            if self.shape.role_chunk:
                await send(
                    responses.role_chunk(self.shape, self.rid, self.created, self.model, use(0))
                )
            held: str | None = None  # the last tokens' text waits for the finish reason
            total = self.job.output_tokens
            async for ev in self.job.events(gone=lambda: _gone(request)):
                if isinstance(ev, Tokens):
                    text = self.inst.tokenizer.decode(ev.ids)
                    sent += len(ev.ids)
                    if sent >= total:
                        held = text
                        continue
                    await send(self._chunk(text, use=use(sent)))
                elif isinstance(ev, Done):
                    await send(self._chunk(held or "", finish=ev, use=use(sent)))
                    if spec.include_usage:
                        await send(
                            responses.usage_chunk(
                                self.shape,
                                self.rid,
                                self.created,
                                self.model,
                                self._usage(sent, details=False),
                                self.fingerprint,
                            )
                        )
                else:
                    await send(error_body(ev.status, ev.message))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionError:
            self.job.cancel()  # the client went away mid-stream: vLLM aborts the request
        return resp


# ---------------------------------------------------------------------------- running
@dataclasses.dataclass
class RunningEmulator:
    """A started instance and its HTTP listener."""

    instance: EmulatorInstance
    runner: web.AppRunner
    port: int

    @property
    def side_channel_port(self) -> int:
        return self.instance.side_channel_port

    async def close(self) -> None:
        await self.runner.cleanup()
        await self.instance.close()


async def serve(config: EmulatorConfig) -> RunningEmulator:
    """Start an instance and listen on `config.host:config.port` (0: any free port)."""
    if config.startup_delay:
        # Like vLLM loading weights: nothing listens yet, so probes get "connection refused".
        await asyncio.sleep(config.startup_delay)
    instance = EmulatorInstance(config)
    try:
        await instance.start()
    except BaseException:
        await instance.close()  # whatever did start (a KV events socket) is let go
        raise
    runner = web.AppRunner(
        build_app(instance), access_log=None, keepalive_timeout=config.http_keep_alive
    )
    try:
        await runner.setup()
        site = web.TCPSite(runner, config.host, config.port)
        try:
            await site.start()
        except OSError as exc:
            address, change = f"{config.host}:{config.port}", "choose another with --port"
            raise cannot_listen(exc.errno, "HTTP port", address, change) from exc
    except BaseException:
        with contextlib.suppress(Exception):
            await runner.cleanup()
        await instance.close()
        raise
    port = config.port
    for addr in runner.addresses:
        if isinstance(addr, tuple) and len(addr) >= 2:
            port = int(addr[1])
            break
    log.info(
        "emulating vLLM %s: model %s on %s:%d, side channel %s:%d, profile %s",
        VLLM_VERSION,
        config.served_name,
        config.host,
        port,
        config.side_channel_host,
        instance.side_channel_port,
        config.profile.name,
    )
    return RunningEmulator(instance, runner, port)
