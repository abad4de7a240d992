"""What the endpoint picker learns from the response phase: one request's outcome, booked once.

Behind Envoy the router does not run the legs (`sidecar.legs` does at the front door); it only
sees the answer pass through its ext_proc stream. `Books` reads that answer as the front door
reads its decode leg, and reports to the routing service, so the ledger, goodput, drift and the
autoscaler see the request as they would behind the front door:

* the response headers: a status outside 2xx is the request's failure (booked `failed`); a 2xx
  means the prefill leg (run by `disaggpool pd-proxy` beside the decode pod) has answered;
* a server-sent event stream (``text/event-stream``): each ``data:`` event's tokens are counted
  (`legs.tokens_in`) and reported as progress, the first one timing the TTFT; ``data: [DONE]``
  books it `finished` with the usage's completion tokens when given, TTFT and TPOT;
* a JSON answer: buffered (at most `MAX_JSON_BYTES`) and read at its end for
  ``usage.completion_tokens``; with no token timing it meets its SLO when its total time is
  within ``ttft_s + (n - 1) * tpot_s``, the front door's rule;
* an answer that ends otherwise (a stream without ``[DONE]``, JSON that does not parse) is
  `failed`; a Process stream that ends before the answer did (the client left, or Envoy lost
  the upstream: Envoy does not say which) is booked `failed` as aborted, outside goodput.

Every path books exactly once (`done`), so nothing stays in the ledger.
"""

from __future__ import annotations

import json
import time

from disaggpool.sidecar.legs import MAX_SSE_LINE, tokens_in
from disaggpool.sidecar.service import Routed, RoutingService

__all__ = ["MAX_JSON_BYTES", "Books"]

MAX_JSON_BYTES = 16 * 1024 * 1024  # a non-streamed answer larger than this is not parsed


class Books:
    """The outcome of one routed request, read from its response (module docstring)."""

    def __init__(self, service: RoutingService, routed: Routed, started: float) -> None:
        self.service = service
        self.routed = routed
        self.started = started  # monotonic time the request's headers reached the picker
        self.done = False
        self.status = 0
        self.stream = False
        self._buf = bytearray()
        self._json = bytearray()
        self._too_big = False
        self._chunks = 0
        self._usage: int | None = None
        self._first_at = 0.0
        self._last_at = 0.0

    @property
    def request_id(self) -> str:
        return self.routed.request_id

    def headers(self, status: int, content_type: str) -> None:
        """The response's headers: its status and content type."""
        self.status = status
        if self.done:
            return
        if not 200 <= status < 300:
            self.service.metrics.upstream_failures.labels("decode").inc()
            self.fail(f"HTTP {status} through the gateway")
            return
        if self.routed.prefill is not None:
            self.service.prefilled(self.request_id)
        self.stream = content_type.split(";")[0].strip().lower() == "text/event-stream"

    def body(self, chunk: bytes, end: bool) -> None:
        """A chunk of the response body; `end`: the last one."""
        if self.done:
            return
        if self.stream:
            self._sse(chunk)
            if end and not self.done:
                if self._buf:
                    self._line(bytes(self._buf))
                if not self.done:
                    self.fail("stream ended without [DONE]")
            return
        if len(self._json) + len(chunk) > MAX_JSON_BYTES:
            self._too_big = True
        elif not self._too_big:
            self._json += chunk
        if end:
            self._whole()

    def ended(self) -> None:
        """The response ended with no body (headers or trailers carried its end)."""
        if not self.done:
            if self.stream:
                self.fail("stream ended without [DONE]")
            else:
                self._whole()

    def abandoned(self, why: str) -> None:
        """The Process stream ended before the answer did."""
        if not self.done:
            self.done = True
            self.service.failed(self.request_id, why, aborted=True)

    def fail(self, why: str) -> None:
        if not self.done:
            self.done = True
            self.service.failed(self.request_id, why)

    # ------------------------------------------------------------------ reading
    def _sse(self, chunk: bytes) -> None:
        self._buf += chunk
        start = 0
        while (end := self._buf.find(b"\n", start)) >= 0:
            self._line(bytes(self._buf[start : end + 1]))
            start = end + 1
            if self.done:
                break
        del self._buf[:start]
        if len(self._buf) > MAX_SSE_LINE and not self.done:
            self.fail(f"an event line over {MAX_SSE_LINE} bytes")

    def _line(self, line: bytes) -> None:
        if not line.startswith(b"data: "):
            return
        payload = line[6:].strip()
        if payload == b"[DONE]":
            out = self._usage if self._usage is not None else self._chunks
            tpot = (self._last_at - self._first_at) / (out - 1) if out > 1 else 0.0
            ttft = (self._first_at or time.monotonic()) - self.started
            self.done = True
            d = self.routed.decision
            self.service.finished(
                self.request_id, out, ttft, tpot, d.predicted_ttft_s, d.predicted_tpot_s
            )
            return
        n, usage = tokens_in(payload)
        if usage is not None:
            self._usage = usage
        if n:
            self._last_at = time.monotonic()
            if not self._chunks:
                self._first_at = self._last_at
            self._chunks += n
            self.service.progress(self.request_id, self._chunks)

    def _whole(self) -> None:
        if self._too_big:
            out = 0  # not parsed: counted as done, its tokens unknown
        else:
            try:
                answer = json.loads(self._json)
                usage = answer.get("usage") or {}
                out = int(usage.get("completion_tokens", 0))
            except (ValueError, AttributeError, TypeError):
                self.fail("an answer that is not a JSON object with usage")
                return
        total = time.monotonic() - self.started
        slo = self.routed.slo
        # No token timing without a stream: judge the end-to-end deadline the class implies.
        met = total <= slo.ttft_s + max(0, out - 1) * slo.tpot_s
        self.done = True
        self.service.finished(self.request_id, out, total, 0.0, met=met)
