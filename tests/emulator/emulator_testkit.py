"""Helpers of the emulator tests: a tiny HTTP/SSE client, a predictable profile, metric lookup,
and `eventually`, which waits for a condition instead of sleeping and hoping.

Every test talks to the emulator through real HTTP on 127.0.0.1 (and, for P/D, through the real
TCP side channel between two instances), never by calling handlers directly. (A module with a
unique name rather than `conftest`, so that imports never pick another directory's conftest.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client as httpclient
import json
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from prometheus_client.parser import text_string_to_metric_families

from disaggpool.core.hardware import builtin_profile
from disaggpool.core.profile import CalibrationProfile, profile_from_dict

H100 = builtin_profile("h100-llama3-8b")


def make_profile(**overrides: Any) -> CalibrationProfile:
    """A round-numbered profile whose times are easy to predict (seconds)."""
    data: dict[str, Any] = {
        "name": "test-profile",
        "model": "test/model",
        "prefill": {"p0": 0.010, "p1": 1e-4, "p2": 0.0},
        "decode": {"d0": 0.020, "d1": 0.0, "d2": 0.0},
        "kv_transfer": {"k0": 0.015, "bytes_per_token": 131072, "bandwidth_bytes_per_s": 45e9},
        "kv_capacity_tokens": 200_000,
        "max_num_seqs": 64,
        "max_num_batched_tokens": 8192,
        "max_model_len": 4096,
    }
    for key, value in overrides.items():
        if isinstance(value, dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return profile_from_dict(data)


@dataclasses.dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@dataclasses.dataclass
class Stream:
    status: int
    headers: dict[str, str]
    sent_at: float
    events: list[tuple[float, str]]  # (perf_counter at receipt, data payload)

    def chunks(self) -> list[dict[str, Any]]:
        return [json.loads(d) for _, d in self.events if d != "[DONE]"]


class Http:
    """Blocking HTTP/1.1 on loopback with exact bodies and per-event SSE timestamps."""

    timeout = 30.0

    def _conn(self, url: str) -> tuple[httpclient.HTTPConnection, str]:
        parts = urlsplit(url)
        conn = httpclient.HTTPConnection(parts.hostname or "", parts.port, timeout=self.timeout)
        return conn, parts.path or "/"

    def request(
        self,
        method: str,
        url: str,
        body: Any = None,
        headers: dict[str, str] | None = None,
        *,
        json_type: bool = True,
    ) -> Reply:
        """One request; `json_type` adds ``Content-Type: application/json`` (vLLM needs it)."""
        conn, path = self._conn(url)
        data = body if isinstance(body, bytes | type(None)) else json.dumps(body).encode()
        hdrs = {"Content-Type": "application/json"} if json_type else {}
        hdrs.update(headers or {})
        try:
            conn.request(method, path, body=data, headers=hdrs)
            resp = conn.getresponse()
            return Reply(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
        finally:
            conn.close()

    def send_and_close(self, method: str, url: str, body: bytes) -> None:
        """Send a request, wait up to 20 ms for the first bytes of the answer, then hang up."""
        conn, path = self._conn(url)
        try:
            conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
            assert conn.sock is not None
            conn.sock.settimeout(0.02)
            with contextlib.suppress(OSError):
                conn.sock.recv(1)
        finally:
            conn.close()

    def post(self, url: str, body: Any, headers: dict[str, str] | None = None) -> Reply:
        return self.request("POST", url, body, headers)

    def get(self, url: str) -> Reply:
        return self.request("GET", url)

    def sse(self, url: str, body: Any, headers: dict[str, str] | None = None) -> Stream:
        conn, path = self._conn(url)
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        try:
            sent = time.perf_counter()
            conn.request("POST", path, body=json.dumps(body).encode(), headers=hdrs)
            resp = conn.getresponse()
            head = {k.lower(): v for k, v in resp.getheaders()}
            events: list[tuple[float, str]] = []
            if resp.status != 200:
                resp.read()
                return Stream(resp.status, head, sent, events)
            while True:
                line = resp.readline()
                if not line:
                    break
                now = time.perf_counter()
                text = line.decode().rstrip("\n")
                if text.startswith("data: "):
                    events.append((now, text[len("data: ") :]))
                    assert resp.readline() == b"\n", "every SSE event ends with a blank line"
            return Stream(resp.status, head, sent, events)
        finally:
            conn.close()

    def metrics(self, base: str) -> dict[str, Any]:
        """{family name: family} of a /metrics scrape, parsed by prometheus_client."""
        reply = self.get(base + "/metrics")
        assert reply.status == 200
        return {f.name: f for f in text_string_to_metric_families(reply.body.decode())}


def sample(families: dict[str, Any], name: str, **labels: str) -> float:
    """The value of the one sample called `name` whose labels include `labels`."""
    family_name = name
    for suffix in ("_total", "_bucket", "_count", "_sum"):
        if name.endswith(suffix) and name[: -len(suffix)] in families:
            family_name = name[: -len(suffix)]
    hits = [
        s.value
        for s in families[family_name].samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    assert len(hits) == 1, (name, labels, hits)
    return float(hits[0])


def eventually(check: Callable[[], Any], timeout: float = 5.0, interval: float = 0.01) -> None:
    """Run `check` until it passes (returns without an AssertionError), at most `timeout` s; the
    last failure is raised. A state the server reaches asynchronously is waited for, never
    assumed after a fixed sleep (which a loaded machine overruns)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            check()
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(interval)
