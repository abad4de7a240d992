"""Fuzz: random JSON and random bytes at every endpoint never crash the emulator or leak KV.

Every answer must be a well-formed HTTP response; a 4xx/5xx carries a JSON error body, and no
500 is the catch-all "unexpected exception" one (that would be a bug, not vLLM behaviour). After
the run every request has ended, every lease has expired or been released, and the block pool,
the engines and `vllm:kv_cache_usage_perc` are back to empty.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from emulator_testkit import H100, Http, sample
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from disaggpool.emulator.harness import EmulatorThread

GENERATION = ["/v1/completions", "/v1/chat/completions"]
OTHER_POST = ["/tokenize", "/detokenize"]
GET_ONLY = ["/health", "/version", "/v1/models", "/metrics"]
UNKNOWN = ["/v1/embeddings", "/", "/v1"]

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=30)
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=12,
)
token_lists = st.lists(st.integers(-5, 40000), max_size=30)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant"]) | json_values},
        optional={"content": st.text(max_size=60) | json_values},
    ),
    max_size=4,
)


def kv_params(side_port: int) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries(
        {},
        optional={
            "do_remote_decode": st.booleans(),
            "do_remote_prefill": st.booleans(),
            "remote_engine_id": st.text(max_size=8) | st.none(),
            "remote_request_id": st.text(max_size=12) | st.none(),
            "remote_host": st.sampled_from(["127.0.0.1", "localhost"]) | st.none(),
            "remote_port": st.sampled_from([side_port, 1, 65535]) | st.integers() | json_values,
            "remote_block_ids": st.lists(st.lists(st.integers(-1, 10), max_size=3), max_size=2)
            | json_values,
            "remote_num_tokens": st.integers(-1, 10) | json_values,
        },
    )


LAST_PARAMS = "<the kv_transfer_params of the last prefill leg>"


def decode_leg_params(side_port: int) -> st.SearchStrategy[dict[str, Any]]:
    """Complete decode-leg coordinates with arbitrary values: every read of them must fail."""
    return st.fixed_dictionaries(
        {
            "do_remote_prefill": st.just(True),
            "remote_engine_id": st.text(max_size=8),
            "remote_request_id": st.text(max_size=12),
            "remote_host": st.sampled_from(
                ["127.0.0.1", "localhost", "::1", "", "256.256.256.256", "nul\x00host"]
            ),
            "remote_port": st.sampled_from([side_port, 1]) | st.integers(-1, 70000),
            "remote_block_ids": st.lists(st.lists(st.integers(-1, 10), max_size=3), max_size=2),
        }
    )


def bodies(side_port: int) -> st.SearchStrategy[bytes | dict[str, Any]]:
    """Raw bytes, any JSON, or a request close to valid with a few fields of any JSON type."""
    text_prompt = st.text(min_size=1, max_size=80)
    valid_messages = st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system"]), "content": st.text(max_size=40)}
        ),
        min_size=1,
        max_size=3,
    )
    common = {
        "model": st.just("fuzz") | st.sampled_from(["other"]),
        "max_tokens": st.integers(-2, 40),
        "min_tokens": st.integers(-1, 8),
        "stream": st.booleans(),
        "stream_options": st.fixed_dictionaries(
            {},
            optional={"include_usage": st.booleans(), "continuous_usage_stats": st.booleans()},
        ),
        "kv_transfer_params": kv_params(side_port)
        | decode_leg_params(side_port)
        | st.just({"do_remote_decode": True})
        | st.just(LAST_PARAMS)
        | st.just(LAST_PARAMS),
        "seed": st.integers(),
        "ignore_eos": st.booleans(),
        "request_id": st.text(max_size=10),
    }
    completion = st.fixed_dictionaries({"prompt": text_prompt | token_lists}, optional=common)
    chat = st.fixed_dictionaries(
        {"messages": valid_messages},
        optional={**common, "max_completion_tokens": st.integers(-2, 40)},
    )
    tokenize = st.fixed_dictionaries(
        {}, optional={"prompt": text_prompt, "messages": valid_messages, "tokens": token_lists}
    )
    near_valid = st.one_of(completion, chat, tokenize)
    mutated = st.tuples(near_valid, st.dictionaries(st.text(max_size=12), json_values, max_size=2))
    return (
        near_valid
        | mutated.map(lambda pair: {**pair[0], **pair[1]})
        | json_values.map(lambda v: json.dumps(v).encode())
        | st.binary(max_size=200)
    )


def check_reply(status: int, headers: dict[str, str], body: bytes) -> None:
    assert 200 <= status < 600
    if status >= 400:
        assert headers["content-type"].startswith("application/json"), (status, body)
        doc = json.loads(body)
        assert "error" in doc or "detail" in doc
        if status == 500:
            # A 500 may only come from a failed KV pull, never from the catch-all handler.
            assert "KV transfer" in doc["error"]["message"], body
        return
    if headers.get("content-type", "").startswith("text/event-stream"):
        assert body.endswith(b"data: [DONE]\n\n"), body[-200:]
        for event in body.split(b"\n\n")[:-1]:
            assert event.startswith(b"data: ")
            if event != b"data: [DONE]":
                json.loads(event[len(b"data: ") :])
    elif headers.get("content-type", "").startswith("application/json"):
        json.loads(body)


@pytest.fixture
def fuzz_emu(start_emulator: Any) -> EmulatorThread:
    emu: EmulatorThread = start_emulator(
        H100.scaled(100.0),
        served_model_names=("fuzz",),
        max_model_len=256,
        kv_lease_duration=0.5,
        pull_timeout=0.5,
        max_num_queued_reqs=50,
    )
    return emu


def test_fuzz_every_endpoint(fuzz_emu: EmulatorThread, http: Http) -> None:
    emu = fuzz_emu
    paths = GENERATION * 4 + OTHER_POST + GET_ONLY + UNKNOWN
    last: dict[str, Any] = {}

    @settings(
        max_examples=200,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(
        path=st.sampled_from(paths),
        method=st.sampled_from(["POST"] * 8 + ["GET", "PUT", "DELETE"]),
        body=bodies(emu.side_channel_port),
        hang_up=st.integers(0, 9).map(lambda i: i == 0),
    )
    def one(path: str, method: str, body: bytes | dict[str, Any], hang_up: bool) -> None:
        if isinstance(body, dict):
            if body.get("kv_transfer_params") == LAST_PARAMS:
                body["kv_transfer_params"] = last.get("params", {"do_remote_prefill": True})
            body = json.dumps(body).encode()
        if hang_up:  # the client goes away before the answer: the request must still end
            http.send_and_close(method, emu.url + path, body)
            return
        reply = http.request(method, emu.url + path, body)
        check_reply(reply.status, reply.headers, reply.body)
        is_json = reply.headers.get("content-type", "").startswith("application/json")
        if reply.status == 200 and is_json and b'"remote_request_id"' in reply.body:
            last["params"] = reply.json()["kv_transfer_params"]

    one()

    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        state = emu.call(
            lambda: (
                emu.instance.active_requests,
                len(emu.instance.lending.leases),
                emu.instance.lending.pool.num_free,
                emu.instance.prefill.engine.kv_used,
                emu.instance.decode.engine.idle,
            )
        )
        if state == (0, 0, emu.instance.lending.pool.total, 0, True):
            break
        time.sleep(0.05)
    assert state == (0, 0, emu.instance.lending.pool.total, 0, True)
    fams = http.metrics(emu.url)
    assert sample(fams, "vllm:kv_cache_usage_perc") == 0
    assert sample(fams, "vllm:num_requests_running") == 0
    assert sample(fams, "vllm:num_requests_waiting") == 0
    assert http.get(emu.url + "/health").status == 200
