"""`disaggpool pd-proxy` as an operator runs it: a separate process, its refusals (exit 2 naming
the flag) and one request through it, then SIGTERM."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any

import pytest
from pdproxy_testkit import HEADER, dead_port, host_port, metric, post


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "disaggpool", "pd-proxy", *argv],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--listen", "0.0.0.0:8001", "--model-server", "http://127.0.0.1:8000"], "--listen"),
        (["--listen", "[::]:8001", "--model-server", "http://127.0.0.1:8000"], "--listen"),
        (["--listen", "nowhere", "--model-server", "http://127.0.0.1:8000"], "--listen"),
        (["--model-server", "127.0.0.1:8000"], "--model-server"),
        ([], "--model-server"),
        (["--model-server", "http://h:1", "--prefill-timeout-s", "soon"], "--prefill-timeout-s"),
        (["--model-server", "http://h:1", "--connect-timeout-s", "0"], "--connect-timeout-s"),
    ],
)
def test_refusals_exit_2_naming_the_flag(argv: list[str], flag: str) -> None:
    done = run(*argv)
    assert done.returncode == 2, done.stderr
    assert f"pd-proxy: {flag}: " in done.stderr


def test_beyond_loopback_without_keys_says_how_to_allow_it() -> None:
    done = run("--listen", "0.0.0.0:8001", "--model-server", "http://127.0.0.1:8000")
    assert "--api-keys-file" in done.stderr and "--allow-unauthenticated" in done.stderr


def test_the_process_serves_and_stops_on_sigterm(start_emulator: Any) -> None:
    p, d = start_emulator(), start_emulator()
    port = dead_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "disaggpool", "pd-proxy", "--listen", f"127.0.0.1:{port}",
         "--model-server", d.url],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{url}/metrics", timeout=2).read()
                break
            except (urllib.error.URLError, ConnectionError):
                assert proc.poll() is None and time.monotonic() < deadline, "pd-proxy never came up"
                time.sleep(0.1)
        status, _, raw = post(
            f"{url}/v1/completions", {"prompt": "one two three", "max_tokens": 2},
            {HEADER: host_port(p.url)},
        )  # fmt: skip
        assert status == 200, raw
        assert json.loads(raw)["usage"]["completion_tokens"] == 2
        assert metric(d.url, "vllm:nixl_xfer_time_seconds_count") == 1
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
