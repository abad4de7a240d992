"""The upstream legs of one request: vLLM's prefill leg, then the decode leg, against the pods.

Follows `docs/vllm-protocol.md` §2.1 to the letter (one leg's mechanics are in `upstream`, shared
with the decode-side P/D proxy, `disaggpool.pdproxy`):

1. the prefill leg: the body with ``kv_transfer_params = {do_remote_decode: true,
   do_remote_prefill: false, remote_engine_id/remote_block_ids/remote_host/remote_port: null}``,
   ``stream: false``, ``max_tokens: 1`` (and ``max_completion_tokens: 1`` if present), without
   ``stream_options``, ``min_tokens`` and ``min_completion_tokens``; same ``X-Request-Id`` on
   both legs;
2. the decode leg: the client's body unchanged except for the prefill response's
   ``kv_transfer_params``, passed through untouched; its bytes stream back to the client.

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
* the client disconnects -> the upstream request is closed, which makes vLLM abort it.
Error bodies name no pod and no address unless `debug_errors` (the log always does).

SLO judgement: streamed responses on the measured TTFT (to the first decode token) and TPOT; a
non-streaming response has no token timing, so it meets its SLO when its total latency is within
``ttft_s + (n - 1) * tpot_s`` for its n output tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from aiohttp import web

from disaggpool.pdwire import DECODE_POD_HEADER, PREFILL_POD_HEADER
from disaggpool.sidecar.openai_errors import openai_error, refused
from disaggpool.sidecar.service import Routed, RoutingService, ServiceError
from disaggpool.sidecar.upstream import MAX_SSE_LINE, Upstream, UpstreamFailed, prefill_leg_body

__all__ = ["MAX_SSE_LINE", "Legs", "UpstreamFailed", "tokens_in"]

log = logging.getLogger("disaggpool.sidecar.frontdoor")


class Legs:
    """Runs the legs of the front door's requests over one HTTP session (module docstring)."""

    def __init__(self, service: RoutingService, session: aiohttp.ClientSession) -> None:
        self.service = service
        self.session = session
        self.config = service.config
        self.metrics = service.metrics
        self.timeouts = service.config.upstream_timeouts
        self.upstream = Upstream(session, self.timeouts)  # one leg's mechanics, shared

    def headers(self, request: web.Request, request_id: str) -> dict[str, str]:
        headers = {"X-Request-Id": request_id, "Content-Type": "application/json"}
        upstream = self.service.upstream_headers()
        if upstream:
            headers.update(upstream)  # the pods' own key (vLLM's --api-key)
        elif not self.config.auth.api_keys_file and "Authorization" in request.headers:
            # No keys of our own: pass the client's through, as vLLM's reference proxy does. With
            # keys of our own, the client's key is the router's and goes no further.
            headers["Authorization"] = request.headers["Authorization"]
        return headers

    def shown(self, what: str, exc: UpstreamFailed) -> str:
        """An upstream failure as the client reads it: how it failed; which pod only when
        `debug_errors` (pod names and addresses are the cluster's business)."""
        return f"{what}: {exc}" if self.config.debug_errors else f"{what}: {exc.kind}"

    async def prefill(
        self, request: web.Request, endpoint: str, body: dict[str, Any], routed: Routed
    ) -> tuple[Any, Routed]:
        leg = prefill_leg_body(body)
        path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
        headers = self.headers(request, routed.request_id)
        tried: list[str] = []
        while True:
            pod = routed.prefill
            assert pod is not None, "a local-path request has no prefill leg"
            try:
                params = await self.upstream.prefill_leg(pod.name, f"{pod.url}{path}", leg, headers)
                self.service.prefilled(routed.request_id)
                return params, routed
            except UpstreamFailed as exc:
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

    async def decode(
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
                return openai_error(504, self.shown("decode failed", exc))
            if attempt >= self.config.decode_attempts:
                self.service.failed(routed.request_id, str(exc))
                return openai_error(502, self.shown("decode failed", exc))
            local = routed.prefill is None or not exc.never_sent
            try:
                routed = self.service.retry_decode(routed, exc.pod, local=local)
            except ServiceError as rejection:
                self.service.failed(routed.request_id, f"{exc}; no decode pod to retry on")
                return refused(rejection, self.metrics)
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
        # With `served_by_headers`, which pods served it, for a client scoring results per pod
        # (`loadgen --json`); no prefill pod on the local path, where the decode pod prefilled.
        served: dict[str, str] = {}
        if self.config.served_by_headers:
            served[DECODE_POD_HEADER] = pod.name
            if routed.prefill is not None:
                served[PREFILL_POD_HEADER] = routed.prefill.name
        path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
        stream = bool(body.get("stream"))
        deadline = asyncio.get_running_loop().time() + self.timeouts.total_s
        response: web.StreamResponse | None = None
        up: aiohttp.ClientResponse | None = None
        complete = False  # the answer was read to its end: its connection may be pooled again
        try:
            up = await self.upstream.open(
                pod.name, f"{pod.url}{path}", body, self.headers(request, rid), first_byte=stream
            )
            if up.status != 200:
                raw = await self.upstream.read_whole(pod.name, up, deadline)
                # A pod that answers an error is alive (vLLM's 500 for a KV it could not load
                # is its prefill pod's doing): retried elsewhere, not ejected.
                failed = UpstreamFailed(pod.name, f"HTTP {up.status}", status=up.status,
                                         body=raw, blame_pod=False)  # fmt: skip
                complete = True
                if failed.clients_fault:
                    self.service.failed(rid, str(failed))
                    return web.Response(status=up.status, body=raw, content_type="application/json")
                raise failed
            if not stream:
                raw = await self.upstream.read_whole(pod.name, up, deadline)
                complete = True
                self._finish_whole(routed, raw, started)
                return web.Response(
                    body=raw, status=200, content_type="application/json", headers=served
                )
            content_type = up.headers.get("Content-Type", "text/event-stream")
            lines = self.upstream.sse_lines(pod.name, up, deadline)
            first = await anext(lines, None)
            if first is None:
                raise UpstreamFailed(pod.name, "a stream that ended before its first event")
            # Only now does the client's response start: every failure before it was retryable.
            response = web.StreamResponse(headers={"Content-Type": content_type, **served})
            await response.prepare(request)
            await self._relay(first, lines, response, routed, started)
            complete = True
            return response
        except UpstreamFailed as exc:
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
                    n, usage = tokens_in(payload)
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
            raise UpstreamFailed(
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
        exc: UpstreamFailed,
        response: web.StreamResponse,
    ) -> web.StreamResponse:
        """A stream that broke after the client saw its first event: an error event, then
        [DONE], as vLLM ends a stream that fails."""
        self.metrics.upstream_failures.labels("decode").inc()
        if exc.blame_pod:
            self.service.pod_failed(exc.pod)
        self.service.failed(routed.request_id, str(exc))
        log.warning("decode stream of %s failed: %s", routed.request_id, exc)
        error = {"error": {"message": self.shown("decode failed", exc), "type": "BadGatewayError",
                           "param": None, "code": 502}}  # fmt: skip
        try:
            await response.write(f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode())
            await response.write_eof()
        except (ConnectionResetError, RuntimeError):
            pass
        return response


class _Retryable(Exception):
    """A decode leg that failed before anything reached the client."""

    def __init__(self, failure: UpstreamFailed) -> None:
        super().__init__(str(failure))
        self.failure = failure


def tokens_in(payload: bytes) -> tuple[int, int | None]:
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
