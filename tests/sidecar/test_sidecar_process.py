"""`disaggpool sidecar --config FILE` as a process: it serves on uvloop, and SIGTERM ends it
cleanly (exit 0)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from sidecar_testkit import A40

from disaggpool.localpool.processes import free_port


@pytest.mark.skipif(sys.platform == "win32", reason="uvloop is not a dependency on Windows")
def test_the_sidecar_process_runs_on_uvloop_and_stops_on_sigterm(
    start_pool, tmp_path: Path
) -> None:
    pool = start_pool([A40], [A40])
    port = free_port()
    config = {
        "model": "test/model",
        "listen": {"http": f"127.0.0.1:{port}", "grpc": "127.0.0.1:0"},
        "slo_classes": [{"name": "chat", "ttft_s": 2.0, "tpot_s": 0.2}],
        "tokenizer": {"kind": "emulator"},
        "pool": {"static": {"prefill": pool.urls("prefill"), "decode": pool.urls("decode")}},
    }
    path = tmp_path / "sidecar.yaml"
    path.write_text(yaml.safe_dump(config))
    log = tmp_path / "sidecar.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "disaggpool", "sidecar", "--config", str(path)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        while "sidecar up" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as resp:
            assert resp.status == 200
        assert "sidecar up on uvloop" in log.read_text()
        # The addresses it bound, not a bare ":PORT" (the gRPC port 0 resolved to the real one).
        assert f"HTTP front door on http://127.0.0.1:{port}," in log.read_text()
        assert re.search(r"gRPC on 127\.0\.0\.1:[1-9][0-9]*$", log.read_text(), re.MULTILINE)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
