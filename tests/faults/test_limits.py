"""Bodies and budgets past the limits: a 64 MiB body is refused with 413 from its Content-Length
or while it is read, with the router's memory bounded (measured on a `disaggpool sidecar`
process); `max_tokens` 10^12, or just past the pod's `max_model_len`, is a 400 naming
`max_tokens` before any leg runs (the prefill pod receives nothing)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from faultkit import Accounting, Kit, metric, pod, post_json, send_big_body, sidecar_doc

MIB = 1024 * 1024
BODY_BYTES = 64 * MIB


def big_body(size: int, chunk: int = MIB) -> Iterator[bytes]:
    """A JSON completion request of exactly `size` bytes (one huge word as its prompt), made
    chunk by chunk so that the test never holds it."""
    head, tail = b'{"max_tokens": 1, "prompt": "', b'"}'
    yield head
    left = size - len(head) - len(tail)
    while left > 0:
        n = min(chunk, left)
        yield b"a" * n
        left -= n
    yield tail


def test_a_64_mib_body_is_a_413_and_the_router_memory_stays_bounded(kit: Kit) -> None:
    p0, d0 = kit.emulator(), kit.emulator()
    sidecar = kit.sidecar_process(sidecar_doc([pod("p0", p0.url)], [pod("d0", d0.url)]))
    sidecar.wait_ready()
    books = Accounting(sidecar.url)
    status, _, raw = post_json(f"{sidecar.url}/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert status == 200, raw
    baseline = sidecar.peak_rss()

    for length in (BODY_BYTES, None):  # announced by Content-Length, then chunked
        status, raw = send_big_body(
            "127.0.0.1", sidecar.port, "/v1/completions", big_body(BODY_BYTES), length=length
        )
        assert status == 413, (length, status, raw[:200])
        grew = sidecar.peak_rss() - baseline
        assert grew < 24 * MIB, f"peak memory grew {grew / MIB:.0f} MiB for a refused body"
        assert "error" in json.loads(raw), raw[:200]  # an OpenAI error, as every other one

    status, _, raw = post_json(f"{sidecar.url}/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert status == 200, raw  # and it serves on
    books.settle(sent=4, admitted=2)


@pytest.mark.parametrize("over", ["absurd", "just-over"])
def test_max_tokens_past_the_model_length_is_a_400_before_any_leg(kit: Kit, over: str) -> None:
    p0, d0 = kit.emulator(), kit.emulator()
    prefill = kit.faulty(p0.url)  # counts every leg the real prefill pod is sent
    decode = kit.faulty(d0.url)
    sc = kit.sidecar(sidecar_doc([pod("p0", prefill.url)], [pod("d0", decode.url)]))
    books = Accounting(sc.url)
    model_len = p0.config.model_len
    prompt = "one two three"  # 4 tokens with BOS
    max_tokens = 10**12 if over == "absurd" else model_len - 4 + 1
    status, _, raw = post_json(
        f"{sc.url}/v1/completions", {"prompt": prompt, "max_tokens": max_tokens}
    )
    assert status == 400, raw
    error = json.loads(raw)["error"]
    assert error["param"] == "max_tokens" or "max_tokens" in error["message"], error
    assert (prefill.legs["prefill"], prefill.legs["decode"], decode.legs["decode"]) == (0, 0, 0)
    # Refused before routing, or routed and closed at once: either way booked = closed.
    booked = metric(sc.url, "disaggpool_route_decisions_total", role="prefill")
    # The same prompt within the budget runs both legs as usual.
    status, _, raw = post_json(f"{sc.url}/v1/completions", {"prompt": prompt, "max_tokens": 2})
    assert status == 200, raw
    assert (prefill.legs["prefill"], decode.legs["decode"]) == (1, 1)
    books.settle(sent=2, admitted=int(booked) + 1)
