"""The emulator's KV events, read off its ZMQ sockets the way a subscriber of vLLM reads them."""

from __future__ import annotations

import time
from typing import Any

import msgpack
import pytest
import zmq
from emulator_testkit import Http, eventually, make_profile

from disaggpool.core.prefix_index import prompt_blocks
from disaggpool.emulator.harness import EmulatorThread
from disaggpool.emulator.kv_publisher import external_hash
from disaggpool.formats.kv_events import END_SEQ, parse_kv_events_config
from disaggpool.wordtokenizer import Tokenizer

EVENTS = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:0", "topic": "kv@p0"}'


def prefill_leg(http: Http, emu: EmulatorThread, prompt: str, rid: str) -> None:
    body = {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    reply = http.post(emu.url + "/v1/completions", body, {"X-Request-Id": rid})
    assert reply.status == 200, reply.body


@pytest.fixture
def sub() -> Any:
    ctx = zmq.Context()
    socks: list[zmq.Socket[bytes]] = []

    def connect(endpoint: str) -> zmq.Socket[bytes]:
        s = ctx.socket(zmq.SUB)
        s.setsockopt(zmq.SUBSCRIBE, b"kv@")
        s.connect(endpoint)
        socks.append(s)
        time.sleep(0.3)  # a SUB that joins late misses what was sent before (ZMQ's slow joiner)
        return s

    yield connect
    for s in socks:
        s.close(linger=0)
    ctx.term()


def drain(s: zmq.Socket[bytes]) -> list[tuple[bytes, int, Any]]:
    out = []
    while s.poll(300):
        topic, seq, payload = s.recv_multipart()
        out.append((topic, int.from_bytes(seq, "big"), msgpack.unpackb(payload)))
    return out


def test_stored_blocks_carry_their_tokens_and_parent(start_emulator, http, sub) -> None:
    p = start_emulator(kv_events=parse_kv_events_config(EVENTS))
    s = sub(p.instance.kv_events.endpoint)
    first = " ".join(f"w{i}" for i in range(40))  # 41 tokens with BOS: two full blocks
    second = first + " " + " ".join(f"x{i}" for i in range(30))  # 71: two more full blocks
    prefill_leg(http, p, first, "a")
    prefill_leg(http, p, first, "a2")  # all cached: a hit announces nothing
    prefill_leg(http, p, second, "b")
    msgs = drain(s)
    assert [(topic, seq) for topic, seq, _ in msgs] == [(b"kv@p0", 0), (b"kv@p0", 1)]
    ids = [1, *Tokenizer().encode(second)]  # BOS, then the words
    blocks = [external_hash(b) for b in prompt_blocks(ids, 16)]
    (_, _, a), (_, _, b) = msgs
    assert isinstance(a[0], float) and a[2] == 0  # [ts, events, data_parallel_rank]
    assert a[1] == [
        {
            "type": "BlockStored",
            "block_hashes": blocks[:2],
            "parent_block_hash": None,
            "token_ids": ids[:32],
            "block_size": 16,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
        }
    ]
    assert b[1][0]["block_hashes"] == blocks[2:4]
    assert b[1][0]["parent_block_hash"] == blocks[1]
    assert b[1][0]["token_ids"] == ids[32:64]


def test_evictions_are_announced_and_replay_serves_the_buffer(start_emulator, http, sub) -> None:
    config = parse_kv_events_config(
        '{"enable_kv_cache_events": true, "endpoint": "tcp://*:0", "topic": "kv@p0",'
        ' "replay_endpoint": "tcp://*:0", "buffer_steps": 2}'
    )
    profile = make_profile(kv_capacity_tokens=160, max_model_len=128)  # ten 16-token blocks
    p = start_emulator(profile, kv_events=config, kv_lease_duration=0.05)
    s = sub(p.instance.kv_events.endpoint)
    for i in range(3):  # 3 x 4 full blocks: the third needs room the first two left cached
        prefill_leg(http, p, " ".join(f"r{i}w{j}" for j in range(70)), f"r{i}")
        time.sleep(0.15)  # the lease expires: its blocks stay only as cache
    msgs = drain(s)
    kinds = [[e["type"] for e in batch[1]] for _, _, batch in msgs]
    assert kinds[0] == kinds[1] == ["BlockStored"]
    assert kinds[2] == ["BlockRemoved", "BlockStored"]  # room is made before the new blocks
    removed = msgs[2][2][1][0]["block_hashes"]
    assert set(removed) <= set(msgs[0][2][1][0]["block_hashes"])  # the oldest released go first

    dealer = zmq.Context.instance().socket(zmq.DEALER)
    try:
        dealer.connect(p.instance.kv_events.replay_endpoint)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        replies = []
        while True:
            assert dealer.poll(5000)
            frames = dealer.recv_multipart()
            replies.append(frames)  # ["", topic, seq, payload]
            if frames[2] == END_SEQ:
                break
    finally:
        dealer.close(linger=0)
    # two batches kept (buffer_steps), then the end marker
    assert [int.from_bytes(f[2], "big", signed=True) for f in replies] == [1, 2, -1]
    assert replies[0][1] == b"kv@p0" and replies[-1][1] == b""


def test_reset_prefix_cache_clears_and_announces_it(start_emulator, http, sub) -> None:
    """vLLM's development endpoint (VLLM_SERVER_DEV_MODE=1): refused while a prefill leg's KV
    waits for its decode side, else the cache is emptied and `AllBlocksCleared` published, and
    the same prompt's blocks are stored (announced) anew. Without dev mode the path is 404."""
    plain = start_emulator()
    assert http.post(plain.url + "/reset_prefix_cache", {}).status == 404
    p = start_emulator(
        kv_events=parse_kv_events_config(EVENTS), server_dev_mode=True, kv_lease_duration=0.5
    )
    s = sub(p.instance.kv_events.endpoint)
    prompt = " ".join(f"w{i}" for i in range(40))  # two full blocks
    prefill_leg(http, p, prompt, "held")  # its KV stays until pulled, or its lease expires
    reply = http.post(p.url + "/reset_prefix_cache", {})
    assert reply.status == 200 and reply.json() == {"success": False}

    def reset() -> None:
        assert http.post(p.url + "/reset_prefix_cache", {}).json() == {"success": True}

    eventually(reset)
    prefill_leg(http, p, prompt, "again")
    kinds = [[e["type"] for e in batch[1]] for _, _, batch in drain(s)]
    assert kinds == [["BlockStored"], ["AllBlocksCleared"], ["BlockStored"]]
