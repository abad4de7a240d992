"""What REAL vLLM 0.32.0 (the CPU build) does on the wire.

These tests drive real engines started by ``conftest.py`` (a plain engine and a NIXL
prefill/decode pair). They assert the behaviour that the project's emulator must copy and store
every response, normalised, in ``fixtures/vllm_0.32.0_wire.json`` when
``DISAGGPOOL_RECORD_FIXTURES=1``; otherwise they also compare the live response shapes with
that file. This module covers the single plain engine (API, errors, metrics); the NIXL
prefill/decode pair is in test_real_vllm_pd.py, the helpers in vllm_wire_kit.py.

Only the standard library talks to the engines (this process runs in the project's venv).
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from vllm_wire_kit import (
    ERROR_KEYS,
    MAX_MODEL_LEN,
    MODEL_NAME,
    VLLM_VERSION,
    assert_family,
    check_metric_shapes,
    http,
    make_prompt,
    metrics,
    new_rid,
    record_json,
    record_stream,
    sse_events,
    summarize_families,
    wait_for,
)

# ================================================================== single engine


def test_health_version_models(single_engine: Any, wire: Any, model_dir: Any) -> None:
    url = single_engine.url
    h = http("GET", url + "/health")
    assert h.status == 200
    assert h.body == b""
    wire.capture("single", "health", {"status": h.status, "body": ""})

    v = http("GET", url + "/version")
    assert v.status == 200
    assert v.json() == {"version": VLLM_VERSION}
    wire.capture("single", "version", record_json(v))

    m = http("GET", url + "/v1/models")
    assert m.status == 200
    body = m.json()
    assert body["object"] == "list"
    assert len(body["data"]) == 1
    card = body["data"][0]
    assert card["id"] == MODEL_NAME
    assert card["object"] == "model"
    assert card["owned_by"] == "vllm"
    assert card["root"] == str(model_dir)
    assert card["parent"] is None
    assert card["max_model_len"] == MAX_MODEL_LEN
    assert isinstance(card["created"], int)
    assert isinstance(card["permission"], list)
    assert card["permission"][0]["object"] == "model_permission"
    wire.capture("single", "models", record_json(m))


def test_tokenize(single_engine: Any, wire: Any, vocab_words: list[str]) -> None:
    prompt = make_prompt(vocab_words, 7, seed=1)
    req = {"model": MODEL_NAME, "prompt": prompt}
    r = http("POST", single_engine.url + "/tokenize", req)
    assert r.status == 200
    body = r.json()
    assert list(body) == ["count", "max_model_len", "tokens", "token_strs"]
    assert body["count"] == len(body["tokens"]) == 8  # BOS + 7 words
    assert body["max_model_len"] == MAX_MODEL_LEN
    assert all(isinstance(t, int) for t in body["tokens"])
    assert body["token_strs"] is None
    wire.capture("single", "tokenize_prompt", record_json(r, request={"prompt": "<7 words>"}))

    req2 = {"model": MODEL_NAME, "messages": [{"role": "user", "content": prompt}]}
    r2 = http("POST", single_engine.url + "/tokenize", req2)
    assert r2.status == 200
    b2 = r2.json()
    # The tiny chat template adds BOS, the role marker, EOS and the assistant marker.
    assert b2["count"] == len(b2["tokens"]) == 7 + 4
    wire.capture("single", "tokenize_messages", record_json(r2, request={"messages": "<1 msg>"}))


def test_completion(single_engine: Any, wire: Any, vocab_words: list[str]) -> None:
    rid = new_rid("cmpl")
    req = {
        "model": MODEL_NAME,
        "prompt": make_prompt(vocab_words, 12, seed=2),
        "max_tokens": 5,
        "temperature": 0,
        "ignore_eos": True,
    }
    r = http("POST", single_engine.url + "/v1/completions", req, {"X-Request-Id": rid})
    assert r.status == 200, r.body
    assert r.headers["content-type"] == "application/json"
    assert "x-request-id" not in r.headers  # echoed only with --enable-request-id-headers
    body = r.json()
    assert body["id"] == f"cmpl-{rid}"
    assert body["object"] == "text_completion"
    assert body["model"] == MODEL_NAME
    assert isinstance(body["created"], int)
    assert body["system_fingerprint"].startswith(f"vllm-{VLLM_VERSION}-")
    (choice,) = body["choices"]
    assert choice["index"] == 0
    assert choice["finish_reason"] == "length"
    assert choice["stop_reason"] is None
    assert isinstance(choice["text"], str) and choice["text"]
    assert body["usage"] == {
        "prompt_tokens": 13,
        "total_tokens": 18,
        "completion_tokens": 5,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }
    assert body["kv_transfer_params"] is None
    req_rec = {**req, "prompt": "<12 words>"}
    wire.capture("single", "completion", record_json(r, rid, req_rec))


def test_chat_completion(single_engine: Any, wire: Any, vocab_words: list[str]) -> None:
    rid = new_rid("chat")
    req = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": make_prompt(vocab_words, 6, seed=3)}],
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
    }
    r = http("POST", single_engine.url + "/v1/chat/completions", req, {"X-Request-Id": rid})
    assert r.status == 200, r.body
    body = r.json()
    assert body["id"] == f"chatcmpl-{rid}"
    assert body["object"] == "chat.completion"
    assert body["model"] == MODEL_NAME
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str) and choice["message"]["content"]
    assert body["usage"]["prompt_tokens"] == 6 + 4
    assert body["usage"]["completion_tokens"] == 4
    assert body["usage"]["total_tokens"] == 14
    assert body["kv_transfer_params"] is None
    req_rec = {**req, "messages": [{"role": "user", "content": "<6 words>"}]}
    wire.capture("single", "chat_completion", record_json(r, rid, req_rec))


def test_completion_stream(single_engine: Any, wire: Any, vocab_words: list[str]) -> None:
    rid = new_rid("cmpl-stream")
    req = {
        "model": MODEL_NAME,
        "prompt": make_prompt(vocab_words, 9, seed=4),
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    r = http("POST", single_engine.url + "/v1/completions", req, {"X-Request-Id": rid})
    assert r.status == 200, r.body
    assert r.headers["content-type"] == "text/event-stream; charset=utf-8"
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == {"prompt_tokens": 10, "total_tokens": 14, "completion_tokens": 4}
    token_chunks = chunks[:-1]
    assert token_chunks, "no token chunks"
    for c in chunks:
        assert c["id"] == f"cmpl-{rid}"
        assert c["object"] == "text_completion"
        assert c["model"] == MODEL_NAME
    for c in token_chunks:
        assert "usage" not in c
        assert len(c["choices"]) == 1
    assert all(c["choices"][0]["finish_reason"] is None for c in token_chunks[:-1])
    assert token_chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(c["choices"][0]["text"] for c in token_chunks).strip()
    rec = record_stream(r, events, rid, {**req, "prompt": "<9 words>"})
    wire.capture_stream("single", "completion_stream", rec)


def test_completion_stream_without_usage(single_engine: Any, vocab_words: list[str]) -> None:
    req = {
        "model": MODEL_NAME,
        "prompt": make_prompt(vocab_words, 5, seed=5),
        "max_tokens": 3,
        "ignore_eos": True,
        "stream": True,
    }
    r = http("POST", single_engine.url + "/v1/completions", req)
    assert r.status == 200
    chunks = sse_events(r)[:-1]
    assert all("usage" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    # Without X-Request-Id vLLM makes up an id: "cmpl-" + 16 hex characters.
    assert re.fullmatch(r"cmpl-[0-9a-f]{16}", chunks[0]["id"]), chunks[0]["id"]


def test_chat_stream(single_engine: Any, wire: Any, vocab_words: list[str]) -> None:
    rid = new_rid("chat-stream")
    req = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": make_prompt(vocab_words, 5, seed=6)}],
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    r = http("POST", single_engine.url + "/v1/chat/completions", req, {"X-Request-Id": rid})
    assert r.status == 200, r.body
    assert r.headers["content-type"] == "text/event-stream; charset=utf-8"
    events = sse_events(r)
    chunks = events[:-1]
    first = chunks[0]
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first["choices"][0]["finish_reason"] is None
    for c in chunks:
        assert c["id"] == f"chatcmpl-{rid}"
        assert c["object"] == "chat.completion.chunk"
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == {"prompt_tokens": 9, "total_tokens": 13, "completion_tokens": 4}
    content_chunks = chunks[1:-1]
    assert content_chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all("role" not in c["choices"][0]["delta"] for c in content_chunks)
    rec = record_stream(
        r, events, rid, {**req, "messages": [{"role": "user", "content": "<5 words>"}]}
    )
    wire.capture_stream("single", "chat_stream", rec)


_TOO_LONG = "gek " * 2100  # gek is a word of the tiny vocabulary: 2101 tokens with BOS

BAD_REQUESTS: dict[str, tuple[str, Any, dict[str, str], int, str]] = {
    # name: (path, body (dict or raw bytes), extra headers, status, substring of message)
    "stream_options_without_stream": (
        "/v1/completions",
        {
            "model": MODEL_NAME,
            "prompt": "gek",
            "max_tokens": 3,
            "stream_options": {"include_usage": True},
        },
        {},
        400,
        "Stream options can only be defined when `stream=True`.",
    ),
    "stream_options_without_stream_chat": (
        "/v1/chat/completions",
        {
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": "gek"}],
            "max_tokens": 3,
            "stream": False,
            "stream_options": {"include_usage": True},
        },
        {},
        400,
        "Stream options can only be defined when `stream=True`.",
    ),
    "min_tokens_greater_than_max_tokens": (
        "/v1/completions",
        {"model": MODEL_NAME, "prompt": "gek", "max_tokens": 3, "min_tokens": 5},
        {},
        400,
        "min_tokens must be less than or equal to max_tokens=3, got 5.",
    ),
    "unknown_model": (
        "/v1/completions",
        {"model": "no-such-model", "prompt": "gek", "max_tokens": 3},
        {},
        404,
        "The model `no-such-model` does not exist.",
    ),
    "unknown_model_chat": (
        "/v1/chat/completions",
        {"model": "no-such-model", "messages": [{"role": "user", "content": "gek"}]},
        {},
        404,
        "The model `no-such-model` does not exist.",
    ),
    "prompt_longer_than_max_model_len": (
        "/v1/completions",
        {"model": MODEL_NAME, "prompt": _TOO_LONG, "max_tokens": 3},
        {},
        400,
        "This model's maximum context length is 2048 tokens.",
    ),
    "max_tokens_greater_than_max_model_len": (
        "/v1/completions",
        {"model": MODEL_NAME, "prompt": "gek", "max_tokens": 3000},
        {},
        400,
        "max_tokens=3000 cannot be greater than max_model_len=2048.",
    ),
    "malformed_json": (
        "/v1/completions",
        b'{"model": "tiny", "prompt": "gek", "max_tokens": 3',
        {},
        400,
        "JSON decode error",
    ),
    "wrong_content_type": (
        "/v1/completions",
        b'{"model": "tiny", "prompt": "gek"}',
        {"Content-Type": "text/plain"},
        400,
        "Only 'application/json' is allowed",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_request(single_engine: Any, wire: Any, case: str) -> None:
    path, body, headers, status, message = BAD_REQUESTS[case]
    r = http("POST", single_engine.url + path, body, headers)
    assert r.status == status, (r.status, r.body)
    assert r.headers["content-type"] == "application/json"
    err = r.json()
    assert list(err) == ["error"]
    assert list(err["error"]) == ERROR_KEYS
    assert err["error"]["code"] == status
    assert message in err["error"]["message"], err["error"]["message"]
    if isinstance(body, bytes):
        req_rec: Any = body.decode()
    elif body.get("prompt") == _TOO_LONG:
        req_rec = {**body, "prompt": "<'gek ' * 2100>"}
    else:
        req_rec = body
    rec = record_json(r, request={"path": path, "headers": headers, "body": req_rec})
    wire.capture("errors", case, rec)


def test_error_types(single_engine: Any) -> None:
    """The error type and param per kind of error, as 0.32.0 sends them."""
    url = single_engine.url
    cases = {
        "stream_options_without_stream": ("BadRequestError", "stream_options"),
        "min_tokens_greater_than_max_tokens": ("BadRequestError", None),
        "unknown_model": ("NotFoundError", "model"),
        "prompt_longer_than_max_model_len": ("BadRequestError", "input_tokens"),
        "max_tokens_greater_than_max_model_len": ("BadRequestError", "max_tokens"),
        "wrong_content_type": ("Bad Request", None),
    }
    for case, (typ, param) in cases.items():
        path, body, headers, _, _ = BAD_REQUESTS[case]
        err = http("POST", url + path, body, headers).json()["error"]
        assert (err["type"], err["param"]) == (typ, param), (case, err)
    # A JSON syntax error names the byte offset: type "Bad Request", param "body.<offset>".
    path, body, headers, _, _ = BAD_REQUESTS["malformed_json"]
    err = http("POST", url + path, body, headers).json()["error"]
    assert err["type"] == "Bad Request"
    assert re.fullmatch(r"body\.\d+", err["param"]), err


def test_metrics_single(single_engine: Any, wire: Any, vocab_words: list[str]) -> None:
    url = single_engine.url
    before = metrics(url)
    req = {
        "model": MODEL_NAME,
        "prompt": make_prompt(vocab_words, 30, seed=7),
        "max_tokens": 6,
        "ignore_eos": True,
        "stream": True,
    }
    r = http("POST", url + "/v1/completions", req)
    assert r.status == 200

    def counters() -> tuple[float, float, float, float]:
        f = metrics(url)
        return (
            f["vllm:prompt_tokens_total"].value("vllm:prompt_tokens_total"),
            f["vllm:generation_tokens_total"].value("vllm:generation_tokens_total"),
            f["vllm:time_to_first_token_seconds"].value("vllm:time_to_first_token_seconds_count"),
            f["vllm:inter_token_latency_seconds"].value("vllm:inter_token_latency_seconds_count"),
        )

    b = (
        before["vllm:prompt_tokens_total"].value("vllm:prompt_tokens_total"),
        before["vllm:generation_tokens_total"].value("vllm:generation_tokens_total"),
        before["vllm:time_to_first_token_seconds"].value("vllm:time_to_first_token_seconds_count"),
        before["vllm:inter_token_latency_seconds"].value("vllm:inter_token_latency_seconds_count"),
    )
    want = (b[0] + 31, b[1] + 6, b[2] + 1, b[3] + 5)
    got = wait_for(lambda: (c := counters()) == want and c)
    assert got == want, f"counters {counters()} != expected {want}"

    fams = metrics(url)
    std = ["engine", "model_name"]
    assert_family(fams, "vllm:num_requests_running", "gauge", std)
    assert_family(fams, "vllm:num_requests_waiting", "gauge", std)
    assert_family(fams, "vllm:num_requests_waiting_by_reason", "gauge", [*std, "reason"])
    assert_family(fams, "vllm:kv_cache_usage_perc", "gauge", std)
    assert_family(fams, "vllm:prompt_tokens_total", "counter", std)
    assert_family(fams, "vllm:generation_tokens_total", "counter", std)
    assert_family(fams, "vllm:num_preemptions_total", "counter", std)
    assert_family(fams, "vllm:request_success_total", "counter", [*std, "finished_reason"])
    ttft = assert_family(fams, "vllm:time_to_first_token_seconds", "histogram", std)
    itl = assert_family(fams, "vllm:inter_token_latency_seconds", "histogram", std)
    for fam in (ttft, itl):
        suffixes = {s[len(fam.name) :] for s, _, _ in fam.samples}
        assert suffixes == {"_bucket", "_count", "_sum"}
    assert fams["vllm:num_requests_running"].value("vllm:num_requests_running") == 0
    assert fams["vllm:num_requests_waiting"].value("vllm:num_requests_waiting") == 0
    assert 0.0 <= fams["vllm:kv_cache_usage_perc"].value("vllm:kv_cache_usage_perc") <= 1.0
    cc = assert_family(fams, "vllm:cache_config_info", "gauge")
    ((_, labels, value),) = cc.samples
    assert value == 1.0
    assert "model_name" not in labels  # cache_config_info has engine but no model_name
    assert labels["engine"] == "0"
    assert int(labels["block_size"]) == 128  # the CPU backend's block size
    # VLLM_CPU_KVCACHE_SPACE=1 GiB / (128 tokens x 2 layers x K,V x 2 KV heads x 64 x 4 bytes)
    assert int(labels["num_gpu_blocks"]) == (1 << 30) // (128 * 2 * 2 * 2 * 64 * 4) == 4096
    # No vllm:time_per_output_token_seconds (gone since 0.17) and no gpu_cache_usage_perc.
    assert "vllm:time_per_output_token_seconds" not in fams
    assert "vllm:gpu_cache_usage_perc" not in fams
    assert not any(name.startswith("vllm:nixl_") for name in fams)
    check_metric_shapes(wire, "single", summarize_families(fams))
