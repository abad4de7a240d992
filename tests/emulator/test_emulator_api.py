"""Response shapes of the emulator's OpenAI API, over real HTTP, against vLLM 0.33's."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import pytest
from emulator_testkit import H100, Http, eventually, sample

from disaggpool.emulator.config import EmulatorConfig
from disaggpool.emulator.harness import EmulatorThread
from disaggpool.emulator.metrics import ITL_BUCKETS, TTFT_BUCKETS
from disaggpool.wordtokenizer import Tokenizer

MODEL = H100.model


@pytest.fixture
def emu(start_emulator: Any) -> EmulatorThread:
    emu: EmulatorThread = start_emulator(
        served_model_names=("llama", "llama-alias"), max_model_len=2048
    )
    return emu


def test_health_version_models(emu: EmulatorThread, http: Http) -> None:
    health = http.get(emu.url + "/health")
    assert (health.status, health.body) == (200, b"")
    assert http.get(emu.url + "/ping").status == 200
    assert http.get(emu.url + "/version").json() == {"version": "0.33.0"}
    models = http.get(emu.url + "/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == ["llama", "llama-alias"]
    card = models["data"][0]
    assert card["object"] == "model"
    assert card["owned_by"] == "vllm"
    assert card["root"] == MODEL
    assert card["parent"] is None
    assert card["max_model_len"] == 2048
    assert card["permission"][0]["object"] == "model_permission"


def test_tokenize_prompt_and_messages(emu: EmulatorThread, http: Http) -> None:
    reply = http.post(emu.url + "/tokenize", {"prompt": "Hello, world!"}).json()
    assert list(reply) == ["count", "max_model_len", "tokens", "token_strs"]
    assert reply["count"] == 5 == len(reply["tokens"])  # BOS + 4, as a Llama tokenizer
    assert reply["max_model_len"] == 2048
    assert reply["tokens"] == [1, *Tokenizer().encode("Hello, world!")]
    assert reply["token_strs"] is None
    strs = http.post(emu.url + "/tokenize", {"prompt": "a b", "return_token_strs": True}).json()
    assert strs["token_strs"] == ["<s>", "a", "b"]
    bare = http.post(emu.url + "/tokenize", {"prompt": "a b", "add_special_tokens": False}).json()
    assert bare["count"] == 2
    chat = http.post(
        emu.url + "/tokenize", {"messages": [{"role": "user", "content": "Hello, world!"}]}
    ).json()
    assert chat["count"] > 5  # the template's markup counts too
    assert chat["tokens"][0] == 1  # the template starts with BOS
    detok = http.post(emu.url + "/detokenize", {"tokens": [1, 7, 8, 9]}).json()
    assert Tokenizer().encode(detok["prompt"]) == [7, 8, 9]  # special tokens are skipped


def test_completion_shape_and_usage(emu: EmulatorThread, http: Http) -> None:
    prompt = "the quick brown fox jumps over the lazy dog"
    n = len(Tokenizer().encode(prompt)) + 1  # BOS
    reply = http.post(
        emu.url + "/v1/completions",
        {"model": "llama-alias", "prompt": prompt, "max_tokens": 7},
        {"X-Request-Id": "req-42"},
    )
    assert reply.status == 200
    assert reply.headers["content-type"].startswith("application/json")
    body = reply.json()
    assert body["id"] == "cmpl-req-42"
    assert body["object"] == "text_completion"
    assert body["model"] == "llama-alias"
    assert isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert choice["index"] == 0
    assert choice["finish_reason"] == "length"
    assert len(Tokenizer().encode(choice["text"])) == 7
    assert body["usage"] == {
        "prompt_tokens": n,
        "total_tokens": n + 7,
        "completion_tokens": 7,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }
    assert body["kv_transfer_params"] is None
    assert body["system_fingerprint"].startswith("vllm-0.33.0-")
    # default max_tokens is 16; token ids are accepted as a prompt; body request_id is used
    reply = http.post(emu.url + "/v1/completions", {"prompt": [5, 6, 7], "request_id": "abc"})
    body = reply.json()
    assert body["id"] == "cmpl-abc"
    assert body["usage"]["prompt_tokens"] == 3  # token ids are taken as they are
    assert body["usage"]["completion_tokens"] == 16


def test_chat_shape_default_max_tokens(start_emulator: Any, http: Http) -> None:
    emu = start_emulator(max_model_len=64, profile=H100.scaled(20.0))
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    n = http.post(emu.url + "/tokenize", {"messages": messages}).json()["count"]
    body = http.post(
        emu.url + "/v1/chat/completions", {"messages": messages}, {"X-Request-Id": "c1"}
    ).json()
    assert body["id"] == "chatcmpl-c1"
    assert body["object"] == "chat.completion"
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] == "length"
    # chat runs to the context limit by default, and max_completion_tokens wins over max_tokens
    assert body["usage"]["completion_tokens"] == 64 - n
    body = http.post(
        emu.url + "/v1/chat/completions",
        {"messages": messages, "max_tokens": 9, "max_completion_tokens": 3},
    ).json()
    assert body["usage"]["completion_tokens"] == 3


def test_completion_stream(emu: EmulatorThread, http: Http) -> None:
    stream = http.sse(
        emu.url + "/v1/completions",
        {"prompt": "one two", "max_tokens": 4, "stream": True},
        {"X-Request-Id": "s1"},
    )
    assert stream.status == 200
    assert stream.headers["content-type"].startswith("text/event-stream")
    assert stream.events[-1][1] == "[DONE]"
    chunks = stream.chunks()
    assert len(chunks) == 4  # one per token, the last one carrying the finish reason
    assert all(c["id"] == "cmpl-s1" and c["object"] == "text_completion" for c in chunks)
    assert list(chunks[0]["choices"][0]) == [
        "index",
        "text",
        "logprobs",
        "finish_reason",
        "stop_reason",
        "prompt_token_ids",
        "token_ids",
    ]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "length"]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert len(Tokenizer().encode(text)) == 4
    assert all("usage" not in c for c in chunks)


def test_chat_stream_role_first_and_usage_chunk(emu: EmulatorThread, http: Http) -> None:
    stream = http.sse(
        emu.url + "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    chunks = stream.chunks()
    assert stream.events[-1][1] == "[DONE]"
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks[1:-1]] == [None, None, "length"]
    assert all("content" in c["choices"][0]["delta"] for c in chunks[1:-1])
    last = chunks[-1]
    assert last["choices"] == []
    assert list(last["usage"]) == ["prompt_tokens", "total_tokens", "completion_tokens"]
    assert last["usage"]["completion_tokens"] == 3
    assert last["usage"]["total_tokens"] == last["usage"]["prompt_tokens"] + 3
    assert last["system_fingerprint"].startswith("vllm-0.33.0-")


def test_continuous_usage_stats(emu: EmulatorThread, http: Http) -> None:
    stream = http.sse(
        emu.url + "/v1/completions",
        {
            "prompt": "x",
            "max_tokens": 3,
            "stream": True,
            "stream_options": {"continuous_usage_stats": True},
        },
    )
    assert [c["usage"]["completion_tokens"] for c in stream.chunks()] == [1, 2, 3]


def test_seeded_output_is_deterministic(emu: EmulatorThread, http: Http) -> None:
    body = {"prompt": "same", "max_tokens": 8, "seed": 7}
    a = http.post(emu.url + "/v1/completions", body).json()["choices"][0]["text"]
    b = http.post(emu.url + "/v1/completions", body).json()["choices"][0]["text"]
    assert a == b
    other = http.post(emu.url + "/v1/completions", {**body, "seed": 8}).json()
    assert other["choices"][0]["text"] != a  # the seed matters, not just the prompt


def test_metrics_names_types_labels_buckets(emu: EmulatorThread, http: Http) -> None:
    http.post(emu.url + "/v1/completions", {"prompt": "count me", "max_tokens": 5})
    reply = http.get(emu.url + "/metrics")
    assert reply.headers["content-type"].startswith("text/plain")
    fams = http.metrics(emu.url)
    assert fams["vllm:prompt_tokens_created"].type == "gauge"  # as single-process vLLM has
    types = {
        "vllm:num_requests_running": "gauge",
        "vllm:num_requests_waiting": "gauge",
        "vllm:num_requests_waiting_by_reason": "gauge",
        "vllm:kv_cache_usage_perc": "gauge",
        "vllm:cache_config_info": "gauge",
        "vllm:time_to_first_token_seconds": "histogram",
        "vllm:inter_token_latency_seconds": "histogram",
        "vllm:e2e_request_latency_seconds": "histogram",
        "vllm:prompt_tokens": "counter",
        "vllm:generation_tokens": "counter",
        "vllm:request_success": "counter",
        "vllm:num_preemptions": "counter",
        "vllm:nixl_xfer_time_seconds": "histogram",
        "vllm:nixl_bytes_transferred": "histogram",
        "vllm:nixl_num_failed_transfers": "counter",
        "vllm:nixl_num_kv_expired_reqs": "counter",
    }
    for name, kind in types.items():
        assert fams[name].type == kind, name
    for fam in fams.values():
        if not fam.name.startswith("vllm:") or fam.name in (
            "vllm:cache_config_info",
            "vllm:admission_rejections",
            "vllm:admission_rejections_created",
        ):
            continue
        for s in fam.samples:
            assert s.labels["model_name"] == "llama" and s.labels["engine"] == "0", s
    assert "model_name" not in fams["vllm:cache_config_info"].samples[0].labels
    assert "process_cpu_seconds" in fams
    info = fams["vllm:cache_config_info"].samples[0]
    assert info.value == 1
    assert info.labels["block_size"] == "16"
    assert info.labels["num_gpu_blocks"] == str(H100.kv_capacity_tokens // 16)
    assert info.labels["engine"] == "0"
    ttft_bounds = [
        float(s.labels["le"])
        for s in fams["vllm:time_to_first_token_seconds"].samples
        if s.name.endswith("_bucket")
    ]
    assert ttft_bounds == [*TTFT_BUCKETS, float("inf")]
    itl_bounds = [
        float(s.labels["le"])
        for s in fams["vllm:inter_token_latency_seconds"].samples
        if s.name.endswith("_bucket")
    ]
    assert itl_bounds == [*ITL_BUCKETS, float("inf")]
    assert sample(fams, "vllm:prompt_tokens_total") == 3  # BOS + 2 words
    assert sample(fams, "vllm:generation_tokens_total") == 5
    assert sample(fams, "vllm:request_success_total", finished_reason="length") == 1
    assert sample(fams, "vllm:time_to_first_token_seconds_count") == 1
    assert sample(fams, "vllm:inter_token_latency_seconds_count") == 4
    assert sample(fams, "vllm:e2e_request_latency_seconds_count") == 1
    assert sample(fams, "vllm:num_requests_waiting_by_reason", reason="deferred") == 0
    assert sample(fams, "vllm:kv_cache_usage_perc") == 0


def test_running_gauge_and_kv_usage_while_busy(start_emulator: Any, http: Http) -> None:
    emu = start_emulator()
    results: list[int] = []
    thread = threading.Thread(
        target=lambda: results.append(
            http.post(emu.url + "/v1/completions", {"prompt": "w " * 500, "max_tokens": 30}).status
        )
    )
    thread.start()

    def busy() -> None:
        fams = http.metrics(emu.url)
        assert sample(fams, "vllm:num_requests_running") == 1
        assert sample(fams, "vllm:kv_cache_usage_perc") > 0

    eventually(busy)
    thread.join()
    assert results == [200]
    assert sample(http.metrics(emu.url), "vllm:num_requests_running") == 0


def test_routing_errors_are_json(emu: EmulatorThread, http: Http) -> None:
    missing = http.get(emu.url + "/v1/nothing")
    assert missing.status == 404 and missing.json() == {"detail": "Not Found"}
    wrong = http.get(emu.url + "/v1/completions")
    assert wrong.status == 405 and wrong.json() == {"detail": "Method Not Allowed"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_startup_delay_refuses_connections(http: Http) -> None:
    port = _free_port()
    cfg = EmulatorConfig(H100, port=port, side_channel_port=0, startup_delay=0.6)
    emu = EmulatorThread(cfg)
    starter = threading.Thread(target=emu.start)
    starter.start()
    try:
        # The sleep is the thing under test: 0.2 s into its 0.6 s startup delay, the emulator
        # is running but must not listen yet.
        time.sleep(0.2)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        starter.join(10)
        assert http.get(f"http://127.0.0.1:{port}/health").status == 200
    finally:
        starter.join(10)
        emu.stop()
