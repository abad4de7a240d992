"""One upstream leg against a vLLM pod, shared by the front door (`legs`) and the decode-side
P/D proxy (`disaggpool.pdproxy`), so that vLLM's handoff is written once.

* `prefill_leg_body`: the client's body turned into vLLM's prefill leg (`docs/vllm-protocol.md`
  §2.1): ``kv_transfer_params`` asking for a remote decode, ``stream: false``, ``max_tokens: 1``
  (and ``max_completion_tokens: 1`` if present), without ``stream_options``, ``min_tokens`` and
  ``min_completion_tokens``;
* `Upstream.open`: POST a leg and wait for its answer's headers, within the leg's deadlines;
* `Upstream.prefill_leg`: one whole prefill leg, its answer's ``kv_transfer_params`` or a failure;
* `Upstream.sse_lines`: a streamed answer's lines, bounded in length, silence and total time.

Every failure is an `UpstreamFailed` saying how it failed in words fit for a client (no address);
what to do about it (another pod, a local prefill, an error event) is the caller's business.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from disaggpool.pdwire import prefill_leg_params
from disaggpool.sidecar.config import UpstreamTimeouts

__all__ = ["MAX_SSE_LINE", "Upstream", "UpstreamFailed", "prefill_leg_body"]

MAX_SSE_LINE = 512 * 1024  # one server-sent event line from a pod; vLLM's are a few KiB


class UpstreamFailed(Exception):
    """A leg that failed. `kind` says how, in words fit for a client (no address); `never_sent`:
    the pod provably never received the request (its connection was refused); `timed_out`: a
    deadline passed; `status`: the answer's HTTP status when one came (200 for a prefill answer
    that was not usable)."""

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
        timed_out: bool = False,
    ) -> None:
        super().__init__(f"{pod}: {kind}" + (f" ({detail})" if detail else ""))
        self.pod = pod
        self.kind = kind
        self.status = status
        self.body = body
        self.never_sent = never_sent
        self.blame_pod = blame_pod
        self.final = final  # the leg ran out of its total time: no other pod gets another go
        self.timed_out = timed_out or final

    @property
    def clients_fault(self) -> bool:
        return self.status is not None and 400 <= self.status <= 451


def prefill_leg_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg's body made from the client's (a new dict; `body` is left as it is)."""
    leg = {**body, "kv_transfer_params": prefill_leg_params(), "stream": False, "max_tokens": 1}
    if "max_completion_tokens" in leg:
        leg["max_completion_tokens"] = 1
    # vLLM refuses min_tokens > max_tokens, and stream_options without stream (a 400).
    for key in ("stream_options", "min_tokens", "min_completion_tokens"):
        leg.pop(key, None)
    return leg


class Upstream:
    """Legs over one HTTP session under one set of deadlines (`UpstreamTimeouts`): connecting,
    the answer's first byte, the longest silence inside a stream, the whole leg."""

    def __init__(self, session: aiohttp.ClientSession, timeouts: UpstreamTimeouts) -> None:
        self.session = session
        self.timeouts = timeouts

    async def open(
        self,
        pod: str,
        url: str,
        body: dict[str, Any] | bytes,
        headers: dict[str, str],
        first_byte: bool,
    ) -> aiohttp.ClientResponse:
        """POST a leg (a JSON object, or bytes sent as they are) and wait for its answer's
        headers: within `first_byte_s` when `first_byte` (else within the whole leg's time)."""
        t = self.timeouts
        timeout = aiohttp.ClientTimeout(total=None, connect=t.connect_s, sock_connect=t.connect_s)
        payload: dict[str, Any] = {"data": body} if isinstance(body, bytes) else {"json": body}
        try:
            async with asyncio.timeout(t.first_byte_s if first_byte else t.total_s):
                return await self.session.post(url, headers=headers, timeout=timeout, **payload)
        except aiohttp.ClientConnectorError as exc:
            raise UpstreamFailed(pod, "connection refused", str(exc), never_sent=True) from None
        except TimeoutError:
            if first_byte:
                raise UpstreamFailed(pod, "no answer within first_byte_s", timed_out=True) from None
            raise UpstreamFailed(
                pod, "no answer within total_s", blame_pod=False, final=True
            ) from None
        except (aiohttp.ClientError, OSError) as exc:
            raise UpstreamFailed(pod, "connection lost", str(exc) or type(exc).__name__) from None

    async def read_whole(self, pod: str, up: aiohttp.ClientResponse, deadline: float) -> bytes:
        """The whole answer, before `deadline` (the loop's clock)."""
        try:
            async with asyncio.timeout_at(deadline):
                return await up.read()
        except TimeoutError:
            raise UpstreamFailed(
                pod, "answer not complete within total_s", blame_pod=False, final=True
            ) from None
        except (aiohttp.ClientError, OSError) as exc:
            raise UpstreamFailed(pod, "connection lost", str(exc) or type(exc).__name__) from None

    async def prefill_leg(
        self, pod: str, url: str, leg: dict[str, Any], headers: dict[str, str]
    ) -> dict[str, Any]:
        """One prefill leg: its answer's `kv_transfer_params`, or `UpstreamFailed` (a status
        other than 200 carries the answer's status and body, for a 4xx to be passed on)."""
        deadline = asyncio.get_running_loop().time() + self.timeouts.total_s
        up = await self.open(pod, url, leg, headers, first_byte=True)
        try:
            raw = await self.read_whole(pod, up, deadline)
        except BaseException:
            up.close()
            raise
        up.release()
        if up.status != 200:
            raise UpstreamFailed(pod, f"HTTP {up.status}", status=up.status, body=raw)
        try:
            answer = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise UpstreamFailed(pod, "an answer that is not JSON", status=200) from None
        if not isinstance(answer, dict):
            raise UpstreamFailed(pod, "an answer that is not a JSON object", status=200)
        params = answer.get("kv_transfer_params")
        if not params or not isinstance(params, dict):
            raise UpstreamFailed(pod, "no kv_transfer_params in its answer", status=200)
        return params

    async def sse_lines(
        self, pod: str, up: aiohttp.ClientResponse, deadline: float
    ) -> AsyncIterator[bytes]:
        """The stream's lines, each within `idle_s` of the last and all before `deadline`; a
        line longer than `MAX_SSE_LINE` or a broken connection is `UpstreamFailed`."""
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
                    raise UpstreamFailed(
                        pod, "stream longer than total_s", blame_pod=False, timed_out=True
                    ) from None
                raise UpstreamFailed(pod, "stream silent for idle_s", timed_out=True) from None
            except (aiohttp.ClientError, OSError) as exc:
                raise UpstreamFailed(pod, "stream cut", str(exc) or type(exc).__name__) from None
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


def _too_long(pod: str) -> UpstreamFailed:
    return UpstreamFailed(pod, f"an event line over {MAX_SSE_LINE} bytes", blame_pod=False)
