"""The fault-injection kit of tests/faults: pods that misbehave on demand, and the books.

* `FaultyPod`: a small aiohttp server on 127.0.0.1 (its own loop, in a daemon thread) that speaks
  vLLM's HTTP API to the sidecar and breaks what a test tells it to. With an `upstream` (an
  emulator's URL) it proxies everything it does not break, so the parts it leaves alone are a
  real pod; without one it answers like a minimal vLLM (a canned metrics page, a prefill answer
  with `kv_transfer_params`, a decode leg of `max_tokens` tokens). It tells the two legs of the
  prefill -> decode handoff apart by `kv_transfer_params.do_remote_decode`, counts what it was
  sent (`legs`, `scrapes`), and picks each answer from a per-leg script (one-shot behaviours,
  queued) falling back to a standing behaviour: `Pass`, `Hang`, `HangAfterHeaders`, `Drip`,
  `Respond`, `HugeLine`, `Reset`, `Rewrite`. `metrics_pages` queues raw pages for the next
  scrapes, one each.
* `Books` / `Accounting`: the front door's own counters, read from its `/metrics`. The invariant
  every fault test ends with: `disaggpool_frontdoor_requests_total` grew by the requests sent,
  `disaggpool_requests_total` (every outcome) by the requests admitted (routed to a pod), and
  `disaggpool_inflight_requests` is back to 0.
* `sidecar_doc`: a sidecar config (round-robin over static members unless told otherwise, so a
  test knows which pod the first request meets); `EmulatorProcess` and `SidecarProcess`: the real
  CLI in a subprocess, for a test that must kill -9 a pod or SIGTERM the router.
* `read_sse`, `post_raw`: HTTP clients that tolerate what a fault does to a stream.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import http.client
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from aiohttp import web
from emulator_testkit import eventually
from sidecar_testkit import A40

from disaggpool import promtext
from disaggpool.core.profile import CalibrationProfile
from disaggpool.emulator.config import EmulatorConfig
from disaggpool.emulator.harness import EmulatorThread
from disaggpool.formats.profiles import save_profile
from disaggpool.loopthread import LoopThread
from disaggpool.sidecar.config import parse_config
from disaggpool.sidecar.harness import SidecarThread

MODEL = "test/model"
SLO_CLASSES = [{"name": "interactive", "ttft_s": 30.0, "tpot_s": 1.0}]
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


# ----------------------------------------------------------------------------- the books
FRONTDOOR = "disaggpool_frontdoor_requests_total"
FINISHED = "disaggpool_requests_total"
INFLIGHT = "disaggpool_inflight_requests"


@dataclasses.dataclass(frozen=True)
class Books:
    frontdoor: float  # every front-door generation request answered, any status
    finished: float  # every request the router admitted and then closed, any outcome
    inflight: float  # routed and not closed yet

    @classmethod
    def of(cls, text: str) -> Books:
        samples = promtext.parse(text, [FRONTDOOR, FINISHED, INFLIGHT])
        return cls(
            promtext.total(samples, FRONTDOOR, {}),
            promtext.total(samples, FINISHED, {}),
            promtext.total(samples, INFLIGHT, {}),
        )


def metrics_text(base_url: str) -> str:
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as resp:
        text: str = resp.read().decode()
        return text


def metric(base_url: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels` (0 when there are none)."""
    text = metrics_text(base_url)
    return promtext.total(promtext.parse(text, [name]), name, labels)


class Accounting:
    """The books before a test's requests; `settle` checks them after (module docstring)."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.start = Books.of(metrics_text(base_url))

    def settle(self, *, sent: int, admitted: int, timeout: float = 10.0) -> Books:
        last: list[Books] = []

        def check() -> None:
            now = Books.of(metrics_text(self.base_url))
            last[:] = [now]
            got = (now.frontdoor - self.start.frontdoor, now.finished - self.start.finished)
            assert got == (sent, admitted) and now.inflight == 0, (
                f"front door answered {got[0]:g} of {sent} sent, closed {got[1]:g} of "
                f"{admitted} admitted, {now.inflight:g} still in flight"
            )

        eventually(check, timeout=timeout, interval=0.1)
        return last[0]


# ----------------------------------------------------------------------------- config
def pod(name: str, url: str, kv_events: str = "") -> dict[str, str]:
    out = {"name": name, "url": url}
    if kv_events:
        out["kv_events"] = kv_events
    return out


def sidecar_doc(
    prefill: list[dict[str, str]], decode: list[dict[str, str]], **overrides: Any
) -> dict[str, Any]:
    """A sidecar config document: round-robin over these static pods, emulator tokenizer,
    loopback on free ports; `overrides` replace top-level fields."""
    doc: dict[str, Any] = {
        "policy": "round_robin",
        "model": MODEL,
        "listen": {"http": "127.0.0.1:0", "grpc": "127.0.0.1:0"},
        "slo_classes": SLO_CLASSES,
        "scrape_interval_s": 0.2,
        "tokenizer": {"kind": "emulator"},
        "pool": {"static": {"prefill": prefill, "decode": decode}},
    }
    doc.update(overrides)
    return doc


# ----------------------------------------------------------------------------- HTTP clients
@dataclasses.dataclass
class SSE:
    status: int
    events: list[str]  # the data payloads, in order
    complete: bool  # the body ended cleanly (not cut mid-stream)
    body: bytes  # a non-200 answer's body

    def texts(self) -> list[str]:
        out = []
        for e in self.events:
            if e != "[DONE]":
                doc = json.loads(e)
                if "choices" in doc:
                    out.extend(c.get("text", "") for c in doc["choices"])
        return out

    def errors(self) -> list[dict[str, Any]]:
        return [json.loads(e)["error"] for e in self.events if e != "[DONE]" and '"error"' in e]


def read_sse(
    url: str,
    body: dict[str, Any],
    timeout: float = 30.0,
    on_event: Callable[[str], None] | None = None,
) -> SSE:
    """POST a streaming request; every event (each also given to `on_event` as it comes), and
    whether the stream ended cleanly."""
    parts = urllib.request.urlparse(url)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=timeout)
    events: list[str] = []
    try:
        conn.request(
            "POST", parts.path, json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        if resp.status != 200:
            return SSE(resp.status, [], True, resp.read())
        try:
            while True:
                line = resp.readline()
                if not line:
                    return SSE(200, events, True, b"")
                if line.startswith(b"data: "):
                    events.append(line[6:].decode().rstrip("\n"))
                    if on_event is not None:
                        on_event(events[-1])
        except (http.client.IncompleteRead, ConnectionError) as exc:
            del exc
            return SSE(200, events, False, b"")
    finally:
        conn.close()


def post_json(url: str, body: Any, timeout: float = 30.0) -> tuple[int, dict[str, str], bytes]:
    """POST a JSON document (or raw bytes); (status, lower-cased headers, body)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    parts = urllib.request.urlparse(url)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=timeout)
    try:
        conn.request("POST", parts.path, data, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def send_big_body(
    host: str, port: int, path: str, chunks: Any, *, length: int | None, timeout: float = 30.0
) -> tuple[int | None, bytes]:
    """POST a body given as an iterable of byte chunks, with Content-Length `length` or chunked
    when None. Stops sending as soon as the server answers (a 413 comes early); returns
    (status or None when no answer could be read, body)."""
    sock = socket.create_connection((host, port), timeout=timeout)
    try:
        head = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}", "Content-Type: application/json"]
        head.append(
            f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
        )
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            for chunk in chunks:
                if _readable(sock):
                    break
                if length is None:
                    chunk = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
                sock.sendall(chunk)
            else:
                if length is None:
                    sock.sendall(b"0\r\n\r\n")
        try:
            resp = http.client.HTTPResponse(sock)
            resp.begin()
            return resp.status, resp.read()
        except (ConnectionResetError, http.client.HTTPException, OSError):
            return None, b""
    finally:
        sock.close()


def _readable(sock: socket.socket) -> bool:
    ready, _, _ = select.select([sock], [], [], 0)
    return bool(ready)


# ----------------------------------------------------------------------------- processes
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, timeout: float = 60.0, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except urllib.error.HTTPError:
            return  # it answers
        except OSError as exc:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"exited ({proc.returncode}) before {url} answered") from exc
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


class EmulatorProcess:
    """`disaggpool emulate` in a subprocess, so a test can kill -9 it."""

    def __init__(self, profile_path: Path, *extra: str) -> None:
        port = free_port()
        env = {**os.environ, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
        self.proc = subprocess.Popen(
            [
                sys.executable, "-m", "disaggpool", "emulate", "--profile", str(profile_path),
                "--port", str(port), "--model", MODEL, "--jitter", "0", *extra,
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        self.url = f"http://127.0.0.1:{port}"

    def wait_ready(self) -> EmulatorProcess:
        try:
            wait_http(self.url + "/health", proc=self.proc)
        except BaseException:
            self.kill()
            raise
        return self

    def kill(self) -> None:
        """SIGKILL, and wait until it is gone (its port then refuses connections)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)


class SidecarProcess:
    """`disaggpool sidecar --config FILE` in a subprocess (its memory measurable, SIGTERM-able)."""

    def __init__(self, doc: dict[str, Any], folder: Path) -> None:
        self.port = free_port()
        doc = {**doc, "listen": {"http": f"127.0.0.1:{self.port}", "grpc": "127.0.0.1:0"}}
        path = folder / "sidecar.yaml"
        path.write_text(yaml.safe_dump(doc))
        self.log = folder / "sidecar.log"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "disaggpool", "sidecar", "--config", str(path)],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 60.0) -> SidecarProcess:
        deadline = time.monotonic() + timeout
        while "sidecar up" not in self.log.read_text(errors="replace"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the sidecar did not start:\n{self.log.read_text()}")
            time.sleep(0.1)
        return self

    def peak_rss(self) -> int:
        """The process's peak resident memory so far (VmHWM), bytes."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmHWM in /proc/PID/status")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


# ----------------------------------------------------------------------------- the fixture
class Kit:
    """What one test starts, stopped in the right order afterwards (the `kit` fixture): the
    router first, then the pods, then the processes."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._sidecars: list[SidecarThread] = []
        self._pods: list[FaultyPod | EmulatorThread] = []
        self._procs: list[EmulatorProcess | SidecarProcess] = []

    def emulator(self, profile: CalibrationProfile = A40, **settings: Any) -> EmulatorThread:
        config = {
            "port": 0,
            "side_channel_port": 0,
            "side_channel_host": "127.0.0.1",
            "jitter": 0.0,
            "model": MODEL,
            **settings,
        }
        emu = EmulatorThread(EmulatorConfig(profile, **config))
        self._pods.append(emu)
        return emu.start()

    def faulty(self, upstream: str = "", **kwargs: Any) -> FaultyPod:
        pod = FaultyPod(upstream, **kwargs)
        self._pods.append(pod)
        return pod.start()

    def sidecar(self, doc: dict[str, Any]) -> SidecarThread:
        sc = SidecarThread(parse_config(doc, "<fault test>"))
        self._sidecars.append(sc)
        return sc.start()

    def emulator_process(self, profile: CalibrationProfile, *extra: str) -> EmulatorProcess:
        path = self.folder / f"emulated-{len(self._procs)}.yaml"
        save_profile(profile, path)
        proc = EmulatorProcess(path, *extra)
        self._procs.append(proc)
        return proc

    def sidecar_process(self, doc: dict[str, Any]) -> SidecarProcess:
        folder = self.folder / f"sidecar-{len(self._procs)}"
        folder.mkdir()
        proc = SidecarProcess(doc, folder)
        self._procs.append(proc)
        return proc

    def profiles(self, **by_pod: CalibrationProfile | dict[str, Any]) -> str:
        """A profiles directory with one file per pod (a profile, or a raw document)."""
        folder = self.folder / "profiles"
        folder.mkdir(exist_ok=True)
        for name, profile in by_pod.items():
            if isinstance(profile, dict):
                (folder / f"{name}.yaml").write_text(yaml.safe_dump(profile))
            else:
                save_profile(profile, folder / f"{name}.yaml")
        return str(folder)

    def close(self) -> None:
        for sc in self._sidecars:
            sc.stop()
        for p in self._pods:
            p.stop()
        for proc in self._procs:
            if isinstance(proc, EmulatorProcess):
                proc.kill()
            else:
                proc.stop()
