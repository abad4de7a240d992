"""The command line end to end: a real process, its ports, its environment, a clean SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

from emulator_testkit import Http


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_cli_serves_and_stops_on_sigterm(http: Http) -> None:
    port, side = _free_port(), _free_port()
    env = {
        **os.environ,
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side),
    }
    cmd = [sys.executable, "-m", "disaggpool.emulator", "--profile", "a40-llama3-8b"]
    cmd += ["--port", str(port), "--served-model-name", "m", "--startup-delay", "0.3"]
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                reply = http.get(f"http://127.0.0.1:{port}/health")
                break
            except ConnectionRefusedError:
                assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
                assert time.monotonic() < deadline
                time.sleep(0.05)
        assert reply.status == 200
        leg = {"prompt": "x", "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        kv = http.post(f"http://127.0.0.1:{port}/v1/completions", leg).json()["kv_transfer_params"]
        assert (kv["remote_host"], kv["remote_port"]) == ("127.0.0.1", side)
        socket.create_connection(("127.0.0.1", side), timeout=2).close()  # really listening
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
