"""The OpenAI-compatible front door: vLLM's two-step prefill -> decode handoff behind one URL.

For ``POST /v1/completions`` and ``/v1/chat/completions`` (streaming or not) it validates the
body, measures the prompt exactly (`tokens`), asks the routing service for a (prefill, decode)
pair and then follows `docs/vllm-protocol.md` §2.1 to the letter:

1. the prefill leg: the body with ``kv_transfer_params = {do_remote_decode: true,
   do_remote_prefill: false, remote_engine_id/remote_block_ids/remote_host/remote_port: null}``,
   ``stream: false``, ``max_tokens: 1`` (and ``max_completion_tokens: 1`` if present), without
   ``stream_options``, ``min_tokens`` and ``min_completion_tokens``; same ``X-Request-Id`` on
   both legs;
2. the decode leg: the client's body unchanged except for the prefill response's
   ``kv_transfer_params``, passed through untouched; its bytes stream back to the client.

With `priority_scheduling`, both legs carry ``priority``: the client's own (0 when absent) plus
the decision's (`RouteDecision.priority`: 1 for a request predicted to miss its TTFT anyway).

Failures, so that every request ends in a response or an error and is counted:
* the prefill leg fails before answering (transport error, or a status outside 400-451) -> the
  pod is marked unhealthy and the request is routed again without it, up to
  `prefill_attempts` legs; a 4xx from prefill is the client's error and is passed through;
* the decode leg fails -> an OpenAI-style 502 error (or, mid-stream, an error event then
  ``[DONE]``, as vLLM itself does);
* the client disconnects -> the upstream request is closed, which makes vLLM abort it;
* too many requests in flight -> 429 with Retry-After; no healthy pod -> 503 with Retry-After.

SLO class: header ``X-SLO-Class``, else body field ``slo_class`` (removed before forwarding),
else the configured default. For streaming requests the SLO is judged on the measured TTFT (to
the first decode token) and TPOT; a non-streaming response has no token timing, so it meets its
SLO when its total latency is within ``ttft_s + (n - 1) * tpot_s`` for its n output tokens.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any

import aiohttp
from aiohttp import web

from disaggpool.pdwire import prefill_leg_params
from disaggpool.sidecar.service import (
    BadRequest,
    Duplicate,
    NoCapacity,
    Overloaded,
    Routed,
    RoutingService,
    ServiceError,
)
from disaggpool.sidecar.tokens import Prompt, PromptCounter, TokenizeError

__all__ = ["FrontDoor", "openai_error"]

log = logging.getLogger("disaggpool.sidecar.frontdoor")

_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    409: "ConflictError",
    429: "RateLimitError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
}


def openai_error(
    status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None
) -> web.Response:
    body = {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "Error"),
            "param": param,
            "code": status,
        }
    }
    return web.json_response(body, status=status, headers=headers)


class _UpstreamFailed(Exception):
    def __init__(self, pod: str, message: str, status: int | None = None, body: bytes = b""):
        super().__init__(f"{pod}: {message}")
        self.pod = pod
        self.status = status
        self.body = body


class FrontDoor:
    """The aiohttp application (see the module docstring)."""

    def __init__(
        self, service: RoutingService, session: aiohttp.ClientSession, counter: PromptCounter
    ) -> None:
        self.service = service
        self.session = session
        self.counter = counter
        self.config = service.config
        self.metrics = service.metrics

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.on_response_prepare.append(self._close_when_draining)
        return app

    async def _close_when_draining(
        self, request: web.Request, response: web.StreamResponse
    ) -> None:
        # While the router drains (sidecar.app), each answer closes its connection: a client's
        # next request opens a new one, which the Service sends to a router that stays.
        if self.service.draining:
            response.force_close()  # aiohttp has written its headers by now: say it too
            response.headers["Connection"] = "close"

    # ------------------------------------------------------------------ simple endpoints
    async def _health(self, request: web.Request) -> web.Response:
        ok = self.service.healthy_pods()
        status = 200 if ok["prefill"] and ok["decode"] and not self.service.draining else 503
        if self.service.draining:
            why = "draining: shutting down"
        else:
            why = "ok" if status == 200 else "no healthy prefill or decode pod"
        body = {
            "status": why,
            "prefill_instances": ok["prefill"],
            "decode_instances": ok["decode"],
            "inflight": self.service.inflight,
        }
        return web.json_response(body, status=status)

    async def _models(self, request: web.Request) -> web.Response:
        model = {
            "id": self.config.model,
            "object": "model",
            "created": 0,
            "owned_by": "disaggpool",
            "root": self.config.model,
            "parent": None,
        }
        return web.json_response({"object": "list", "data": [model]})

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4"}
        )

    # ------------------------------------------------------------------ generation
    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._counted("completions", request)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._counted("chat", request)

    async def _counted(self, endpoint: str, request: web.Request) -> web.StreamResponse:
        resp = await self._generate(endpoint, request)
        self.metrics.frontdoor.labels(endpoint, str(resp.status)).inc()
        return resp

    async def _parse(
        self, endpoint: str, request: web.Request
    ) -> tuple[dict[str, Any], Prompt, str]:
        """(body to forward, the measured prompt, SLO class) or BadRequest naming the field."""
        try:
            body = json.loads(await request.read())
        except (ValueError, UnicodeDecodeError):
            raise BadRequest("request body is not valid JSON", "body") from None
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object", "body")
        model = body.get("model")
        if model is not None and model != self.config.model:
            raise _NotFound(f"The model `{model}` does not exist.", "model")
        body["model"] = self.config.model
        for key in ("max_tokens", "max_completion_tokens", "min_tokens"):
            value = body.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise BadRequest(f"must be an integer, got {value!r}", key)
            if value is not None and value < (0 if key == "min_tokens" else 1):
                raise BadRequest(f"must be at least 1, got {value}", key)
        if not isinstance(body.get("stream", False), bool):
            raise BadRequest("must be a boolean", "stream")
        if "kv_transfer_params" in body:
            raise BadRequest("is set by the router, not by clients", "kv_transfer_params")
        priority = body.get("priority", 0)
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise BadRequest(f"must be an integer, got {priority!r}", "priority")
        slo = request.headers.get("X-SLO-Class") or body.pop("slo_class", None) or ""
        if not isinstance(slo, str):
            raise BadRequest("must be a string", "slo_class")
        try:
            if endpoint == "chat":
                messages = body.get("messages")
                if not isinstance(messages, list) or not messages:
                    raise BadRequest("must be a non-empty list of messages", "messages")
                if not all(isinstance(m, dict) for m in messages):
                    raise BadRequest("every message must be an object", "messages")
                prompt_seen = await self.counter.chat(
                    messages,
                    bool(body.get("add_generation_prompt", True)),
                    bool(body.get("add_special_tokens", False)),
                )
            else:
                prompt = body.get("prompt")
                if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
                    prompt = prompt[0]
                valid_ids = isinstance(prompt, list) and all(
                    isinstance(t, int) and not isinstance(t, bool) for t in prompt
                )
                if not (isinstance(prompt, str) or valid_ids) or not prompt:
                    raise BadRequest("must be a non-empty string or list of token ids", "prompt")
                assert isinstance(prompt, str | list)
                prompt_seen = await self.counter.completion(
                    prompt, bool(body.get("add_special_tokens", True))
                )
        except ValueError as exc:  # the engine's /tokenize refused the prompt
            raise BadRequest(str(exc), "messages" if endpoint == "chat" else "prompt") from None
        return body, prompt_seen, slo

    async def _generate(self, endpoint: str, request: web.Request) -> web.StreamResponse:
        started = time.monotonic()
        try:
            body, prompt_seen, slo = await self._parse(endpoint, request)
        except _NotFound as exc:
            self.metrics.rejected.labels("bad_request").inc()
            return openai_error(404, str(exc), exc.field)
        except BadRequest as exc:
            self.metrics.rejected.labels("bad_request").inc()
            return openai_error(400, f"{exc.field}: {exc}", exc.field)
        except TokenizeError as exc:
            self.metrics.rejected.labels("no_capacity").inc()
            return openai_error(503, str(exc), headers={"Retry-After": "5"})
        request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        if max_tokens is None and endpoint == "completions":
            max_tokens = 16  # vLLM's completions default
        try:
            routed = self.service.route(
                request_id,
                prompt_seen.tokens,
                slo,
                max_tokens=max_tokens,
                token_ids=prompt_seen.ids,
                bind_late=True,  # the front door runs both legs: it can choose the decode pod last
            )
        except ServiceError as exc:
            return self._refused(exc)
        if self.config.options.priority_scheduling:
            # Both legs carry it: the prefill pod queues by it, and so does the decode pod
            # (admission, preemption). A client's own priority stays, the router's is added.
            body["priority"] = body.get("priority", 0) + routed.decision.priority
        if routed.prefill is None:  # the P/D decider's local path: the decode pod prefills
            body.pop("kv_transfer_params", None)
            return await self._decode(request, endpoint, body, routed, started)
        try:
            params, routed = await self._prefill(request, endpoint, body, routed)
            if routed.decode is None:  # late binding: the decode pod is chosen now
                routed = self.service.bind_decode(routed.request_id)
        except _UpstreamFailed as exc:
            self.service.failed(request_id, str(exc))
            if exc.status is not None and 400 <= exc.status <= 451:
                return web.Response(
                    status=exc.status, body=exc.body, content_type="application/json"
                )
            return openai_error(502, f"prefill failed: {exc}")
        except ServiceError as exc:  # no other prefill pod to retry on, or no decode pod
            self.service.failed(request_id, str(exc))
            return self._refused(exc)
        except BaseException:
            self.service.failed(request_id, "client disconnected during prefill")
            raise
        body["kv_transfer_params"] = params
        return await self._decode(request, endpoint, body, routed, started)

    def _refused(self, exc: ServiceError) -> web.Response:
        if isinstance(exc, Overloaded):
            return openai_error(429, str(exc), headers={"Retry-After": "1"})
        if isinstance(exc, NoCapacity):
            return openai_error(503, str(exc), headers={"Retry-After": "5"})
        if isinstance(exc, Duplicate):
            return openai_error(409, f"{exc.field}: {exc}", exc.field)
        self.metrics.rejected.labels("bad_request").inc()
        return openai_error(400, f"{exc.field}: {exc}", exc.field or None)

    def _headers(self, request: web.Request, request_id: str) -> dict[str, str]:
        headers = {"X-Request-Id": request_id, "Content-Type": "application/json"}
        if "Authorization" in request.headers:
            headers["Authorization"] = request.headers["Authorization"]
        return headers

    async def _prefill(
        self, request: web.Request, endpoint: str, body: dict[str, Any], routed: Routed
    ) -> tuple[Any, Routed]:
        leg = {**body, "kv_transfer_params": prefill_leg_params(), "stream": False, "max_tokens": 1}
        if "max_completion_tokens" in leg:
            leg["max_completion_tokens"] = 1
        for key in ("stream_options", "min_tokens", "min_completion_tokens"):
            leg.pop(key, None)
        path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
        headers = self._headers(request, routed.request_id)
        tried: list[str] = []
        while True:
            pod = routed.prefill
            assert pod is not None, "a local-path request has no prefill leg"
            try:
                async with self.session.post(f"{pod.url}{path}", json=leg, headers=headers) as r:
                    raw = await r.read()
                    if r.status != 200:
                        raise _UpstreamFailed(pod.name, f"HTTP {r.status}", r.status, raw)
                    params = json.loads(raw).get("kv_transfer_params")
                    if not params:
                        raise _UpstreamFailed(pod.name, "no kv_transfer_params in its answer")
                self.service.prefilled(routed.request_id)
                return params, routed
            except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
                failure = _UpstreamFailed(pod.name, str(exc) or type(exc).__name__)
            except _UpstreamFailed as exc:
                if exc.status is not None and 400 <= exc.status <= 451:
                    raise  # the request's fault, not the pod's: another pod would refuse it too
                failure = exc
            self.metrics.upstream_failures.labels("prefill").inc()
            self.service.pod_failed(pod.name)
            tried.append(pod.name)
            log.warning("prefill leg of %s failed on %s", routed.request_id, failure)
            if len(tried) >= self.config.prefill_attempts:
                raise failure
            self.metrics.prefill_retries.inc()
            routed = self.service.reroute(routed, exclude_prefill=tried)

    async def _decode(
        self,
        request: web.Request,
        endpoint: str,
        body: dict[str, Any],
        routed: Routed,
        started: float,
    ) -> web.StreamResponse:
        rid, pod = routed.request_id, routed.decode
        assert pod is not None, "the decode pod is bound before the decode leg"
        path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
        stream = bool(body.get("stream"))
        response: web.StreamResponse | None = None
        try:
            async with self.session.post(
                f"{pod.url}{path}", json=body, headers=self._headers(request, rid)
            ) as up:
                if up.status != 200:
                    raw = await up.read()
                    raise _UpstreamFailed(pod.name, f"HTTP {up.status}", up.status, raw)
                if not stream:
                    raw = await up.read()
                    self._finish_whole(routed, raw, started)
                    return web.Response(body=raw, status=200, content_type="application/json")
                response = web.StreamResponse(
                    headers={"Content-Type": up.headers.get("Content-Type", "text/event-stream")}
                )
                await response.prepare(request)
                await self._relay(up, response, routed, started)
                return response
        except _UpstreamFailed as exc:
            return await self._decode_failed(routed, exc, response)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            if response is not None and _client_gone(request):
                self.service.failed(rid, "client disconnected", aborted=True)
                return response
            return await self._decode_failed(
                routed, _UpstreamFailed(pod.name, str(exc) or type(exc).__name__), response
            )
        except BaseException:  # cancelled: the client went away while we waited upstream
            self.service.failed(rid, "client disconnected", aborted=True)
            raise

    async def _relay(
        self, up: aiohttp.ClientResponse, response: web.StreamResponse, routed: Routed, t0: float
    ) -> None:
        """Copy SSE events to the client, timing the tokens as they pass."""
        rid = routed.request_id
        first = last = 0.0
        chunks = 0
        usage_tokens = None
        saw_done = False
        async for line in up.content:
            if line.startswith(b"data: "):
                payload = line[6:].strip()
                if payload == b"[DONE]":
                    # Book the outcome before the client can see the end of its stream, so that
                    # a finished client never observes the request still in flight.
                    saw_done = True
                    out = usage_tokens if usage_tokens is not None else chunks
                    tpot = (last - first) / (out - 1) if out > 1 else 0.0
                    self._finished(routed, out, (first or time.monotonic()) - t0, tpot)
                else:
                    n, usage = _tokens_in(payload)
                    if usage is not None:
                        usage_tokens = usage
                    if n:
                        last = time.monotonic()
                        if not chunks:
                            first = last
                        chunks += n
                        self.service.progress(rid, chunks)
            try:
                await response.write(line)
            except (ConnectionResetError, RuntimeError) as exc:
                raise aiohttp.ClientConnectionError("client disconnected") from exc
        if not saw_done:
            raise aiohttp.ClientPayloadError("decode stream ended without [DONE]")
        await response.write_eof()

    def _finish_whole(self, routed: Routed, raw: bytes, t0: float) -> None:
        try:
            usage = json.loads(raw).get("usage") or {}
            out = int(usage.get("completion_tokens", 0))
        except (ValueError, AttributeError, TypeError):
            out = 0
        total = time.monotonic() - t0
        slo = routed.slo
        # No token timing without a stream: judge the end-to-end deadline the class implies.
        met = total <= slo.ttft_s + max(0, out - 1) * slo.tpot_s
        self.service.finished(routed.request_id, out, total, 0.0, met=met)

    def _finished(self, routed: Routed, out: int, ttft: float, tpot: float) -> None:
        self.service.finished(
            routed.request_id,
            out,
            ttft,
            tpot,
            routed.decision.predicted_ttft_s,
            routed.decision.predicted_tpot_s,
        )

    async def _decode_failed(
        self, routed: Routed, exc: _UpstreamFailed, response: web.StreamResponse | None
    ) -> web.StreamResponse:
        self.metrics.upstream_failures.labels("decode").inc()
        if exc.status is None or exc.status >= 500:
            self.service.pod_failed(exc.pod)
        self.service.failed(routed.request_id, str(exc))
        if response is None:
            if exc.status is not None and 400 <= exc.status <= 451:
                return web.Response(
                    status=exc.status, body=exc.body, content_type="application/json"
                )
            return openai_error(502, f"decode failed: {exc}")
        error = {"error": {"message": f"decode failed: {exc}", "type": "BadGatewayError",
                           "param": None, "code": 502}}  # fmt: skip
        try:
            await response.write(f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode())
            await response.write_eof()
        except (ConnectionResetError, RuntimeError):
            pass
        return response


class _NotFound(BadRequest):
    pass


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


def _tokens_in(payload: bytes) -> tuple[int, int | None]:
    """(tokens carried by one SSE event, usage.completion_tokens if it has usage)."""
    try:
        event = json.loads(payload)
    except ValueError:
        return 0, None
    if not isinstance(event, dict):
        return 0, None
    usage = event.get("usage")
    total = usage.get("completion_tokens") if isinstance(usage, dict) else None
    n = 0
    for choice in event.get("choices") or ():
        delta = choice.get("delta") if isinstance(choice, dict) else None
        text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
        ids = choice.get("token_ids") if isinstance(choice, dict) else None
        if isinstance(ids, list) and ids:
            n += len(ids)
        elif text:
            n += 1
    return n, total if isinstance(total, int) else None
