"""vLLM's KV event wire format: the config flag, batches both ways, and what is refused."""

from __future__ import annotations

import msgpack
import pytest

from disaggpool.errors import InputError
from disaggpool.formats.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventError,
    decode_batch,
    encode_batch,
    is_bind_endpoint,
    parse_kv_events_config,
    split_tokens,
)


def test_config_defaults_follow_vllm() -> None:
    on = parse_kv_events_config('{"enable_kv_cache_events": true}')
    assert (on.publisher, on.endpoint, on.replay_endpoint, on.topic) == (
        "zmq",
        "tcp://*:5557",
        None,
        "",
    )
    assert (on.buffer_steps, on.hwm, on.max_queue_size) == (10_000, 100_000, 100_000)
    assert on.publishing
    assert not parse_kv_events_config("{}").publishing  # off unless enabled
    assert (
        parse_kv_events_config('{"enable_kv_cache_events": true, "publisher": "null"}').publisher
        == "null"
    )


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("not json", "<json>"),
        ("[1]", "<json>"),
        ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events"),
        ('{"publisher": "kafka"}', "publisher"),
        ('{"buffer_steps": 0}', "buffer_steps"),
        ('{"endpoint": 5557}', "endpoint"),
        ('{"colour": "red"}', "colour"),
    ],
)
def test_bad_config_names_the_field(text: str, field: str) -> None:
    with pytest.raises(InputError) as err:
        parse_kv_events_config(text)
    assert err.value.source == "--kv-events-config" and err.value.field == field


def test_bind_or_connect_as_vllm_decides() -> None:
    assert is_bind_endpoint("tcp://*:5557") and is_bind_endpoint("ipc:///tmp/kv")
    assert not is_bind_endpoint("tcp://127.0.0.1:5557")


def test_a_batch_on_the_wire_is_vllms_layout() -> None:
    batch = EventBatch(
        12.5,
        (
            BlockStored((7, 8), None, tuple(range(8)), 4),
            BlockRemoved((3,)),
            AllBlocksCleared(),
        ),
        0,
    )
    raw = msgpack.unpackb(encode_batch(batch))
    # an array [ts, events, data_parallel_rank]; events are maps tagged by "type"
    assert raw[0] == 12.5 and raw[2] == 0
    assert raw[1][0] == {
        "type": "BlockStored",
        "block_hashes": [7, 8],
        "parent_block_hash": None,
        "token_ids": list(range(8)),
        "block_size": 4,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    assert raw[1][1] == {"type": "BlockRemoved", "block_hashes": [3], "medium": "GPU"}
    assert raw[1][2] == {"type": "AllBlocksCleared"}
    assert decode_batch(encode_batch(batch)) == batch
    assert split_tokens(batch.events[0]) == [(0, 1, 2, 3), (4, 5, 6, 7)]  # type: ignore[arg-type]


def test_older_tagged_arrays_and_unknown_events_are_read() -> None:
    payload = msgpack.packb(
        [1.0, [["BlockStored", [5], 9, [1, 2], 2, None, "GPU"], {"type": "Future", "x": 1}]]
    )
    batch = decode_batch(payload)
    assert batch.events == (BlockStored((5,), 9, (1, 2), 2, "GPU"),)
    assert batch.data_parallel_rank is None


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"\xc1\xc1garbage", "not msgpack"),
        (msgpack.packb({"ts": 1}), "array"),
        (msgpack.packb(["x", []]), "ts"),
        (msgpack.packb([1.0, {}]), "events"),
        (msgpack.packb([1.0, [{"no": "type"}]]), r"events\[0\]"),
        (msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": "x"}]]), "block_hashes"),
        (
            msgpack.packb(
                [
                    1.0,
                    [
                        {
                            "type": "BlockStored",
                            "block_hashes": [1],
                            "parent_block_hash": None,
                            "token_ids": [1, 2, 3],
                            "block_size": 2,
                        }
                    ],
                ]
            ),
            "3 tokens for 1 blocks of 2",
        ),
    ],
)
def test_malformed_payloads_are_refused_with_the_reason(payload: bytes, message: str) -> None:
    with pytest.raises(KVEventError, match=message):
        decode_batch(payload)
