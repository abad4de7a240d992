"""The command line end to end: a real process, its ports, its environment, a clean SIGTERM, and
a second instance on one machine told which of its ports clashed."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable

import pytest
from emulator_testkit import Http

from disaggpool.emulator import cli
from disaggpool.emulator.harness import EmulatorThread
from disaggpool.formats.kv_events import parse_kv_events_config


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


def test_a_second_emulator_is_told_which_port_clashed(
    start_emulator: Callable[..., EmulatorThread],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two emulators on one machine: each shared port fails with a message that names the
    setting and how to change it, not a bare "address already in use"."""
    events = {"enable_kv_cache_events": True, "endpoint": "tcp://*:0"}
    first = start_emulator(kv_events=parse_kv_events_config(json.dumps(events)))
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1")
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", str(first.side_channel_port))
    second = ["--profile", "a40-llama3-8b", "--port", "0"]

    assert cli.main(second) == 1  # the variable, as vLLM reads it, clashes
    err = capsys.readouterr().err
    assert f"NIXL side channel 127.0.0.1:{first.side_channel_port}" in err
    assert "--side-channel-port" in err and "VLLM_NIXL_SIDE_CHANNEL_PORT" in err
    assert "already in use" in err.lower()

    taken_http = ["--profile", "a40-llama3-8b", "--port", str(first.port)]
    assert cli.main([*taken_http, "--side-channel-port", "0"]) == 1  # the flag wins: HTTP clashes
    err = capsys.readouterr().err
    assert f"HTTP port 127.0.0.1:{first.port}" in err and "--port" in err
    assert "side channel" not in err

    kv_endpoint = first.instance.kv_events.endpoint if first.instance.kv_events else ""
    clash = {**events, "endpoint": "tcp://*:" + kv_endpoint.rsplit(":", 1)[1]}
    free_side = ["--side-channel-port", "0"]
    assert cli.main([*second, *free_side, "--kv-events-config", json.dumps(clash)]) == 1
    err = capsys.readouterr().err
    assert f"KV events endpoint {kv_endpoint}" in err and "--kv-events-config" in err
