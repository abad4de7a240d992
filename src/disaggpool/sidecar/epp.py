"""The endpoint picker (EPP): the router behind Envoy, over Envoy's external-processing protocol.

A gateway that implements the Gateway API Inference Extension opens one bidirectional gRPC
`envoy.service.ext_proc.v3.ExternalProcessor/Process` stream per HTTP request and asks us where
it goes (docs/gateway.md has the protocol facts we rely on). One `_Exchange` per stream:

1. the request headers are recorded and not answered yet (full-duplex mode: header changes only
   take effect on the headers answer, so it waits for the decision). The client's API key is
   checked (`auth.api_keys_file`, 401) and the request admitted (`max_inflight`, 429) first;
2. body chunks are gathered up to `max_body_bytes` (413 past it); at its end the body is read
   exactly as the front door reads it (`openai_request.parse_body`, `check_length`: 400 naming
   the field, 404 for another model) and routed by the same `RoutingService` (429 when shed or
   overloaded, 503 when no pod is healthy), all within `gateway.decision_timeout_s` (503 past it);
3. the deferred headers answer clears the route cache and sets ``x-gateway-destination-endpoint``
   (the decode pod: its own host:port, or `gateway.destination_port` on its host), and
   ``x-prefiller-host-port`` (the prefill pod) when the decision has a remote prefill, else
   removes it; the destination also goes in the ``envoy.lb`` dynamic metadata. A client can
   never steer: both headers are always overwritten or removed. Then the body (as forwarded:
   the served model name, no ``slo_class``) goes back in chunks of at most 62,000 bytes;
4. the response passes through unchanged, and `epp_books.Books` books its outcome.

Buffered mode works too: the headers are answered at once, and the decision's header changes
ride on the body answer (the one place Envoy applies them in that mode). Envoy's subset hint
(``envoy.lb.subset_hint``) limits the decode pods to those listed (an empty list: 503). Refusals
are immediate responses in the OpenAI error shape. Requests other than ``POST
/v1/completions`` and ``/v1/chat/completions`` are answered here: ``GET /v1/models`` as the front
door answers it, anything else 404, so no pod is reached without a decision.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlparse

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from disaggpool.pdwire import (
    DESTINATION_HEADER,
    EXT_PROC_SERVICE,
    LB_NAMESPACE,
    PREFILLER_HEADER,
    SUBSET_KEY,
    SUBSET_NAMESPACE,
)
from disaggpool.sidecar.auth import KeyFile, bearer_ok
from disaggpool.sidecar.config import Member
from disaggpool.sidecar.epp_books import Books
from disaggpool.sidecar.openai_errors import error_body, refusal
from disaggpool.sidecar.openai_request import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    NotFound,
    check_length,
    model_list,
    parse_body,
)
from disaggpool.sidecar.service import BadRequest, Routed, RoutingService, ServiceError
from disaggpool.sidecar.tokens import PromptCounter, TokenizeError

__all__ = [
    "CHUNK_BYTES",
    "DESTINATION_HEADER",
    "EXT_PROC_SERVICE",
    "PREFILLER_HEADER",
    "SUBSET_KEY",
    "ExtProcServicer",
    "destination",
]

log = logging.getLogger("disaggpool.sidecar.epp")

CHUNK_BYTES = 62_000  # the largest body chunk sent back; Envoy takes more, other gateways may not
_ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
_Mode = processing_mode_pb2.ProcessingMode
_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def destination(member: Member, port: int = 0) -> str:
    """Where the gateway sends a request for `member`: ``host:port`` from its URL, or `port`
    on its host (`gateway.destination_port`); an IPv6 host in brackets."""
    url = urlparse(member.url)
    host = url.hostname or ""
    if not port:
        port = url.port or (443 if url.scheme == "https" else 80)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class _Refused(Exception):
    """An immediate answer instead of a decision."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.headers = headers or {}


class ExtProcServicer:
    """`Process`: one exchange per HTTP request (module docstring); registered with
    `external_processor_pb2_grpc.add_ExternalProcessorServicer_to_server`."""

    def __init__(self, service: RoutingService, counter: PromptCounter) -> None:
        self.service = service
        self.counter = counter
        self.config = service.config
        self.metrics = service.metrics
        self.keys = KeyFile(service.config.auth.api_keys_file)
        self.admitted = 0  # generation requests past admission whose stream has not ended

    async def Process(
        self,
        request_iterator: AsyncIterator[pb.ProcessingRequest],
        context: grpc.aio.ServicerContext[pb.ProcessingRequest, pb.ProcessingResponse],
    ) -> AsyncIterator[pb.ProcessingResponse]:
        exchange = _Exchange(self)
        try:
            async for message in request_iterator:
                for answer in await exchange.on(message):
                    yield answer
        finally:
            exchange.close()


class _Exchange:
    """One Process stream: one HTTP request and its response."""

    def __init__(self, picker: ExtProcServicer) -> None:
        self.picker = picker
        self.service = picker.service
        self.config = picker.config
        self.started = time.monotonic()
        self.request_mode = _Mode.FULL_DUPLEX_STREAMED
        self.response_mode = _Mode.FULL_DUPLEX_STREAMED
        self.headers: dict[str, str] = {}
        self.endpoint = ""
        self.body = bytearray()
        self.subset: list[str] | None = None
        self.admitted = False
        self.decided = False
        self.books: Books | None = None

    # ------------------------------------------------------------------ dispatch
    async def on(self, m: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        if m.HasField("protocol_config"):  # on the first message only
            self.request_mode = m.protocol_config.request_body_mode
            self.response_mode = m.protocol_config.response_body_mode
        hint = _subset_hint(m)
        if hint is not None:
            self.subset = hint
        kind = m.WhichOneof("request")
        try:
            if kind == "request_headers":
                return await self._request_headers(m.request_headers)
            if kind == "request_body":
                return await self._request_body(m.request_body)
            if kind == "request_trailers":
                return await self._request_trailers()
        except _Refused as refused:
            return [self._refuse(refused)]
        if kind == "response_headers":
            return [self._response_headers(m.response_headers)]
        if kind == "response_body":
            return [self._response_body(m.response_body)]
        if kind == "response_trailers":
            if self.books is not None:
                self.books.ended()
            return [pb.ProcessingResponse(response_trailers=pb.TrailersResponse())]
        return []  # a message with nothing to answer (none is sent today)

    def close(self) -> None:
        """The stream ended: book what is still open, release admission."""
        if self.books is not None:
            self.books.abandoned("the gateway ended the exchange before the answer finished")
        if self.admitted:
            self.admitted = False
            self.picker.admitted -= 1

    # ------------------------------------------------------------------ request phase
    async def _request_headers(self, h: pb.HttpHeaders) -> list[pb.ProcessingResponse]:
        self.headers = _header_map(h)
        path = self.headers.get(":path", "").partition("?")[0]
        method = self.headers.get(":method", "")
        self.endpoint = _ENDPOINTS.get(path, "") if method == "POST" else ""
        keys = self.picker.keys
        # Every request through the gateway needs a key (the probes are not served here).
        if self.config.auth.api_keys_file and not bearer_ok(
            self.headers.get("authorization"), keys.keys()
        ):
            self.picker.metrics.auth_failures.labels("gateway").inc()
            raise _Refused(
                401,
                "authorization: a valid API key is required (Authorization: Bearer <key>)",
                "authorization",
                {"www-authenticate": "Bearer"},
            )
        if self.request_mode not in (_Mode.FULL_DUPLEX_STREAMED, _Mode.BUFFERED):
            # Other modes apply no header change made after the headers answer: no decision
            # could reach Envoy. A configuration error, said as such.
            raise _Refused(500, "the gateway's ext_proc request_body_mode must be "
                           "FULL_DUPLEX_STREAMED or BUFFERED")  # fmt: skip
        if not self.endpoint:
            return [self._not_generation(method, path)]
        if self.picker.admitted >= self.config.max_inflight:
            self.service.metrics.rejected.labels("overload").inc()
            raise _Refused(
                429,
                f"{self.picker.admitted} requests in flight (max_inflight)",
                headers={"retry-after": "1"},
            )
        self.admitted = True
        self.picker.admitted += 1
        if h.end_of_stream:  # a POST without a body: the parser says what is missing
            return await self._decide()
        if self.request_mode == _Mode.FULL_DUPLEX_STREAMED:
            return []  # answered with the decision, once the body has been read
        return [pb.ProcessingResponse(request_headers=pb.HeadersResponse())]

    async def _request_body(self, b: pb.HttpBody) -> list[pb.ProcessingResponse]:
        if self.decided:  # not expected: the decision waits for the body's end
            return [self._body_answer(b.body, b.end_of_stream)]
        self.body += b.body
        if len(self.body) > self.config.max_body_bytes:
            self.service.metrics.rejected.labels("bad_request").inc()
            limit = self.config.max_body_bytes
            raise _Refused(413, f"body: larger than max_body_bytes ({limit} bytes)", "body")
        if not b.end_of_stream:
            return []
        return await self._decide()

    async def _request_trailers(self) -> list[pb.ProcessingResponse]:
        out = [] if self.decided else await self._decide(trailers=True)
        return [*out, pb.ProcessingResponse(request_trailers=pb.TrailersResponse())]

    def _not_generation(self, method: str, path: str) -> pb.ProcessingResponse:
        """What is not a generation request is answered here, never sent to a pod."""
        if method == "GET" and path == "/v1/models":
            listing = model_list(self.config.model, self.service.max_model_len())
            body = json.dumps(listing).encode()
            self._count("models", "200")
            return _immediate(200, body, {})
        self._count("other", "404")
        message = f"{method} {path}: the gateway serves POST /v1/completions, /v1/chat/completions"
        return _immediate(404, error_body(404, message), {})

    async def _decide(self, *, trailers: bool = False) -> list[pb.ProcessingResponse]:
        """Parse, route, and answer the deferred headers and the body (module docstring)."""
        self.decided = True
        body, routed = await self._route()
        raw = json.dumps(body).encode()
        mutation = self._mutation(routed, len(raw))
        assert routed.decode is not None, "the endpoint picker binds the decode pod at once"
        dest = destination(routed.decode, self.config.gateway.destination_port)
        metadata = struct_pb2.Struct()
        metadata.update({LB_NAMESPACE: {DESTINATION_HEADER: dest}})
        common = pb.CommonResponse(clear_route_cache=True, header_mutation=mutation)
        self.books = Books(self.service, routed, self.started)
        self._count(self.endpoint, "routed")
        if self.request_mode != _Mode.FULL_DUPLEX_STREAMED:
            # Buffered: the headers were answered already; the changes ride on the body answer.
            common.body_mutation.body = raw
            return [pb.ProcessingResponse(request_body=pb.BodyResponse(response=common),
                                          dynamic_metadata=metadata)]  # fmt: skip
        out = [
            pb.ProcessingResponse(
                request_headers=pb.HeadersResponse(response=common), dynamic_metadata=metadata
            )
        ]
        for start in range(0, max(len(raw), 1), CHUNK_BYTES):
            last = start + CHUNK_BYTES >= len(raw)
            out.append(self._body_answer(raw[start : start + CHUNK_BYTES], last and not trailers))
        return out

    async def _route(self) -> tuple[dict[str, Any], Routed]:
        config, svc = self.config, self.service
        try:
            async with asyncio.timeout(config.gateway.decision_timeout_s):
                body, prompt, slo = await parse_body(
                    self.endpoint, bytes(self.body), self.headers.get("x-slo-class"),
                    config, self.picker.counter,
                )  # fmt: skip
                max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
                if max_tokens is None and self.endpoint == "completions":
                    max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
                check_length(body, prompt.tokens, max_tokens, svc.max_model_len())
        except NotFound as exc:
            svc.metrics.rejected.labels("bad_request").inc()
            raise _Refused(404, str(exc), exc.field) from None
        except BadRequest as exc:
            svc.metrics.rejected.labels("bad_request").inc()
            raise _Refused(400, f"{exc.field}: {exc}", exc.field) from None
        except TokenizeError as exc:
            svc.metrics.rejected.labels("no_capacity").inc()
            log.warning("cannot measure a prompt: %s", exc)
            shown = str(exc) if config.debug_errors else "no pod could tokenize the prompt"
            raise _Refused(503, shown, headers={"retry-after": "5"}) from None
        except TimeoutError:
            svc.metrics.rejected.labels("no_capacity").inc()
            raise _Refused(
                503,
                f"no decision within gateway.decision_timeout_s "
                f"({config.gateway.decision_timeout_s:g} s)",
                headers={"retry-after": "1"},
            ) from None
        request_id = self.headers.get("x-request-id") or uuid.uuid4().hex
        excluded = self._excluded()
        try:
            routed = svc.route(
                request_id,
                prompt.tokens,
                slo,
                max_tokens=max_tokens,
                token_ids=prompt.ids,
                exclude_decode=excluded,
                bind_late=False,  # the destination is the decode pod: it is chosen now
            )
        except ServiceError as exc:
            status, message, param, headers = refusal(exc, svc.metrics)
            lowered = {k.lower(): v for k, v in headers.items()}
            raise _Refused(status, message, param, lowered) from None
        if config.options.priority_scheduling:
            body["priority"] = body.get("priority", 0) + routed.decision.priority
        return body, routed

    def _excluded(self) -> tuple[str, ...]:
        """The decode pods outside Envoy's subset hint (none without a hint)."""
        if self.subset is None:
            return ()
        if not self.subset:
            self.service.metrics.rejected.labels("no_capacity").inc()
            raise _Refused(503, "the gateway's subset hint lists no endpoint",
                           headers={"retry-after": "5"})  # fmt: skip
        allowed = set(self.subset)
        port = self.config.gateway.destination_port
        decode = self.service.state.members("decode")
        out = tuple(i.name for i in decode if destination(i.member, port) not in allowed)
        if len(out) == len(decode):
            self.service.metrics.rejected.labels("no_capacity").inc()
            raise _Refused(503, "no pod of the gateway's subset hint is in the pool",
                           headers={"retry-after": "5"})  # fmt: skip
        return out

    def _mutation(self, routed: Routed, length: int) -> pb.HeaderMutation:
        """The headers the decision sets and removes (a client's own are never kept)."""
        assert routed.decode is not None, "the endpoint picker binds the decode pod at once"
        port = self.config.gateway.destination_port
        sets = {
            DESTINATION_HEADER: destination(routed.decode, port),
            "x-request-id": routed.request_id,
            "content-length": str(length),
        }
        removes = []
        if routed.prefill is not None:
            sets[PREFILLER_HEADER] = destination(routed.prefill)
        else:
            removes.append(PREFILLER_HEADER)
        upstream = self.service.upstream_headers()
        if upstream:
            sets["authorization"] = upstream["Authorization"]  # the pods' own key
        elif self.config.auth.api_keys_file:
            removes.append("authorization")  # the client's key is the router's, no further
        return pb.HeaderMutation(
            set_headers=[
                base_pb2.HeaderValueOption(
                    header=base_pb2.HeaderValue(key=k, raw_value=v.encode()),
                    append_action=_OVERWRITE,
                )
                for k, v in sets.items()
            ],
            remove_headers=removes,
        )

    def _body_answer(self, chunk: bytes, end: bool) -> pb.ProcessingResponse:
        mutation = pb.BodyMutation(
            streamed_response=pb.StreamedBodyResponse(body=chunk, end_of_stream=end)
        )
        return pb.ProcessingResponse(
            request_body=pb.BodyResponse(response=pb.CommonResponse(body_mutation=mutation))
        )

    def _refuse(self, refused: _Refused) -> pb.ProcessingResponse:
        self._count(self.endpoint or "other", str(refused.status))
        body = error_body(refused.status, str(refused), refused.param)
        return _immediate(refused.status, body, refused.headers)

    def _count(self, endpoint: str, code: str) -> None:
        self.service.metrics.epp_decisions.labels(endpoint, code).inc()

    # ------------------------------------------------------------------ response phase
    def _response_headers(self, h: pb.HttpHeaders) -> pb.ProcessingResponse:
        headers = _header_map(h)
        status = headers.get(":status", "0")
        self.service.metrics.epp_responses.labels(status).inc()
        if self.books is not None:
            code = int(status) if status.isdigit() else 0
            self.books.headers(code, headers.get("content-type", ""))
            if h.end_of_stream:
                self.books.ended()
        return pb.ProcessingResponse(response_headers=pb.HeadersResponse())

    def _response_body(self, b: pb.HttpBody) -> pb.ProcessingResponse:
        if self.books is not None:
            self.books.body(b.body, b.end_of_stream)
        if self.response_mode == _Mode.FULL_DUPLEX_STREAMED:
            mutation = pb.BodyMutation(
                streamed_response=pb.StreamedBodyResponse(
                    body=b.body, end_of_stream=b.end_of_stream
                )
            )
            return pb.ProcessingResponse(
                response_body=pb.BodyResponse(response=pb.CommonResponse(body_mutation=mutation))
            )
        return pb.ProcessingResponse(response_body=pb.BodyResponse())


def _header_map(h: pb.HttpHeaders) -> dict[str, str]:
    """Lower-cased names to values (Envoy sends `raw_value`; older versions `value`)."""
    out: dict[str, str] = {}
    for header in h.headers.headers:
        value = header.raw_value.decode("utf-8", "replace") if header.raw_value else header.value
        out[header.key.lower()] = value
    return out


def _subset_hint(m: pb.ProcessingRequest) -> list[str] | None:
    """The endpoints Envoy allows (`envoy.lb.subset_hint`), or None when it sent no hint."""
    ns = m.metadata_context.filter_metadata
    if SUBSET_NAMESPACE not in ns:
        return None
    value = ns[SUBSET_NAMESPACE].fields.get(SUBSET_KEY)
    if value is None:
        return None
    if value.WhichOneof("kind") == "string_value":  # one endpoint, or a comma-separated list
        return [part.strip() for part in value.string_value.split(",") if part.strip()]
    return [v.string_value for v in value.list_value.values if v.string_value]


def _immediate(status: int, body: bytes, headers: dict[str, str]) -> pb.ProcessingResponse:
    sets = [
        base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key=k, raw_value=v.encode()), append_action=_OVERWRITE
        )
        for k, v in {"content-type": "application/json", **headers}.items()
    ]
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=pb.HeaderMutation(set_headers=sets),
            body=body,
            details="disaggpool_epp",
        )
    )
