"""Helpers of the sidecar tests: the pool description and a config builder.

(A module with a unique name rather than `conftest`, so imports never pick another directory's.)
"""

from __future__ import annotations

import dataclasses
import json
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from disaggpool import promtext
from disaggpool.core.hardware import builtin_profile
from disaggpool.emulator.harness import EmulatorThread
from disaggpool.localpool.processes import free_port
from disaggpool.sidecar.config import SidecarConfig, parse_config

MODEL = "test/model"
A40 = builtin_profile("a40-llama3-8b")


@dataclasses.dataclass
class Pool:
    pods: dict[str, tuple[str, EmulatorThread]]  # name -> (role, emulator)
    profiles_dir: Path

    def urls(self, role: str) -> list[dict[str, str]]:
        return [{"name": n, "url": e.url} for n, (r, e) in self.pods.items() if r == role]

    def emulator(self, name: str) -> EmulatorThread:
        return self.pods[name][1]


def sidecar_config(pool: Pool, /, **overrides: Any) -> SidecarConfig:
    doc: dict[str, Any] = {
        "policy": "calibrated",
        "model": MODEL,
        "listen": {"http": "127.0.0.1:0", "grpc": "127.0.0.1:0"},
        "slo_classes": [
            {"name": "interactive", "ttft_s": 2.0, "tpot_s": 0.2},
            {"name": "batch", "ttft_s": 30.0, "tpot_s": 1.0},
        ],
        "scrape_interval_s": 0.2,
        "tokenizer": {"kind": "emulator"},
        "pool": {"static": {"prefill": pool.urls("prefill"), "decode": pool.urls("decode")}},
        "profiles": {"dir": str(pool.profiles_dir)},
    }
    doc.update(overrides)
    return parse_config(doc, "<test>")


def post(url: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    """POST JSON (or raw bytes); (status, decoded body) for successes and HTTP errors alike."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(
        url, data, {"Content-Type": "application/json", **(headers or {})}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def metric(base_url: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` on `base_url`/metrics whose labels include `labels`."""
    text = urllib.request.urlopen(f"{base_url}/metrics", timeout=10).read().decode()
    return promtext.total(promtext.parse(text, [name]), name, labels)


class NatsServer:
    """A real nats-server on 127.0.0.1 (the `nats_server` fixture's): `stop` kills it (SIGKILL,
    nothing flushed), `start` brings it back on the same port."""

    def __init__(self, exe: Path, port: int = 0) -> None:
        self.exe, self.port = exe, port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        cmd = [str(self.exe), "-a", "127.0.0.1", "-p", str(self.port)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("nats-server did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
