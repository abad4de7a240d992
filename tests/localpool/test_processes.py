"""Tests of `localpool.processes`: children stopped on leaving, readiness that fails fast, the
messages of a subcommand's stderr without its progress bars."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from disaggpool.localpool.processes import (
    child_env,
    disaggpool_command,
    free_port,
    processes,
    stderr_messages,
    wait_http,
)


def test_messages_drop_progress_bars() -> None:
    stderr = (
        "calibrate: decode:  25%|██▌       | 2/8 [00:01<00:04,  1.46it/s]   \x1b[A\x1b[A"
        "disaggpool: probe failed: too few measurements\n\n"
        "calibrate: prefill:   2%|▏         | 8/360 [00:08<06:27,  1.10s/it]\r"
        "decode-0: quality good\n"
    )
    assert stderr_messages(stderr) == [
        "disaggpool: probe failed: too few measurements",
        "decode-0: quality good",
    ]


def test_every_child_is_stopped_on_leaving_even_on_an_error() -> None:
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    with pytest.raises(RuntimeError, match="interrupted"), processes() as procs:
        procs.append(subprocess.Popen(sleeper))
        procs.append(subprocess.Popen(sleeper))
        raise RuntimeError("interrupted")
    assert [p.poll() for p in procs] == [-15, -15]  # SIGTERM, both


def test_wait_http_fails_at_once_when_the_child_exits() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(7)"])
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="exited with code 7"):
        wait_http(f"http://127.0.0.1:{free_port()}/health", proc, timeout=30.0)
    assert time.monotonic() - start < 10.0


def test_wait_http_returns_once_the_child_answers() -> None:
    port = free_port()
    server = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
    with processes() as procs:
        procs.append(subprocess.Popen(server, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        wait_http(f"http://127.0.0.1:{port}/", procs[0], timeout=30.0)
        assert procs[0].poll() is None


def test_a_free_port_can_be_bound_and_children_run_this_installation() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", free_port()))
    assert disaggpool_command("demo")[0] == sys.executable
    assert disaggpool_command("demo")[1:] == ["-m", "disaggpool", "demo"]
    env = child_env(EXTRA="1")
    assert env["PYTHONUNBUFFERED"] == "1" and env["EXTRA"] == "1"
