"""The fault-injection kit of tests/faults: what a fault test starts, and the books it checks.

* The misbehaving pod itself (`FaultyPod` and its behaviours) is in faultypod_kit; `Kit.faulty`
  starts one.
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

import yaml
from emulator_testkit import eventually
from faultypod_kit import MODEL, FaultyPod
from sidecar_testkit import A40

from disaggpool import promtext
from disaggpool.core.profile import CalibrationProfile
from disaggpool.emulator.config import EmulatorConfig
from disaggpool.emulator.harness import EmulatorThread
from disaggpool.formats.profiles import save_profile
from disaggpool.sidecar.config import parse_config
from disaggpool.sidecar.harness import SidecarThread

SLO_CLASSES = [{"name": "interactive", "ttft_s": 30.0, "tpot_s": 1.0}]

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
