"""Pods that misbehave on a request leg: hang before the first byte, drip-feed a stream, answer
garbage JSON or an SSE line over 512 KiB. Every request still ends in an answer or an error
(never a plain 500 or a silently cut stream), and the front door's books add up.

The pods that misbehave are `faultypod_kit.FaultyPod`s; the rest are emulators. Timeouts are the
contract's `upstream_timeouts`, set small so that each test takes seconds.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from faultkit import Accounting, Kit, free_port, metric, pod, post_json, read_sse, sidecar_doc
from faultypod_kit import Drip, Hang, HangAfterHeaders, HugeLine, Pass, Respond, Rewrite

FAST = {"connect_s": 1.0, "first_byte_s": 1.0, "idle_s": 1.0, "total_s": 20.0}


def completions(url: str) -> str:
    return f"{url}/v1/completions"


def test_a_prefill_pod_that_hangs_before_the_first_byte_is_left_for_another(kit: Kit) -> None:
    hung = kit.faulty()
    hung.behaviour["prefill"] = Hang()
    p1, d0 = kit.emulator(), kit.emulator()
    sc = kit.sidecar(
        sidecar_doc(
            [pod("hung", hung.url), pod("p1", p1.url)],
            [pod("d0", d0.url)],
            upstream_timeouts=FAST,
        )
    )
    books = Accounting(sc.url)
    for i in range(3):  # round-robin: the first goes to the hung pod
        started = time.monotonic()
        status, _, raw = post_json(completions(sc.url), {"prompt": f"q{i}", "max_tokens": 3})
        assert status == 200, raw
        assert json.loads(raw)["usage"]["completion_tokens"] == 3
        assert time.monotonic() - started < 8.0  # first_byte_s, not the 600 s total
    assert hung.legs["prefill"] >= 1
    assert metric(sc.url, "disaggpool_prefill_retries_total") >= 1
    books.settle(sent=3, admitted=3)


@pytest.mark.parametrize("fault", [Hang(), HangAfterHeaders()], ids=["no-bytes", "headers-only"])
def test_a_decode_pod_that_hangs_before_its_first_token_is_retried_on_another(
    kit: Kit, fault: Hang | HangAfterHeaders
) -> None:
    hung = kit.faulty()
    hung.behaviour["decode"] = fault
    p0, d1 = kit.emulator(kv_lease_duration=5.0), kit.emulator()
    sc = kit.sidecar(
        sidecar_doc(
            [pod("p0", p0.url)],
            [pod("hung", hung.url), pod("d1", d1.url)],
            upstream_timeouts=FAST,
            decode_attempts=2,
        )
    )
    books = Accounting(sc.url)
    started = time.monotonic()
    got = read_sse(completions(sc.url), {"prompt": "hello", "max_tokens": 5, "stream": True}, 15)
    assert got.status == 200, got.body
    assert got.complete and got.events[-1] == "[DONE]", got.events
    assert not got.errors() and len(got.texts()) == 5, got.events
    assert time.monotonic() - started < 8.0
    assert hung.legs["decode"] == 1
    assert metric(sc.url, "disaggpool_decode_retries_total") == 1
    books.settle(sent=1, admitted=1)


def test_a_stream_that_drips_slower_than_the_idle_timeout_ends_with_an_error_event(
    kit: Kit,
) -> None:
    drip = kit.faulty()
    drip.behaviour["decode"] = Drip(interval_s=3.0)
    p0 = kit.emulator(kv_lease_duration=1.0)
    timeouts = {**FAST, "idle_s": 0.5}
    sc = kit.sidecar(
        sidecar_doc([pod("p0", p0.url)], [pod("drip", drip.url)], upstream_timeouts=timeouts)
    )
    books = Accounting(sc.url)
    started = time.monotonic()
    got = read_sse(completions(sc.url), {"prompt": "hi", "max_tokens": 50, "stream": True}, 15)
    assert got.status == 200 and got.complete, got
    assert got.events[-1] == "[DONE]" and len(got.errors()) == 1, got.events
    assert got.texts()[:1] == [" d0"]  # what came before the silence was relayed
    assert time.monotonic() - started < 2.5  # idle_s, not the drip's next token
    books.settle(sent=1, admitted=1)


def test_a_stream_that_outlives_the_total_timeout_ends_with_an_error_and_keeps_its_pod(
    kit: Kit,
) -> None:
    drip = kit.faulty()
    drip.behaviour["decode"] = Drip(interval_s=0.1)  # never idle, never done
    p0 = kit.emulator(kv_lease_duration=1.0)
    timeouts = {**FAST, "total_s": 1.5}
    sc = kit.sidecar(
        sidecar_doc(
            [pod("p0", p0.url)],
            [pod("drip", drip.url)],
            upstream_timeouts=timeouts,
            scrape_interval_s=30.0,  # an ejection would last: no scrape brings the pod back
        )
    )
    books = Accounting(sc.url)
    for _ in range(2):  # the second one finds the pod still in the pool
        started = time.monotonic()
        body = {"prompt": "hi", "max_tokens": 1000, "stream": True}
        got = read_sse(completions(sc.url), body, 15)
        assert got.status == 200 and got.complete, got
        assert got.events[-1] == "[DONE]" and len(got.errors()) == 1, got.events
        assert len(got.texts()) >= 5
        assert 1.4 < time.monotonic() - started < 4.0
        assert metric(sc.url, "disaggpool_pod_healthy", pod="drip") == 1
    books.settle(sent=2, admitted=2)


GARBAGE = [b"[1, 2, 3]", b'"kv_transfer_params"', b"null", b"42", b"not json {"]


@pytest.mark.parametrize("answer", GARBAGE, ids=["array", "string", "null", "number", "text"])
def test_a_garbage_prefill_answer_is_a_502_that_names_no_pod(kit: Kit, answer: bytes) -> None:
    bad = kit.faulty()
    bad.behaviour["prefill"] = Respond(200, answer)
    d0 = kit.emulator()
    name = "pod-garbage-7f3"
    sc = kit.sidecar(sidecar_doc([pod(name, bad.url)], [pod("d0", d0.url)], prefill_attempts=1))
    books = Accounting(sc.url)
    status, headers, raw = post_json(completions(sc.url), {"prompt": "hi", "max_tokens": 3})
    assert status == 502, raw
    assert headers["content-type"].startswith("application/json")
    message = json.loads(raw)["error"]["message"]
    assert "prefill failed" in message
    assert name not in message and str(bad.service.port) not in message, message
    books.settle(sent=1, admitted=1)


def test_a_garbage_prefill_answer_is_retried_on_another_prefill_pod(kit: Kit) -> None:
    bad = kit.faulty()
    bad.behaviour["prefill"] = Respond(200, b"[1, 2, 3]")
    p1, d0 = kit.emulator(), kit.emulator()
    sc = kit.sidecar(sidecar_doc([pod("bad", bad.url), pod("p1", p1.url)], [pod("d0", d0.url)]))
    books = Accounting(sc.url)
    for i in range(2):
        status, _, raw = post_json(completions(sc.url), {"prompt": f"q{i}", "max_tokens": 3})
        assert status == 200, raw
    assert bad.legs["prefill"] >= 1
    books.settle(sent=2, admitted=2)


def test_an_sse_line_over_512_kib_ends_the_stream_with_an_error_event(kit: Kit) -> None:
    huge = kit.faulty()
    huge.behaviour["decode"] = HugeLine(600 * 1024)
    p0 = kit.emulator(kv_lease_duration=1.0)
    sc = kit.sidecar(sidecar_doc([pod("p0", p0.url)], [pod("huge", huge.url)]))
    books = Accounting(sc.url)
    got = read_sse(completions(sc.url), {"prompt": "hi", "max_tokens": 5, "stream": True}, 15)
    assert got.status == 200
    assert got.complete, f"the stream was cut: {[e[:80] for e in got.events]}"
    assert got.events[-1] == "[DONE]" and len(got.errors()) == 1, [e[:80] for e in got.events]
    assert got.texts()[:1] == [" first"]
    assert max(len(e) for e in got.events) < 64 * 1024  # the line itself never reaches the client
    huge.behaviour["decode"] = Pass()  # the router goes on serving
    again = read_sse(completions(sc.url), {"prompt": "hi", "max_tokens": 5, "stream": True}, 15)
    assert again.status == 200 and again.events[-1] == "[DONE]" and not again.errors()
    books.settle(sent=2, admitted=2)


def test_a_kv_load_failure_caused_by_the_prefill_pod_is_retried_and_ejects_no_decode_pod(
    kit: Kit,
) -> None:
    """The prefill pod answers with KV coordinates nobody can read (its side channel is gone):
    the decode pod fails the pull and says so (a 5xx with a body). The request is retried on
    another decode pod that prefills itself, and the decode pod that failed stays in the pool:
    the fault was the prefill pod's."""
    p0, d0, d1 = kit.emulator(), kit.emulator(pull_timeout=1.0), kit.emulator()
    prefill = kit.faulty(p0.url)

    def unreadable(doc: dict[str, Any]) -> None:
        doc["kv_transfer_params"]["remote_port"] = free_port()  # nothing listens there

    prefill.once("prefill", Rewrite(unreadable))
    sc = kit.sidecar(
        sidecar_doc(
            [pod("p0", prefill.url)],
            [pod("d0", d0.url), pod("d1", d1.url)],  # round-robin: d0 first
            scrape_interval_s=30.0,  # an ejection would last
            upstream_timeouts=FAST,
        )
    )
    books = Accounting(sc.url)
    status, _, raw = post_json(completions(sc.url), {"prompt": "unreadable kv", "max_tokens": 3})
    assert status == 200, raw
    assert json.loads(raw)["usage"]["completion_tokens"] == 3
    assert metric(sc.url, "disaggpool_decode_retries_total", path="local") == 1
    assert metric(sc.url, "disaggpool_pod_healthy", pod="d0") == 1
    books.settle(sent=1, admitted=1)
