"""The OpenAI-compatible front door: vLLM's two-step prefill -> decode handoff behind one URL.

For ``POST /v1/completions`` and ``/v1/chat/completions`` (streaming or not) it admits the request
(429 past `max_inflight`, before reading anything), reads the body within `max_body_bytes`
(413 past it), validates it, measures the prompt exactly (`tokens`), checks the output length
against the pods' `max_model_len` as vLLM would (400 naming ``max_tokens``, before any leg runs),
asks the routing service for a (prefill, decode) pair and then follows `docs/vllm-protocol.md`
§2.1 to the letter:

1. the prefill leg: the body with ``kv_transfer_params = {do_remote_decode: true,
   do_remote_prefill: false, remote_engine_id/remote_block_ids/remote_host/remote_port: null}``,
   ``stream: false``, ``max_tokens: 1`` (and ``max_completion_tokens: 1`` if present), without
   ``stream_options``, ``min_tokens`` and ``min_completion_tokens``; same ``X-Request-Id`` on
   both legs;
2. the decode leg: the client's body unchanged except for the prefill response's
   ``kv_transfer_params``, passed through untouched; its bytes stream back to the client.

A client's own ``priority`` is forwarded only with `forward_client_priority` (it reorders the
engines' queues for everybody). With `priority_scheduling`, both legs carry the decision's
(`RouteDecision.priority`: 1 for a request predicted to miss its TTFT anyway) on top.

Legs have four deadlines (`upstream_timeouts`): connecting, the first byte of the answer (the
prefill leg's whole answer; a streamed decode leg's first event), the longest silence inside a
stream, and the whole leg. The client's response is started only when the decode pod's first
event arrives, so until then a failure can still be answered with a proper status or retried.

Failures, so that every request ends in a response or an error and is counted:
* the prefill leg fails (transport error, a deadline, a status outside 400-451, an answer that
  is not a JSON object with ``kv_transfer_params``) -> the pod is marked unhealthy and the
  request is routed again without it, up to `prefill_attempts` legs; a 4xx from prefill is the
  client's error and is passed through;
* the decode leg fails before its first event -> retried on another decode pod, up to
  `decode_attempts` legs. When the failed pod never got the request (the connection was refused),
  the other pod pulls the same KV, which the prefill pod holds for its lease; otherwise the other
  pod prefills the prompt itself (local path), since the KV may have been read and freed, and a
  read of freed blocks fails silently in vLLM. A pod that answered with a 5xx is alive and stays
  in the pool (vLLM answers 500 when it cannot load the KV, which is the prefill pod's doing);
* the decode leg fails once streaming (reset, silence past `idle_s`, an over-long or garbage
  line) -> an error event then ``[DONE]``, as vLLM itself does; a stream that outlives
  `total_s` ends the same way without blaming the pod;
* the client disconnects -> the upstream request is closed, which makes vLLM abort it;
* too many requests in flight -> 429 with Retry-After; no healthy pod -> 503 with Retry-After.
Error bodies name no pod and no address unless `debug_errors` (the log always does).

SLO class: header ``X-SLO-Class``, else body field ``slo_class`` (removed before forwarding),
else the configured default. For streaming requests the SLO is judged on the measured TTFT (to
the first decode token) and TPOT; a non-streaming response has no token timing, so it meets its
SLO when its total latency is within ``ttft_s + (n - 1) * tpot_s`` for its n output tokens.

With `auth.api_keys_file`, ``/v1/*`` needs ``Authorization: Bearer <key>`` (vLLM's `--api-key`
rule); the probes (`/livez`, `/readyz`, `/health`) and `/metrics` stay open, as vLLM's do.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web

from disaggpool.pdwire import prefill_leg_params
from disaggpool.sidecar.auth import KeyFile, bearer_ok
from disaggpool.sidecar.service import (
    BadRequest,
    Duplicate,
    NoCapacity,
    Overloaded,
    Routed,
    RoutingService,
    ServiceError,
)
from disaggpool.sidecar.supervise import Supervisor
from disaggpool.sidecar.tokens import Prompt, PromptCounter, TokenizeError

__all__ = ["MAX_SSE_LINE", "FrontDoor", "openai_error"]

log = logging.getLogger("disaggpool.sidecar.frontdoor")

MAX_SSE_LINE = 512 * 1024  # one server-sent event line from a pod; vLLM's are a few KiB
OFF_LOOP_JSON = 256 * 1024  # bodies larger than this are parsed in a worker thread
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # vLLM's, for /v1/completions without max_tokens

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    409: "ConflictError",
    413: "RequestEntityTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
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
    """A leg that failed. `kind` says how, in words fit for a client (no address); `never_sent`:
    the pod provably never received the request (its connection was refused)."""

    def __init__(
        self,
        pod: str,
        kind: str,
        detail: str = "",
        status: int | None = None,
        body: bytes = b"",
        *,
        never_sent: bool = False,
        blame_pod: bool = True,
        final: bool = False,
    ) -> None:
        super().__init__(f"{pod}: {kind}" + (f" ({detail})" if detail else ""))
        self.pod = pod
        self.kind = kind
        self.status = status
        self.body = body
        self.never_sent = never_sent
        self.blame_pod = blame_pod
        self.final = final  # the leg ran out of its total time: no other pod gets another go

    @property
    def clients_fault(self) -> bool:
        return self.status is not None and 400 <= self.status <= 451


class FrontDoor:
    """The aiohttp application (see the module docstring)."""

    def __init__(
        self,
        service: RoutingService,
        session: aiohttp.ClientSession,
        counter: PromptCounter,
        supervisor: Supervisor | None = None,
    ) -> None:
        self.service = service
        self.session = session
        self.counter = counter
        self.supervisor = supervisor
        self.config = service.config
        self.metrics = service.metrics
        self.timeouts = service.config.upstream_timeouts
        self.keys = KeyFile(service.config.auth.api_keys_file)
        self.admitted = 0  # generation requests past admission and not yet answered

    def app(self) -> web.Application:
        app = web.Application(
            client_max_size=self.config.max_body_bytes, middlewares=[self._authenticate]
        )
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/livez", self._livez)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/health", self._readyz)  # the name earlier versions probed
        app.router.add_get("/metrics", self._metrics)
        app.on_response_prepare.append(self._close_when_draining)
        return app

    @web.middleware
    async def _authenticate(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        guarded = self.config.auth.api_keys_file and request.path.startswith("/v1")
        if guarded and not bearer_ok(request.headers.get("Authorization"), self.keys.keys()):
            self.metrics.auth_failures.labels("http").inc()
            return openai_error(
                401,
                "authorization: a valid API key is required (Authorization: Bearer <key>)",
                "authorization",
                headers={"WWW-Authenticate": "Bearer"},
            )
        return await handler(request)

    async def _close_when_draining(
        self, request: web.Request, response: web.StreamResponse
    ) -> None:
        # While the router drains (sidecar.app), each answer closes its connection: a client's
        # next request opens a new one, which the Service sends to a router that stays.
        if self.service.draining:
            response.force_close()  # aiohttp has written its headers by now: say it too
            response.headers["Connection"] = "close"

    # ------------------------------------------------------------------ probes and simple endpoints
    async def _livez(self, request: web.Request) -> web.Response:
        """Liveness: the process and its background loops (`sidecar.supervise`), nothing else;
        a pool with no healthy pod is a readiness matter, and restarting us would not fix it."""
        loops = self.supervisor.states() if self.supervisor is not None else {}
        alive = self.supervisor is None or self.supervisor.alive
        body = {"status": "ok" if alive else "a background loop is dead", "loops": loops}
        return web.json_response(body, status=200 if alive else 503)

    async def _readyz(self, request: web.Request) -> web.Response:
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
        limit = self.service.max_model_len()
        if limit:
            model["max_model_len"] = limit
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
        resp: web.StreamResponse
        if self.admitted >= self.config.max_inflight:
            # Before reading the body: a flood costs us a header parse per request, no more.
            self.metrics.rejected.labels("overload").inc()
            resp = openai_error(
                429,
                f"{self.admitted} requests in flight (max_inflight)",
                None,
                {"Retry-After": "1"},
            )
        else:
            self.admitted += 1
            try:
                resp = await self._generate(endpoint, request)
            finally:
                self.admitted -= 1
        self.metrics.frontdoor.labels(endpoint, str(resp.status)).inc()
        return resp

    async def _read_body(self, request: web.Request) -> bytes:
        """The body, or `_TooLarge` past `max_body_bytes` (from Content-Length or while
        reading: a chunked body has none)."""
        limit = self.config.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise _TooLarge(limit)
        chunks, size = [], 0
        async for chunk in request.content.iter_chunked(256 * 1024):
            size += len(chunk)
            if size > limit:
                raise _TooLarge(limit)
            chunks.append(chunk)
        return b"".join(chunks)

    async def _parse(
        self, endpoint: str, request: web.Request
    ) -> tuple[dict[str, Any], Prompt, str]:
        """(body to forward, the measured prompt, SLO class) or BadRequest naming the field."""
        raw = await self._read_body(request)
        try:
            # A large body would hold the loop that serves every stream and gRPC call.
            body = (
                json.loads(raw)
                if len(raw) <= OFF_LOOP_JSON
                else await asyncio.to_thread(json.loads, raw)
            )
        except (ValueError, UnicodeDecodeError, RecursionError):
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
        if not self.config.forward_client_priority:
            body.pop("priority", None)  # it would reorder the engines' queues for everybody
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

    def _check_length(self, body: dict[str, Any], prompt: int, max_tokens: int | None) -> None:
        """vLLM's own length checks, made here so that a request the pods would refuse runs no
        prefill leg first (the decode pod would refuse it only after the prefill)."""
        length = self.service.max_model_len()
        if not length:
            return
        key = "max_completion_tokens" if body.get("max_completion_tokens") else "max_tokens"
        if max_tokens is not None and max_tokens > length:
            raise BadRequest(
                f"{key}={max_tokens} cannot be greater than max_model_len={length}. "
                "Please request fewer output tokens.",
                key,
            )
        if prompt > length or (max_tokens is None and prompt >= length):
            raise BadRequest(
                f"This model's maximum context length is {length} tokens. However, your prompt "
                f"contains {prompt} input tokens, which exceeds this limit even without any "
                "output tokens. Please reduce the length of the input prompt.",
                "messages" if "messages" in body else "prompt",
            )
        if max_tokens is not None and prompt + max_tokens > length:
            raise BadRequest(
                f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This "
                f"model's maximum context length is {length} tokens and your request has "
                f"{prompt} input tokens ({max_tokens} > {length} - {prompt}).",
                key,
            )

    async def _generate(self, endpoint: str, request: web.Request) -> web.StreamResponse:
        started = time.monotonic()
        try:
            body, prompt_seen, slo = await self._parse(endpoint, request)
            max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
            if max_tokens is None and endpoint == "completions":
                max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
            self._check_length(body, prompt_seen.tokens, max_tokens)
        except _TooLarge as exc:
            self.metrics.rejected.labels("bad_request").inc()
            return openai_error(413, f"body: {exc}", "body")
        except _NotFound as exc:
            self.metrics.rejected.labels("bad_request").inc()
            return openai_error(404, str(exc), exc.field)
        except BadRequest as exc:
            self.metrics.rejected.labels("bad_request").inc()
            return openai_error(400, f"{exc.field}: {exc}", exc.field)
        except TokenizeError as exc:
            self.metrics.rejected.labels("no_capacity").inc()
            log.warning("cannot measure a prompt: %s", exc)
            shown = str(exc) if self.config.debug_errors else "no pod could tokenize the prompt"
            return openai_error(503, shown, headers={"Retry-After": "5"})
        request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
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
            # (admission, preemption). A client's own priority stays when it is forwarded.
            body["priority"] = body.get("priority", 0) + routed.decision.priority
        if routed.prefill is None:  # the P/D decider's local path: the decode pod prefills
            return await self._decode(request, endpoint, body, routed, started)
        try:
            params, routed = await self._prefill(request, endpoint, body, routed)
            if routed.decode is None:  # late binding: the decode pod is chosen now
                routed = self.service.bind_decode(routed.request_id)
        except _UpstreamFailed as exc:
            self.service.failed(request_id, str(exc))
            if exc.status is not None and exc.clients_fault:
                return web.Response(
                    status=exc.status, body=exc.body, content_type="application/json"
                )
            return openai_error(502, self._shown("prefill failed", exc))
        except ServiceError as exc:  # no other prefill pod to retry on, or no decode pod
            self.service.failed(request_id, str(exc))
            return self._refused(exc)
        except BaseException:
            self.service.failed(request_id, "client disconnected during prefill")
            raise
        body["kv_transfer_params"] = params
        return await self._decode(request, endpoint, body, routed, started)

    def _shown(self, what: str, exc: _UpstreamFailed) -> str:
        """An upstream failure as the client reads it: how it failed; which pod only when
        `debug_errors` (pod names and addresses are the cluster's business)."""
        return f"{what}: {exc}" if self.config.debug_errors else f"{what}: {exc.kind}"

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
        upstream = self.service.upstream_headers()
        if upstream:
            headers.update(upstream)  # the pods' own key (vLLM's --api-key)
        elif not self.config.auth.api_keys_file and "Authorization" in request.headers:
            # No keys of our own: pass the client's through, as vLLM's reference proxy does. With
            # keys of our own, the client's key is the router's and goes no further.
            headers["Authorization"] = request.headers["Authorization"]
        return headers

    # ------------------------------------------------------------------ one leg
    async def _open(
        self, pod: str, url: str, body: dict[str, Any], headers: dict[str, str], first_byte: bool
    ) -> aiohttp.ClientResponse:
        """POST a leg and wait for its answer's headers: within `first_byte_s` when `first_byte`
        (else within the whole leg's time). Failures become `_UpstreamFailed`."""
        t = self.timeouts
        timeout = aiohttp.ClientTimeout(total=None, connect=t.connect_s, sock_connect=t.connect_s)
        try:
            async with asyncio.timeout(t.first_byte_s if first_byte else t.total_s):
                return await self.session.post(url, json=body, headers=headers, timeout=timeout)
        except aiohttp.ClientConnectorError as exc:
            raise _UpstreamFailed(pod, "connection refused", str(exc), never_sent=True) from None
        except TimeoutError:
            if first_byte:
                raise _UpstreamFailed(pod, "no answer within first_byte_s") from None
            raise _UpstreamFailed(
                pod, "no answer within total_s", blame_pod=False, final=True
            ) from None
        except (aiohttp.ClientError, OSError) as exc:
            raise _UpstreamFailed(pod, "connection lost", str(exc) or type(exc).__name__) from None

    async def _read_whole(self, pod: str, up: aiohttp.ClientResponse, deadline: float) -> bytes:
        try:
            async with asyncio.timeout_at(deadline):
                return await up.read()
        except TimeoutError:
            raise _UpstreamFailed(
                pod, "answer not complete within total_s", blame_pod=False, final=True
            ) from None
        except (aiohttp.ClientError, OSError) as exc:
            raise _UpstreamFailed(pod, "connection lost", str(exc) or type(exc).__name__) from None

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
                params = await self._prefill_leg(pod.name, f"{pod.url}{path}", leg, headers)
                self.service.prefilled(routed.request_id)
                return params, routed
            except _UpstreamFailed as exc:
                if exc.clients_fault:
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

    async def _prefill_leg(
        self, pod: str, url: str, leg: dict[str, Any], headers: dict[str, str]
    ) -> Any:
        """One prefill leg: its answer's `kv_transfer_params`, or `_UpstreamFailed`."""
        deadline = asyncio.get_running_loop().time() + self.timeouts.total_s
        up = await self._open(pod, url, leg, headers, first_byte=True)
        try:
            raw = await self._read_whole(pod, up, deadline)
        except BaseException:
            up.close()
            raise
        up.release()
        if up.status != 200:
            raise _UpstreamFailed(pod, f"HTTP {up.status}", status=up.status, body=raw)
        try:
            answer = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise _UpstreamFailed(pod, "an answer that is not JSON") from None
        params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        if not isinstance(answer, dict):
            raise _UpstreamFailed(pod, "an answer that is not a JSON object")
        if not params or not isinstance(params, dict):
            raise _UpstreamFailed(pod, "no kv_transfer_params in its answer")
        return params

    # ------------------------------------------------------------------ decode
    async def _decode(
        self,
        request: web.Request,
        endpoint: str,
        body: dict[str, Any],
        routed: Routed,
        started: float,
    ) -> web.StreamResponse:
        """The decode leg, retried on another decode pod while nothing has reached the client."""
        attempt = 1
        while True:
            if routed.prefill is None:  # the local path: the decode pod prefills itself
                body.pop("kv_transfer_params", None)
            try:
                return await self._decode_leg(request, endpoint, body, routed, started)
            except _Retryable as retry:
                exc = retry.failure
            self.metrics.upstream_failures.labels("decode").inc()
            if exc.blame_pod:
                self.service.pod_failed(exc.pod)
            log.warning("decode leg of %s failed before its first token on %s",
                        routed.request_id, exc)  # fmt: skip
            if exc.final:
                self.service.failed(routed.request_id, str(exc))
                return openai_error(504, self._shown("decode failed", exc))
            if attempt >= self.config.decode_attempts:
                self.service.failed(routed.request_id, str(exc))
                return openai_error(502, self._shown("decode failed", exc))
            local = routed.prefill is None or not exc.never_sent
            try:
                routed = self.service.retry_decode(routed, exc.pod, local=local)
            except ServiceError as refused:
                self.service.failed(routed.request_id, f"{exc}; no decode pod to retry on")
                return self._refused(refused)
            self.metrics.decode_retries.labels("local" if local else "kv").inc()
            attempt += 1

    async def _decode_leg(
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
        deadline = asyncio.get_running_loop().time() + self.timeouts.total_s
        response: web.StreamResponse | None = None
        up: aiohttp.ClientResponse | None = None
        complete = False  # the answer was read to its end: its connection may be pooled again
        try:
            up = await self._open(
                pod.name, f"{pod.url}{path}", body, self._headers(request, rid), first_byte=stream
            )
            if up.status != 200:
                raw = await self._read_whole(pod.name, up, deadline)
                # A pod that answers an error is alive (vLLM's 500 for a KV it could not load
                # is its prefill pod's doing): retried elsewhere, not ejected.
                failed = _UpstreamFailed(pod.name, f"HTTP {up.status}", status=up.status,
                                         body=raw, blame_pod=False)  # fmt: skip
                complete = True
                if failed.clients_fault:
                    self.service.failed(rid, str(failed))
                    return web.Response(status=up.status, body=raw, content_type="application/json")
                raise failed
            if not stream:
                raw = await self._read_whole(pod.name, up, deadline)
                complete = True
                self._finish_whole(routed, raw, started)
                return web.Response(body=raw, status=200, content_type="application/json")
            content_type = up.headers.get("Content-Type", "text/event-stream")
            lines = self._sse_lines(pod.name, up, deadline)
            first = await anext(lines, None)
            if first is None:
                raise _UpstreamFailed(pod.name, "a stream that ended before its first event")
            # Only now does the client's response start: every failure before it was retryable.
            response = web.StreamResponse(headers={"Content-Type": content_type})
            await response.prepare(request)
            await self._relay(first, lines, response, routed, started)
            complete = True
            return response
        except _UpstreamFailed as exc:
            if response is None:
                raise _Retryable(exc) from None
            return await self._stream_failed(request, routed, exc, response)
        except (ConnectionResetError, aiohttp.ClientConnectionError, asyncio.CancelledError):
            # The client went away (or cancelled us): closing `up` aborts the request on vLLM.
            self.service.failed(rid, "client disconnected", aborted=True)
            raise
        finally:
            if up is not None and complete:
                up.release()
            elif up is not None:
                up.close()  # a request cut short: closing its connection makes vLLM abort it

    async def _sse_lines(
        self, pod: str, up: aiohttp.ClientResponse, deadline: float
    ) -> AsyncIterator[bytes]:
        """The stream's lines, each within `idle_s` of the last and all before `deadline`; a
        line longer than `MAX_SSE_LINE` or a broken connection is `_UpstreamFailed`."""
        loop = asyncio.get_running_loop()
        idle = self.timeouts.idle_s
        buf = bytearray()
        while True:
            left = deadline - loop.time()
            try:
                async with asyncio.timeout(min(idle, left) if left > 0 else 0):
                    chunk = await up.content.readany()
            except TimeoutError:
                if loop.time() >= deadline:
                    raise _UpstreamFailed(
                        pod, "stream longer than total_s", blame_pod=False
                    ) from None
                raise _UpstreamFailed(pod, "stream silent for idle_s") from None
            except (aiohttp.ClientError, OSError) as exc:
                raise _UpstreamFailed(pod, "stream cut", str(exc) or type(exc).__name__) from None
            if not chunk:
                if buf:
                    yield bytes(buf)
                return
            buf += chunk
            start = 0
            while (end := buf.find(b"\n", start)) >= 0:
                if end + 1 - start > MAX_SSE_LINE:
                    raise _too_long(pod)
                yield bytes(buf[start : end + 1])
                start = end + 1
            del buf[:start]
            if len(buf) > MAX_SSE_LINE:  # no newline yet: do not wait for the rest of it
                raise _too_long(pod)

    async def _relay(
        self,
        first: bytes,
        lines: AsyncIterator[bytes],
        response: web.StreamResponse,
        routed: Routed,
        t0: float,
    ) -> None:
        """Copy SSE events to the client, timing the tokens as they pass."""
        rid = routed.request_id
        first_at = last = 0.0
        chunks = 0
        usage_tokens = None
        saw_done = False
        line: bytes | None = first
        while line is not None:
            if line.startswith(b"data: "):
                payload = line[6:].strip()
                if payload == b"[DONE]":
                    # Book the outcome before the client can see the end of its stream, so that
                    # a finished client never observes the request still in flight.
                    saw_done = True
                    out = usage_tokens if usage_tokens is not None else chunks
                    tpot = (last - first_at) / (out - 1) if out > 1 else 0.0
                    self._finished(routed, out, (first_at or time.monotonic()) - t0, tpot)
                else:
                    n, usage = _tokens_in(payload)
                    if usage is not None:
                        usage_tokens = usage
                    if n:
                        last = time.monotonic()
                        if not chunks:
                            first_at = last
                        chunks += n
                        self.service.progress(rid, chunks)
            try:
                await response.write(line)
            except (ConnectionResetError, RuntimeError) as exc:
                raise aiohttp.ClientConnectionError("client disconnected") from exc
            line = await anext(lines, None)
        if not saw_done:
            raise _UpstreamFailed(
                routed.decode.name if routed.decode else "?", "stream ended without [DONE]"
            )
        with contextlib.suppress(ConnectionResetError):  # a client gone after [DONE] lost nothing
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

    async def _stream_failed(
        self,
        request: web.Request,
        routed: Routed,
        exc: _UpstreamFailed,
        response: web.StreamResponse,
    ) -> web.StreamResponse:
        """A stream that broke after the client saw its first event: an error event, then
        [DONE], as vLLM ends a stream that fails."""
        self.metrics.upstream_failures.labels("decode").inc()
        if exc.blame_pod:
            self.service.pod_failed(exc.pod)
        self.service.failed(routed.request_id, str(exc))
        log.warning("decode stream of %s failed: %s", routed.request_id, exc)
        error = {"error": {"message": self._shown("decode failed", exc), "type": "BadGatewayError",
                           "param": None, "code": 502}}  # fmt: skip
        try:
            await response.write(f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode())
            await response.write_eof()
        except (ConnectionResetError, RuntimeError):
            pass
        return response


class _NotFound(BadRequest):
    pass


class _TooLarge(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(f"larger than max_body_bytes ({limit} bytes)")


class _Retryable(Exception):
    """A decode leg that failed before anything reached the client."""

    def __init__(self, failure: _UpstreamFailed) -> None:
        super().__init__(str(failure))
        self.failure = failure


def _too_long(pod: str) -> _UpstreamFailed:
    return _UpstreamFailed(pod, f"an event line over {MAX_SSE_LINE} bytes", blame_pod=False)


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
    choices = event.get("choices")
    for choice in choices if isinstance(choices, list) else ():
        delta = choice.get("delta") if isinstance(choice, dict) else None
        text = delta.get("content") if isinstance(delta, dict) else None
        if text is None and isinstance(choice, dict):
            text = choice.get("text")
        ids = choice.get("token_ids") if isinstance(choice, dict) else None
        if isinstance(ids, list) and ids:
            n += len(ids)
        elif text:
            n += 1
    return n, total if isinstance(total, int) else None
