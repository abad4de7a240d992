"""Helpers of the P/D proxy tests (a module with a unique name, so imports never pick another
directory's): the proxy on a loop thread, HTTP and SSE calls, emulator metrics."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from typing import Any

from disaggpool import promtext
from disaggpool.loopthread import LoopThread
from disaggpool.pdproxy.app import RunningProxy, start_proxy
from disaggpool.pdproxy.config import ProxyConfig

HEADER = "x-prefiller-host-port"

MODEL = "test/model"  # the name every emulated pod in these tests serves


class ProxyThread(LoopThread[RunningProxy]):
    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        super().__init__(lambda: start_proxy(config), name="pd-proxy")

    @property
    def url(self) -> str:
        return self.service.url


def host_port(url: str) -> str:
    return url.removeprefix("http://")


def dead_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def post(
    url: str, body: Any, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    """POST JSON (or raw bytes): (status, headers, raw body), for errors too."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(
        url, data, {"Content-Type": "application/json", **(headers or {})}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def sse_events(raw: bytes) -> list[str]:
    """The `data:` payloads of a server-sent event stream, in order."""
    return [
        line[len("data: ") :] for line in raw.decode().splitlines() if line.startswith("data: ")
    ]


def metric(base_url: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` on `base_url`/metrics whose labels include `labels`."""
    text = urllib.request.urlopen(f"{base_url}/metrics", timeout=10).read().decode()
    return promtext.total(promtext.parse(text, [name]), name, labels)
