"""The gRPC adapter: `disaggpool.router.v1.Router` over grpc.aio, plus health and reflection.

A thin adapter: bytes that do not decode as the request message get INVALID_ARGUMENT (the
handlers are registered with forgiving deserialisers; grpc's default would answer UNKNOWN); then
it checks the message (INVALID_ARGUMENT naming the field for anything the
service would not accept), converts it, calls `RoutingService`, converts back. Service errors map
to RESOURCE_EXHAUSTED (overload), UNAVAILABLE (no healthy pod, tokenizer unreachable) and
ALREADY_EXISTS (a request id already in flight). The standard `grpc.health.v1` service reports
SERVING while both pools have a healthy pod; server reflection lets `grpcurl` list the API.

A `Route` books the request under its caller (the peer address, `auth.peer_host`): gRPC bookings
have limits and a lease of their own (`RoutingService`), which `Report`s renew. Credentials (a
token or client certificates) are checked before any handler runs (`sidecar.auth`).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from disaggpool.router.v1 import router_pb2 as pb
from disaggpool.router.v1 import router_pb2_grpc as pb_grpc
from disaggpool.sidecar.auth import peer_host
from disaggpool.sidecar.service import (
    BadRequest,
    Duplicate,
    NoCapacity,
    Overloaded,
    Routed,
    RoutingService,
    ServiceError,
    Shed,
)
from disaggpool.sidecar.tokens import Prompt, PromptCounter, TokenizeError

__all__ = ["SERVICE_NAME", "RouterServicer", "add_router", "health_status"]

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Router"].full_name
_CODES = {
    BadRequest: grpc.StatusCode.INVALID_ARGUMENT,
    Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Shed: grpc.StatusCode.RESOURCE_EXHAUSTED,
    NoCapacity: grpc.StatusCode.UNAVAILABLE,
    Duplicate: grpc.StatusCode.ALREADY_EXISTS,
}
MAX_PROMPT_TOKENS = 10_000_000


class _Malformed:
    """What a forgiving deserialiser returns for bytes that are not the expected message."""

    def __init__(self, message_type: str, error: str) -> None:
        self.detail = f"request: not a valid {message_type} ({error})"


def _forgiving(cls: type[Message]) -> Callable[[bytes], Message | _Malformed]:
    def deserialize(data: bytes) -> Message | _Malformed:
        try:
            return cls.FromString(data)
        except DecodeError as exc:
            return _Malformed(cls.DESCRIPTOR.name, str(exc))

    return deserialize


Handler = Callable[[Any, grpc.aio.ServicerContext[object, object]], Awaitable[Message]]


def _checked(handler: Handler) -> Handler:
    async def call(request: Any, context: grpc.aio.ServicerContext[object, object]) -> Message:
        if isinstance(request, _Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.detail)
        return await handler(request, context)

    return call


class RouterServicer(pb_grpc.RouterServicer):
    def __init__(self, service: RoutingService, counter: PromptCounter) -> None:
        self.service = service
        self.counter = counter

    async def _abort(
        self, context: grpc.aio.ServicerContext[object, object], exc: ServiceError
    ) -> None:
        code = _CODES.get(type(exc), grpc.StatusCode.INVALID_ARGUMENT)
        detail = f"{exc.field}: {exc}" if exc.field else str(exc)
        await context.abort(code, detail)

    async def Route(
        self, request: pb.RouteRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> pb.RouteResponse:
        try:
            if bool(request.prompt_tokens) == bool(request.prompt_text):
                raise BadRequest("give exactly one of prompt_tokens and prompt_text", "prompt")
            if request.prompt_tokens > MAX_PROMPT_TOKENS:
                raise BadRequest(f"must be at most {MAX_PROMPT_TOKENS}", "prompt_tokens")
            if request.prompt_tokens:
                prompt = Prompt(request.prompt_tokens)
            else:
                prompt = await self.counter.completion(request.prompt_text)
            routed = self.service.route(
                request.request_id,
                prompt.tokens,
                request.slo_class,
                max_tokens=request.max_tokens or None,
                exclude_prefill=tuple(request.exclude_prefill),
                token_ids=prompt.ids,
                bind_late=request.bind_decode_late,
                client=peer_host(context.peer()),
            )
        except ServiceError as exc:
            await self._abort(context, exc)
            raise AssertionError("unreachable: abort raises") from exc
        except TokenizeError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
            raise AssertionError("unreachable: abort raises") from exc
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"prompt_text: {exc}")
            raise AssertionError("unreachable: abort raises") from exc
        return _response(routed)

    async def BindDecode(
        self, request: pb.BindDecodeRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> pb.RouteResponse:
        try:
            routed = self.service.bind_decode(request.request_id)
        except ServiceError as exc:
            await self._abort(context, exc)
            raise AssertionError("unreachable: abort raises") from exc
        return _response(routed)

    async def Report(
        self, request: pb.ReportRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> pb.ReportResponse:
        svc = self.service
        rid = request.request_id
        if not rid:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: required")
        for name in ("ttft_s", "tpot_s"):
            value = getattr(request, name)
            if not math.isfinite(value) or value < 0:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, f"{name}: must be finite and >= 0"
                )
        stage = request.stage
        if stage == pb.STAGE_PREFILLED:
            known = svc.prefilled(rid)
        elif stage == pb.STAGE_DECODING:
            known = svc.progress(rid, max(1, request.output_tokens))
        elif stage == pb.STAGE_FINISHED:
            known = svc.finished(rid, request.output_tokens, request.ttft_s, request.tpot_s)
        elif stage == pb.STAGE_FAILED:
            known = svc.failed(rid, request.error)
        else:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "stage: must be PREFILLED, DECODING, FINISHED or FAILED",
            )
        return pb.ReportResponse(known=known)

    async def GetPoolSnapshot(
        self, request: pb.GetPoolSnapshotRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> pb.PoolSnapshot:
        svc = self.service
        now = svc.clock()
        view = svc.state.snapshot(now)
        out = pb.PoolSnapshot(
            policy=svc.policy.name,
            inflight=svc.inflight,
            traffic_heterogeneity=svc.spread.cv,
        )
        for role, snaps, target in (
            ("prefill", view.prefill, out.prefill),
            ("decode", view.decode, out.decode),
        ):
            for s in snaps:
                inst = svc.state.instances[s.name]
                g = inst.gauges
                p = s.profile
                target.append(
                    pb.InstanceState(
                        name=s.name,
                        role=role,
                        url=inst.member.url,
                        healthy=s.healthy,
                        running=s.running,
                        waiting=s.waiting,
                        kv_tokens_used=max(0, s.kv_tokens_used),
                        kv_capacity_tokens=g.kv_capacity_tokens if g else 0,
                        inflight=s.inflight,
                        queued=max(0, s.queued),
                        queued_tokens=max(0, s.queued_tokens),
                        remaining_output_tokens=s.remaining_output_tokens,
                        profile_name=p.name if p else "",
                        profile_quality=p.quality if p else "",
                        profile_age_s=now - inst.profile_loaded_at if p else 0.0,
                        profile_trusted=bool(p and p.trusted),
                        last_scrape_age_s=now - inst.scraped_at if g else -1.0,
                    )
                )
        return out


def _response(routed: Routed) -> pb.RouteResponse:
    """The wire form of a decision; a pod left out is an endpoint left unset (see the proto)."""
    d = routed.decision
    resp = pb.RouteResponse(
        request_id=routed.request_id,
        policy=d.policy,
        slo_class=routed.slo.name,
        predicted_output_tokens=routed.predicted_output_tokens,
        guarded=d.guarded,
        fallback=d.fallback or "",
        priority=d.priority,
    )
    if routed.prefill is not None:
        resp.prefill.CopyFrom(pb.Endpoint(name=routed.prefill.name, url=routed.prefill.url))
    if routed.decode is not None:
        resp.decode.CopyFrom(pb.Endpoint(name=routed.decode.name, url=routed.decode.url))
    if d.predicted_ttft_s is not None and math.isfinite(d.predicted_ttft_s):
        resp.predicted_ttft_s = d.predicted_ttft_s
    if d.predicted_tpot_s is not None and math.isfinite(d.predicted_tpot_s):
        resp.predicted_tpot_s = d.predicted_tpot_s
    if d.slo_feasible is not None:
        resp.slo_feasible = d.slo_feasible
    return resp


def health_status(service: RoutingService) -> int:
    ok = all(service.healthy_pods().values()) and not service.draining and not service.standby
    codes = health_pb2.HealthCheckResponse
    return int(codes.SERVING if ok else codes.NOT_SERVING)


def add_router(
    server: grpc.aio.Server, service: RoutingService, counter: PromptCounter
) -> health.aio.HealthServicer:
    """Register the router, health and reflection services on `server`."""
    servicer = RouterServicer(service, counter)
    methods: dict[str, tuple[Handler, type[Message]]] = {
        "Route": (servicer.Route, pb.RouteRequest),
        "BindDecode": (servicer.BindDecode, pb.BindDecodeRequest),
        "Report": (servicer.Report, pb.ReportRequest),
        "GetPoolSnapshot": (servicer.GetPoolSnapshot, pb.GetPoolSnapshotRequest),
    }
    handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {
        name: grpc.unary_unary_rpc_method_handler(
            _checked(fn),
            request_deserializer=_forgiving(cls),
            response_serializer=lambda m: m.SerializeToString(),
        )
        for name, (fn, cls) in methods.items()
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    return health_servicer
