"""Shared helpers for the operator tests: kubeconfigs, the real operator as a subprocess, polling.

The operator always runs as a real process (`python -m disaggpool operator`, i.e. `kopf.run` of
disaggpool.operator.handlers) against either kmock (fast layer) or a real kube-apiserver 1.20.2
(e2e layer, tests/operator/test_operator_e2e.py). Assertions poll with timeouts; nothing sleeps a
fixed time and then asserts.
"""

from __future__ import annotations

import asyncio
import datetime
import itertools
import os
import signal
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = REPO / "manifests"
CHART = REPO / "helm" / "disaggpool"
CRD_PATH = MANIFESTS / "00-crd.yaml"
TOKEN = "disaggpool-test-token"

T = TypeVar("T")


def write_kubeconfig(directory: Path, server: str, token: str = TOKEN) -> Path:
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "test", "cluster": {"server": server, "insecure-skip-tls-verify": True}}
        ],
        "users": [{"name": "test", "user": {"token": token}}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test"}}],
        "current-context": "test",
    }
    path = directory / "kubeconfig"
    path.write_text(yaml.safe_dump(doc))
    return path


async def start_operator(
    kubeconfig: Path,
    log_path: Path,
    extra_env: dict[str, str] | None = None,
    args: tuple[str, ...] = (),
) -> asyncio.subprocess.Process:
    """`disaggpool operator --verbose [args]` with `kubeconfig`, its output in `log_path`."""
    env = {
        **os.environ,
        "KUBECONFIG": str(kubeconfig),
        "DISAGGPOOL_IMAGE": "disaggpool:test",
        "DISAGGPOOL_RESYNC_SECONDS": "5",
        "PYTHONUNBUFFERED": "1",
        **(extra_env or {}),
    }
    log = log_path.open("wb")
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "disaggpool",
        "operator",
        "--verbose",
        *args,
        env=env,
        stdout=log,
        stderr=asyncio.subprocess.STDOUT,
    )


async def stop_operator(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        proc.send_signal(signal.SIGINT)  # Kopf shuts down gracefully on SIGINT
        try:
            await asyncio.wait_for(proc.wait(), 15)
        except TimeoutError:
            proc.kill()
            await proc.wait()


async def eventually(
    probe: Callable[[], Awaitable[T | None]],
    what: str,
    timeout: float = 30.0,
    interval: float = 0.2,
    log_path: Path | None = None,
) -> T:
    """Poll `probe` until it returns something truthy; fail naming `what`, with the operator log."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = await probe()
        except (KeyError, IndexError, TypeError) as exc:  # not there yet
            last = exc
        if last:
            return last  # type: ignore[no-any-return]
        await asyncio.sleep(interval)
    tail = ""
    if log_path is not None and log_path.exists():
        tail = "\n--- operator log (tail) ---\n" + "\n".join(
            log_path.read_text(errors="replace").splitlines()[-40:]
        )
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last: {last!r}{tail}")


def load_sample(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((MANIFESTS / "samples" / name).read_text())
    return doc


def ready_pod_status(ip: str) -> dict[str, Any]:
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "phase": "Running",
        "podIP": ip,
        "conditions": [
            {"type": "Ready", "status": "True", "lastTransitionTime": now},
            {"type": "ContainersReady", "status": "True", "lastTransitionTime": now},
        ],
    }


_RV = itertools.count(1000)


def realistic_emulator_class() -> type:
    """kmock's emulator plus the server-populated metadata a real API server stamps on objects."""
    import kmock as km

    class RealisticEmulator(km.KubernetesEmulator):  # type: ignore[misc]
        async def _handle(self, request: Any) -> Any:
            data = request.data
            if request.resource is not None and data is not None:
                if request.action == km.action.CREATE and isinstance(data, dict):
                    md = data.setdefault("metadata", {})
                    md.setdefault("uid", str(uuid.uuid4()))
                    md["resourceVersion"] = str(next(_RV))
                    md.setdefault(
                        "creationTimestamp",
                        datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                    )
                    md.setdefault("generation", 1)
                    if request.namespace:
                        md.setdefault("namespace", request.namespace)
                elif request.action == km.action.UPDATE:
                    rv = str(next(_RV))
                    if isinstance(data, list):
                        data.append({"op": "add", "path": "/metadata/resourceVersion", "value": rv})
                    elif isinstance(data, dict):
                        data.setdefault("metadata", {})["resourceVersion"] = rv
            return await super()._handle(request)

    return RealisticEmulator
