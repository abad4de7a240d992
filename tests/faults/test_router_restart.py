"""The router restarted mid-stream: SIGTERM to a `disaggpool sidecar` process while it relays a
stream. It drains (`sidecar.app`): health says so, new requests are still answered for
`shutdown_delay_s`, then it stops listening while the stream in flight goes on to its last token
and [DONE]; then it exits 0."""

from __future__ import annotations

import concurrent.futures
import signal
import socket
import sys
import threading
import urllib.error
import urllib.request

import pytest
from emulator_testkit import eventually
from faultkit import Books, Kit, metrics_text, pod, post_json, read_sse, sidecar_doc
from sidecar_testkit import A40


def listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


def health(url: str) -> int:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.mark.skipif(sys.platform == "win32", reason="SIGTERM")
def test_sigterm_mid_stream_lets_the_stream_finish(kit: Kit) -> None:
    p0, d0 = kit.emulator(), kit.emulator(A40.scaled(0.5))  # ~63 ms per output token
    sidecar = kit.sidecar_process(
        sidecar_doc(
            [pod("p0", p0.url)],
            [pod("d0", d0.url)],
            shutdown_delay_s=1.5,
            shutdown_timeout_s=30.0,
        )
    ).wait_ready()
    started = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        body = {"prompt": "a long answer", "max_tokens": 60, "stream": True}
        stream = pool.submit(
            read_sse, f"{sidecar.url}/v1/completions", body, 60.0, lambda _: started.set()
        )
        assert started.wait(30), "the stream never started"
        sidecar.proc.send_signal(signal.SIGTERM)

        # Draining: health fails, a new request is still answered, the books hold the stream.
        eventually(lambda: _equal(health(sidecar.url), 503), timeout=1.0)
        status, _, raw = post_json(
            f"{sidecar.url}/v1/completions", {"prompt": "hi", "max_tokens": 2}
        )
        assert status == 200, raw
        books = Books.of(metrics_text(sidecar.url))
        assert (books.frontdoor, books.finished, books.inflight) == (1, 1, 1)

        # It stops listening while the stream still runs...
        eventually(lambda: _equal(listening(sidecar.port), False), timeout=10.0, interval=0.05)
        assert not stream.done(), "the stream ended before the router stopped listening"
        got = stream.result(60)
    # ... and the stream ends whole.
    assert got.status == 200 and got.complete, got
    assert got.events[-1] == "[DONE]" and not got.errors(), got.events[-3:]
    assert len(got.texts()) == 60
    assert sidecar.proc.wait(30) == 0, sidecar.log.read_text()


def _equal(got: object, want: object) -> None:
    assert got == want, got
