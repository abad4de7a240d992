"""Requests that end early: a client that hangs up, a prefill leg abandoned, a decode leg dropped.

vLLM aborts a request whose client disconnects (streaming or not) and frees its KV; a decode leg
that never reads its blocks still notifies the prefill side. The emulator must do the same and
leak nothing.
"""

from __future__ import annotations

import json
import socket
import time
from typing import Any

from emulator_testkit import Http, eventually, make_profile, sample

from disaggpool.emulator.harness import EmulatorThread


def _hang_up_after(url: str, path: str, body: bytes, wait_bytes: int) -> None:
    """POST `body`, read `wait_bytes` of the answer (0: none), then close the socket."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        sock.sendall(head + body)
        got = b""
        while len(got) < wait_bytes:
            chunk = sock.recv(wait_bytes - len(got))
            if not chunk:
                break
            got += chunk


def _idle(emu: EmulatorThread, http: Http, aborted: int) -> None:
    fams = http.metrics(emu.url)
    assert sample(fams, "vllm:num_requests_running") == 0
    assert sample(fams, "vllm:num_requests_waiting") == 0
    assert sample(fams, "vllm:kv_cache_usage_perc") == 0
    assert sample(fams, "vllm:request_success_total", finished_reason="abort") == aborted
    assert emu.call(lambda: emu.instance.active_requests) == 0


def _assert_running(emu: EmulatorThread, http: Http, n: int) -> None:
    assert sample(http.metrics(emu.url), "vllm:num_requests_running") == n


def test_an_idle_connection_is_closed_after_the_keep_alive(start_emulator: Any) -> None:
    """As vLLM's server (VLLM_HTTP_TIMEOUT_KEEP_ALIVE): a kept-alive connection left idle is
    closed by the server, which is what a router's connection pool must expect."""
    emu = start_emulator(http_keep_alive=0.5)
    host, port = emu.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        t0 = time.monotonic()
        assert sock.recv(4096) == b""  # the server's close, not an answer
        closed_after = time.monotonic() - t0
    assert 0.3 < closed_after < 4.0, closed_after


def test_streaming_client_hangs_up(start_emulator: Any, http: Http) -> None:
    emu = start_emulator()
    body = b'{"prompt": "x", "max_tokens": 500, "stream": true}'
    _hang_up_after(emu.url, "/v1/completions", body, 400)  # headers and a token or two
    eventually(lambda: _idle(emu, http, aborted=1))


def test_non_streaming_client_hangs_up(start_emulator: Any, http: Http) -> None:
    emu = start_emulator()
    _hang_up_after(emu.url, "/v1/completions", b'{"prompt": "x", "max_tokens": 500}', 0)
    # vLLM notices a non-streaming client is gone only at its next output; under CPU pressure
    # the request may not even be running yet, so either state is fine before it is aborted.
    eventually(lambda: _idle(emu, http, aborted=1))


def test_abandoned_prefill_leg_frees_its_blocks(start_emulator: Any, http: Http) -> None:
    p = start_emulator(make_profile(prefill={"p0": 0.3}))
    body = b'{"prompt": "x y z", "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": true}}'
    _hang_up_after(p.url, "/v1/completions", body, 0)
    _hang_up_after(p.url, "/v1/completions", body, 0)  # queued behind the first one

    def check() -> None:
        _idle(p, http, aborted=2)
        assert p.call(
            lambda: (len(p.instance.lending.leases), p.instance.lending.pool.num_free)
        ) == (
            0,
            p.instance.lending.pool.total,
        )
        assert p.call(lambda: p.instance.prefill.engine.kv_used) == 0

    eventually(check)


def test_dropped_decode_leg_notifies_the_prefill_side(start_emulator: Any, http: Http) -> None:
    p = start_emulator()
    d = start_emulator(make_profile(max_num_seqs=1, decode={"d0": 0.05}))
    leg = {"prompt": "x y z", "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    kv = http.post(p.url + "/v1/completions", leg).json()["kv_transfer_params"]
    assert p.call(lambda: len(p.instance.lending.leases)) == 1
    _hang_up_after(d.url, "/v1/completions", b'{"prompt": "x", "max_tokens": 20}', 0)
    # D's only slot is busy, so the decode leg below waits in the queue.
    eventually(lambda: _assert_running(d, http, 1))
    body = json.dumps({"prompt": "x y z", "kv_transfer_params": kv}).encode()
    _hang_up_after(d.url, "/v1/completions", body, 0)

    def check() -> None:
        assert p.call(
            lambda: (len(p.instance.lending.leases), p.instance.lending.pool.num_free)
        ) == (
            0,
            p.instance.lending.pool.total,
        )
        _idle(d, http, aborted=2)

    eventually(check)
    assert sample(http.metrics(p.url), "vllm:nixl_num_kv_expired_reqs_total") == 0
