"""The OpenAI-compatible front door: vLLM's two-step prefill -> decode handoff behind one URL.

For ``POST /v1/completions`` and ``/v1/chat/completions`` (streaming or not) it admits the request
(429 past `max_inflight`, before reading anything), reads and validates it (`openai_request`: 413
past `max_body_bytes`, 400 naming the field, vLLM's length checks against the pods'
`max_model_len` before any leg runs), asks the routing service for a (prefill, decode) pair and
runs the two legs (`legs`, which says what each failure becomes). With `priority_scheduling`, both
legs carry the decision's priority (`RouteDecision.priority`: 1 for a request predicted to miss
its TTFT anyway) on top of the client's, which is forwarded only with `forward_client_priority`.

With `auth.api_keys_file`, ``/v1/*`` needs ``Authorization: Bearer <key>`` (vLLM's `--api-key`
rule); the probes (`/livez`: the process and its supervised loops; `/readyz` and `/health`: the pool
usable, not draining, not standing by unless `?exclude=leader`) and `/metrics` stay open, as
vLLM's do. Too many requests in flight -> 429 with Retry-After; no healthy pod -> 503 with
Retry-After; every request ends in a response or an error and is counted.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Awaitable, Callable

import aiohttp
from aiohttp import web

from disaggpool.sidecar.auth import KeyFile, bearer_ok
from disaggpool.sidecar.legs import Legs, UpstreamFailed
from disaggpool.sidecar.openai_errors import openai_error, refused
from disaggpool.sidecar.openai_request import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    NotFound,
    TooLarge,
    check_length,
    model_list,
    parse,
)
from disaggpool.sidecar.service import BadRequest, RoutingService, ServiceError
from disaggpool.sidecar.supervise import Supervisor
from disaggpool.sidecar.tokens import PromptCounter, TokenizeError

__all__ = ["FrontDoor"]

log = logging.getLogger("disaggpool.sidecar.frontdoor")


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
        self.legs = Legs(service, session)
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
        app.router.add_get("/health", self._readyz)  # where probes written for vLLM look
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

    async def _livez(self, request: web.Request) -> web.Response:
        """Liveness: the process and its background loops (`sidecar.supervise`), nothing else;
        a pool with no healthy pod is a readiness matter, and restarting us would not fix it."""
        loops = self.supervisor.states() if self.supervisor is not None else {}
        alive = self.supervisor is None or self.supervisor.alive
        body = {"status": "ok" if alive else "a background loop is dead", "loops": loops}
        return web.json_response(body, status=200 if alive else 503)

    async def _readyz(self, request: web.Request) -> web.Response:
        """Readiness: healthy pods of both roles, not draining, and leading where replicas
        elect a leader; ``?exclude=leader`` (Kubernetes' own ``/readyz?exclude=`` convention)
        leaves out the last, for the kubelet where the leader steers traffic by the Service's
        Endpoints (`sidecar.leader`): a healthy standby is then Ready, so rollouts proceed."""
        excluded = set(request.query.getall("exclude", []))
        if not excluded <= {"leader"}:
            unknown = ", ".join(sorted(excluded - {"leader"}))
            return web.json_response(
                {"error": f"exclude: no such check {unknown!r}; the one that may be left out "
                 "is 'leader'"}, status=400,
            )  # fmt: skip
        standby = self.service.standby if "leader" not in excluded else ""
        ok = self.service.healthy_pods()
        serving = not self.service.draining and not standby
        status = 200 if ok["prefill"] and ok["decode"] and serving else 503
        if self.service.draining:
            why = "draining: shutting down"
        elif standby:
            why = standby  # another replica leads (sidecar.leader)
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
        return web.json_response(model_list(self.config.model, self.service.max_model_len()))

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4"}
        )

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

    async def _generate(self, endpoint: str, request: web.Request) -> web.StreamResponse:
        started = time.monotonic()
        try:
            body, prompt_seen, slo = await parse(endpoint, request, self.config, self.counter)
            max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
            if max_tokens is None and endpoint == "completions":
                max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
            check_length(body, prompt_seen.tokens, max_tokens, self.service.max_model_len())
        except TooLarge as exc:
            self.metrics.rejected.labels("bad_request").inc()
            return openai_error(413, f"body: {exc}", "body")
        except NotFound as exc:
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
            return refused(exc, self.metrics)
        if self.config.options.priority_scheduling:
            # Both legs carry it: the prefill pod queues by it, and so does the decode pod
            # (admission, preemption). A client's own priority stays when it is forwarded.
            body["priority"] = body.get("priority", 0) + routed.decision.priority
        if routed.prefill is None:  # the P/D decider's local path: the decode pod prefills
            return await self.legs.decode(request, endpoint, body, routed, started)
        try:
            params, routed = await self.legs.prefill(request, endpoint, body, routed)
            if routed.decode is None:  # late binding: the decode pod is chosen now
                routed = self.service.bind_decode(routed.request_id)
        except UpstreamFailed as exc:
            self.service.failed(request_id, str(exc))
            if exc.status is not None and exc.clients_fault:
                return web.Response(
                    status=exc.status, body=exc.body, content_type="application/json"
                )
            return openai_error(502, self.legs.shown("prefill failed", exc))
        except ServiceError as exc:  # no other prefill pod to retry on, or no decode pod
            self.service.failed(request_id, str(exc))
            return refused(exc, self.metrics)
        except BaseException:
            self.service.failed(request_id, "client disconnected during prefill")
            raise
        body["kv_transfer_params"] = params
        return await self.legs.decode(request, endpoint, body, routed, started)
