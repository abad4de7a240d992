"""The prefill/decode handoff between two emulators, as vLLM's toy proxy and llm-d drive it.

Step 1 posts the prefill leg (`do_remote_decode`, max_tokens 1, stream false) to P; step 2 posts
the client's original body plus P's `kv_transfer_params`, unchanged, to D. D pulls the KV over
the real TCP side channel and P frees the blocks when notified, or when the lease expires.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any

import pytest
from emulator_testkit import H100, Http, eventually, make_profile, sample

from disaggpool.emulator.harness import EmulatorThread
from disaggpool.wordtokenizer import Tokenizer

PROMPT = "a prompt of exactly twelve words for the prefill leg to chew on"
N_PROMPT = len(Tokenizer().encode(PROMPT)) + 1  # BOS
PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
V33_KEYS = [
    "do_remote_prefill",
    "do_remote_decode",
    "remote_block_ids",
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
    "tp_size",
    "dcp_size",
    "pp_size",
    "remote_num_tokens",
    "remote_blocks_expiry_time",
    "remote_registration_generation",
    "transfer_mode",
    "remote_prefill_cached_tokens",
]


def prefill_leg(
    http: Http, p: EmulatorThread, path: str, body: dict[str, Any], rid: str
) -> dict[str, Any]:
    """What the proxy sends P: the body with the P-leg changes of docs/vllm-protocol.md §2.1."""
    leg = {**body, "kv_transfer_params": PREFILL_PARAMS, "stream": False, "max_tokens": 1}
    for key in ("stream_options", "min_tokens"):
        leg.pop(key, None)
    reply = http.post(p.url + path, leg, {"X-Request-Id": rid})
    assert reply.status == 200, reply.body
    out: dict[str, Any] = reply.json()
    return out


def free_blocks(emu: EmulatorThread) -> tuple[int, int]:
    return emu.call(lambda: (emu.instance.lending.pool.num_free, emu.instance.lending.pool.total))


@pytest.fixture
def pair(start_emulator: Any) -> tuple[EmulatorThread, EmulatorThread]:
    return start_emulator(), start_emulator()


def test_prefill_leg_response(pair: tuple[EmulatorThread, EmulatorThread], http: Http) -> None:
    p, _ = pair
    body = prefill_leg(http, p, "/v1/completions", {"prompt": PROMPT, "max_tokens": 20}, "r1")
    assert body["id"] == "cmpl-r1"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 1
    assert body["usage"]["prompt_tokens"] == N_PROMPT
    kv = body["kv_transfer_params"]
    assert list(kv) == V33_KEYS
    blocks = -(-N_PROMPT // 16)
    assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False
    assert len(kv["remote_block_ids"]) == 1 and len(kv["remote_block_ids"][0]) == blocks
    assert all(isinstance(b, int) for b in kv["remote_block_ids"][0])
    assert kv["remote_engine_id"] == p.config.engine_id
    assert kv["remote_request_id"].startswith("cmpl-r1-0-")
    assert len(kv["remote_request_id"]) == len("cmpl-r1-0-") + 8
    assert kv["remote_host"] == "127.0.0.1"
    assert kv["remote_port"] == p.side_channel_port
    assert (kv["tp_size"], kv["dcp_size"], kv["pp_size"]) == (1, 1, 1)
    assert kv["remote_num_tokens"] == N_PROMPT
    assert kv["remote_blocks_expiry_time"] is None
    assert kv["remote_registration_generation"] == 0
    assert kv["transfer_mode"] == "pull"
    assert kv["remote_prefill_cached_tokens"] == 0
    free, total = free_blocks(p)
    assert total - free == blocks  # lent until D reads them
    fams = http.metrics(p.url)
    assert sample(fams, "vllm:kv_cache_usage_perc") > 0
    assert sample(fams, "vllm:generation_tokens_total") == 1


def test_chat_prefill_request_id(pair: tuple[EmulatorThread, EmulatorThread], http: Http) -> None:
    p, _ = pair
    msgs = [{"role": "user", "content": PROMPT}]
    body = prefill_leg(http, p, "/v1/chat/completions", {"messages": msgs}, "c9")
    assert body["id"] == "chatcmpl-c9"
    rid = body["kv_transfer_params"]["remote_request_id"]
    assert rid.startswith("chatcmpl-c9-") and len(rid) == len("chatcmpl-c9-") + 8


@pytest.mark.parametrize("stream", [False, True])
def test_two_step_handoff(
    pair: tuple[EmulatorThread, EmulatorThread], http: Http, stream: bool
) -> None:
    p, d = pair
    original: dict[str, Any] = {"prompt": PROMPT, "max_tokens": 6, "min_tokens": 2}
    if stream:
        original |= {"stream": True, "stream_options": {"include_usage": True}}
    kv = prefill_leg(http, p, "/v1/completions", original, "h1")["kv_transfer_params"]
    decode_body = {**original, "kv_transfer_params": kv}
    if stream:
        s = http.sse(d.url + "/v1/completions", decode_body, {"X-Request-Id": "h1"})
        chunks = s.chunks()
        assert s.events[-1][1] == "[DONE]"
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
        usage = chunks[-1]["usage"]
        assert all(c["id"] == "cmpl-h1" for c in chunks)
    else:
        reply = http.post(d.url + "/v1/completions", decode_body, {"X-Request-Id": "h1"})
        assert reply.status == 200, reply.body
        body = reply.json()
        assert body["id"] == "cmpl-h1"
        assert body["kv_transfer_params"] is None
        usage = body["usage"]
    assert usage["prompt_tokens"] == N_PROMPT
    assert usage["completion_tokens"] == 6
    assert usage["total_tokens"] == N_PROMPT + 6
    # D's notification came back over the side channel: P's blocks are free again.
    assert free_blocks(p) == (p.instance.lending.pool.total, p.instance.lending.pool.total)
    assert sample(http.metrics(p.url), "vllm:kv_cache_usage_perc") == 0
    fams = http.metrics(d.url)
    assert sample(fams, "vllm:nixl_xfer_time_seconds_count") == 1
    expected = H100.kv_transfer.time(N_PROMPT)
    assert sample(fams, "vllm:nixl_xfer_time_seconds_sum") == pytest.approx(expected)
    blocks = -(-N_PROMPT // 16)
    assert sample(fams, "vllm:nixl_bytes_transferred_sum") == blocks * 16 * 128 * 1024
    assert sample(fams, "vllm:nixl_num_failed_transfers_total") == 0
    assert sample(fams, "vllm:prompt_tokens_total") == N_PROMPT
    assert sample(fams, "vllm:generation_tokens_total") == 6
    assert sample(fams, "vllm:request_success_total", finished_reason="length") == 1
    # The same params cannot be used twice: P no longer knows that request.
    again = {"prompt": PROMPT, "kv_transfer_params": kv}
    assert http.post(d.url + "/v1/completions", again).status == 500


def _side_channel(port: int, *messages: dict[str, Any]) -> list[dict[str, Any]]:
    """Send JSON lines to a prefill emulator's side channel; its answer to each."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        lines = conn.makefile("rwb")
        answers = []
        for msg in messages:
            lines.write(json.dumps(msg).encode() + b"\n")
            lines.flush()
            answers.append(json.loads(lines.readline()))
    return answers


def test_side_channel_refuses_a_bad_skip_and_keeps_the_lease(
    pair: tuple[EmulatorThread, EmulatorThread], http: Http
) -> None:
    p, d = pair
    original = {"prompt": PROMPT, "max_tokens": 2}
    kv = prefill_leg(http, p, "/v1/completions", original, "sk")["kv_transfer_params"]
    read = {
        "op": "read",
        "request_id": kv["remote_request_id"],
        "engine_id": kv["remote_engine_id"],
        "block_ids": kv["remote_block_ids"],
    }
    blocks = len(kv["remote_block_ids"][0])
    bad = [-1, "2", True, 1.5, None, blocks + 1]
    answers = _side_channel(p.side_channel_port, *({**read, "skip": k} for k in bad))
    for k, answer in zip(bad, answers, strict=True):
        assert answer["ok"] is False
        assert "skip" in answer["error"], (k, answer)
    # A good read of the rest still works, and nothing was lost: the decode leg completes and
    # its notification frees P's blocks.
    (rest,) = _side_channel(p.side_channel_port, {**read, "skip": blocks - 1})
    assert (rest["ok"], rest["num_blocks"]) == (True, 1)
    reply = http.post(
        d.url + "/v1/completions", {**original, "kv_transfer_params": kv}, {"X-Request-Id": "sk"}
    )
    assert reply.status == 200, reply.body
    assert reply.json()["usage"]["completion_tokens"] == 2
    assert free_blocks(p) == (p.instance.lending.pool.total, p.instance.lending.pool.total)


def test_one_instance_serves_both_legs(start_emulator: Any, http: Http) -> None:
    emu = start_emulator(side_channel_host="localhost")  # vLLM's default remote_host
    msgs = [{"role": "user", "content": PROMPT}]
    kv = prefill_leg(http, emu, "/v1/chat/completions", {"messages": msgs}, "self")[
        "kv_transfer_params"
    ]
    assert kv["remote_host"] == "localhost"
    reply = http.post(
        emu.url + "/v1/chat/completions",
        {"messages": msgs, "max_tokens": 3, "kv_transfer_params": kv},
        {"X-Request-Id": "self"},
    )
    assert reply.status == 200, reply.body
    assert reply.json()["usage"]["completion_tokens"] == 3
    assert free_blocks(emu)[0] == free_blocks(emu)[1]


def _decode_params(kv: dict[str, Any], **changes: Any) -> dict[str, Any]:
    return {**kv, **changes}


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


@pytest.mark.parametrize(
    "change",
    [
        {"remote_port": "closed"},
        {"remote_request_id": "cmpl-unknown-0-deadbeef"},
        {"remote_engine_id": "some-other-engine"},
        {"remote_block_ids": [[999999]]},
        {"remote_port": "not-a-port"},
    ],
)
def test_failed_pull_is_500(
    pair: tuple[EmulatorThread, EmulatorThread], http: Http, change: dict[str, Any]
) -> None:
    p, d = pair
    kv = prefill_leg(http, p, "/v1/completions", {"prompt": PROMPT}, "f1")["kv_transfer_params"]
    if change.get("remote_port") == "closed":
        change = {"remote_port": _closed_port()}
    reply = http.post(
        d.url + "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 4, "kv_transfer_params": {**kv, **change}},
    )
    assert reply.status == 500
    err = reply.json()["error"]
    assert err["type"] == "InternalServerError" and err["code"] == 500
    fams = http.metrics(d.url)
    assert sample(fams, "vllm:nixl_num_failed_transfers_total") == 1
    assert sample(fams, "vllm:request_success_total", finished_reason="error") == 1

    # A request that had already joined the batch leaves it at the next step boundary.
    def left() -> None:
        fams = http.metrics(d.url)
        assert sample(fams, "vllm:num_requests_running") == 0
        assert sample(fams, "vllm:kv_cache_usage_perc") == 0

    eventually(left)


def test_failed_pull_streaming_sends_error_chunk(
    pair: tuple[EmulatorThread, EmulatorThread], http: Http
) -> None:
    _, d = pair
    kv = {
        "do_remote_prefill": True,
        "remote_engine_id": "x",
        "remote_request_id": "cmpl-x-0-00000000",
        "remote_host": "127.0.0.1",
        "remote_port": _closed_port(),
        "remote_block_ids": [[0]],
    }
    s = http.sse(
        d.url + "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 4, "stream": True, "kv_transfer_params": kv},
    )
    assert s.status == 200  # the stream had started, as with vLLM
    assert [e for _, e in s.events][-1] == "[DONE]"
    err = json.loads(s.events[-2][1])["error"]
    assert err["code"] == 500


def test_incomplete_params_run_locally(
    pair: tuple[EmulatorThread, EmulatorThread], http: Http
) -> None:
    _, d = pair
    reply = http.post(
        d.url + "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 2, "kv_transfer_params": {"do_remote_prefill": True}},
    )
    assert reply.status == 200
    assert sample(http.metrics(d.url), "vllm:nixl_xfer_time_seconds_count") == 0


def test_lease_expiry_frees_and_counts(start_emulator: Any, http: Http) -> None:
    p = start_emulator(kv_lease_duration=0.3)
    sent = time.monotonic()
    kv = prefill_leg(http, p, "/v1/completions", {"prompt": PROMPT}, "e1")["kv_transfer_params"]
    free, total = free_blocks(p)
    assert free < total

    def freed() -> None:
        assert free_blocks(p) == (total, total)

    eventually(freed)
    assert time.monotonic() - sent >= 0.3  # not before the lease ran out
    fams = http.metrics(p.url)
    assert sample(fams, "vllm:nixl_num_kv_expired_reqs_total") == 1
    assert sample(fams, "vllm:kv_cache_usage_perc") == 0
    # A decode leg arriving after the expiry fails (the emulator tells it, unlike vLLM's silence).
    d = start_emulator()
    late = http.post(d.url + "/v1/completions", {"prompt": PROMPT, "kv_transfer_params": kv})
    assert late.status == 500
    assert "expired" in late.json()["error"]["message"]


def test_decode_queue_heartbeats_keep_the_lease(start_emulator: Any, http: Http) -> None:
    """D queues longer than P's lease; its heartbeats (every lease/6) keep the blocks."""
    lease = 0.6
    p = start_emulator(kv_lease_duration=lease)
    slow = make_profile(max_num_seqs=1, decode={"d0": 0.1})
    d = start_emulator(slow, kv_lease_duration=lease)
    kv = prefill_leg(http, p, "/v1/completions", {"prompt": PROMPT}, "hb")["kv_transfer_params"]
    statuses: list[int] = []
    blocker = threading.Thread(
        target=lambda: statuses.append(
            http.post(d.url + "/v1/completions", {"prompt": "x", "max_tokens": 10}).status
        )
    )
    blocker.start()  # occupies D's only slot for ~1 s, longer than the lease

    def blocked() -> None:
        assert sample(http.metrics(d.url), "vllm:num_requests_running") == 1

    eventually(blocked)
    reply = http.post(
        d.url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": kv}
    )
    blocker.join()
    assert reply.status == 200, reply.body
    assert statuses == [200]
    assert sample(http.metrics(p.url), "vllm:nixl_num_kv_expired_reqs_total") == 0
    assert free_blocks(p)[0] == free_blocks(p)[1]


def test_rejected_decode_leg_releases_prefill_blocks(start_emulator: Any, http: Http) -> None:
    p = start_emulator()
    d = start_emulator(make_profile(max_num_seqs=1, decode={"d0": 0.05}), max_num_queued_reqs=1)
    kv = prefill_leg(http, p, "/v1/completions", {"prompt": PROMPT}, "rj")["kv_transfer_params"]
    threads = [
        threading.Thread(
            # 40 tokens at 50 ms: the first request still runs while the second is checked, on
            # a loaded machine too (at 4 tokens, CI once saw it finish before that check).
            target=lambda: http.post(d.url + "/v1/completions", {"prompt": "x", "max_tokens": 40})
        )
        for _ in range(2)
    ]
    for i, t in enumerate(threads):
        t.start()

        # The first request runs, the second waits: each state reached before the next call.
        def state(i: int = i) -> None:
            fams = http.metrics(d.url)
            assert sample(fams, "vllm:num_requests_running") == 1
            assert sample(fams, "vllm:num_requests_waiting") == i

        eventually(state)
    reply = http.post(d.url + "/v1/completions", {"prompt": PROMPT, "kv_transfer_params": kv})
    assert reply.status == 503
    for t in threads:
        t.join()

    def freed() -> None:
        assert free_blocks(p)[0] == free_blocks(p)[1]

    eventually(freed, timeout=2.0)


@pytest.mark.parametrize("caching", [True, False])
def test_prefill_legs_reuse_a_cached_prefix(start_emulator: Any, http: Http, caching: bool) -> None:
    """vLLM's prefix caching on the prefill side: a second prompt that starts with the first
    one's full blocks computes only the rest, and the metrics count the hit as vLLM does."""
    p = start_emulator(enable_prefix_caching=caching)
    first = " ".join(f"word{i}" for i in range(70))
    second = first + " and a different ending"
    n_first = len(Tokenizer().encode(first)) + 1  # BOS
    n_second = len(Tokenizer().encode(second)) + 1
    block = p.instance.config.block_size
    a = prefill_leg(http, p, "/v1/completions", {"prompt": first, "max_tokens": 5}, "a")
    b = prefill_leg(http, p, "/v1/completions", {"prompt": second, "max_tokens": 5}, "b")
    fams = http.metrics(p.url)
    hit = (n_first // block) * block if caching else 0
    assert 0 < n_first // block <= (n_second - 1) // block
    # P tells D its own hit (vLLM's scheduler adds it to the params it returns).
    assert a["kv_transfer_params"]["remote_prefill_cached_tokens"] == 0
    assert b["kv_transfer_params"]["remote_prefill_cached_tokens"] == hit
    # vLLM counts no query for a request whose lookup is off (`record_prefix_cache_stats`).
    queries = n_first + n_second if caching else 0
    assert sample(fams, "vllm:prefix_cache_queries_total") == queries
    assert sample(fams, "vllm:prefix_cache_hits_total") == hit
    assert sample(fams, "vllm:prompt_tokens_by_source_total", source="local_cache_hit") == hit
    assert sample(fams, "vllm:prompt_tokens_cached_total") == hit
    info = fams["vllm:cache_config_info"].samples[0].labels
    assert info["enable_prefix_caching"] == str(caching)


@pytest.mark.parametrize("caching", [True, False])
def test_decode_leg_pulls_only_what_its_cache_lacks(
    start_emulator: Any, http: Http, caching: bool
) -> None:
    """vLLM's NIXL connector on D asks P for the prompt minus D's own prefix-cache hit: a second
    handoff whose prompt starts with the first one's full blocks reads only the rest, and D's
    metrics count the hit as its own (`local_cache_hit`), the rest as transferred."""
    p = start_emulator(enable_prefix_caching=caching)
    d = start_emulator(enable_prefix_caching=caching, server_dev_mode=True)
    first = " ".join(f"word{i}" for i in range(70))
    second = first + " and a different ending"
    n1 = len(Tokenizer().encode(first)) + 1  # BOS
    n2 = len(Tokenizer().encode(second)) + 1
    block = d.instance.config.block_size

    def handoff(rid: str, prompt: str) -> None:
        original = {"prompt": prompt, "max_tokens": 3}
        kv = prefill_leg(http, p, "/v1/completions", original, rid)["kv_transfer_params"]
        reply = http.post(
            d.url + "/v1/completions", {**original, "kv_transfer_params": kv}, {"X-Request-Id": rid}
        )
        assert reply.status == 200, reply.body

    handoff("x1", first)
    handoff("x2", second)
    hit = (n1 // block) * block if caching else 0  # the first prompt's full blocks, on D
    fams = http.metrics(d.url)
    assert sample(fams, "vllm:prefix_cache_hits_total") == hit
    assert sample(fams, "vllm:prefix_cache_queries_total") == (n1 + n2 if caching else 0)
    by_source = "vllm:prompt_tokens_by_source_total"
    assert sample(fams, by_source, source="local_cache_hit") == hit
    assert sample(fams, by_source, source="external_kv_transfer") == n1 - 1 + n2 - 1 - hit
    assert sample(fams, by_source, source="local_compute") == 2
    pulled_blocks = -(-n1 // block) + -(-n2 // block) - hit // block
    assert sample(fams, "vllm:nixl_bytes_transferred_sum") == pulled_blocks * block * 128 * 1024
    expected = H100.kv_transfer.time(n1) + H100.kv_transfer.time(n2 - hit)
    assert sample(fams, "vllm:nixl_xfer_time_seconds_sum") == pytest.approx(expected)
    # P freed both leases although D read only part of the second one.
    assert free_blocks(p)[0] == free_blocks(p)[1]
    # vLLM's dev endpoint empties D's cache too: the same prompt again finds nothing there.
    assert http.post(d.url + "/reset_prefix_cache", {}).json() == {"success": True}
    handoff("x3", second)
    assert sample(http.metrics(d.url), "vllm:prefix_cache_hits_total") == hit
