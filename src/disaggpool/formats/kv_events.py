"""vLLM's KV cache events on the wire: the `--kv-events-config` flag, and the event batches.

What vLLM 0.32/0.33 does (`vllm/distributed/kv_events.py`, `vllm/config/kv_events.py`), which the
emulator publishes exactly and the sidecar reads:

* **Config**, the JSON of `--kv-events-config`: `enable_kv_cache_events` (false), `publisher`
  (`"zmq"` when enabled, else `"null"`), `endpoint` (`tcp://*:5557`), `replay_endpoint` (none),
  `buffer_steps` (10,000 batches kept for replay), `hwm` (100,000), `max_queue_size` (100,000),
  `topic` (""). A PUB socket binds when its endpoint holds `*`, `::`, `ipc://` or `inproc://`,
  and connects otherwise.
* **Messages**: three frames, `[topic, seq, payload]`; `seq` counts the publisher's batches from
  0 as an 8-byte big-endian integer, so a subscriber sees a gap when it lost some.
* **Payload**: msgpack of an `EventBatch`, encoded as an array `[ts, events, data_parallel_rank]`
  (the publisher fills the rank, 0 on a single engine); each event is a map tagged by its
  `"type"`: `BlockStored` (`block_hashes`, `parent_block_hash`, `token_ids` of all its blocks in
  order, `block_size`, `lora_id`, `medium`, `lora_name`, optional fields left out when unset),
  `BlockRemoved` (`block_hashes`, `medium`), `AllBlocksCleared`. Block hashes are opaque
  (64-bit integers by default, digest bytes with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`): a
  reader links blocks by them and recomputes what it needs from the tokens.
* **Replay**: a ROUTER socket on `replay_endpoint`; a DEALER sends `["", start_seq]` and gets one
  `["", topic, seq, payload]` per buffered batch from `start_seq` on, then
  `["", "", END_SEQ, ""]`.

Pure: encoding and decoding only (the sockets live in `emulator.kv_publisher` and
`sidecar.kv_events`). A malformed payload raises `KVEventError` naming what is wrong.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Hashable, Sequence
from typing import Any

import msgpack

from disaggpool.errors import InputError

__all__ = [
    "END_SEQ",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "KVEventError",
    "KVEventsConfig",
    "decode_batch",
    "encode_batch",
    "is_bind_endpoint",
    "parse_kv_events_config",
    "seq_bytes",
    "split_tokens",
]

# vLLM's KV cache blocks hold 16 tokens by default and a few hundred at most (hybrid models align
# them to their state size); far more is no engine's, and would size every lookup by it.
MAX_BLOCK_SIZE = 1 << 16

END_SEQ = (-1).to_bytes(8, "big", signed=True)
FLAG = "--kv-events-config"


class KVEventError(ValueError):
    """A message that is not a KV event batch; the text names the offending part."""


@dataclasses.dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """vLLM's `KVEventsConfig` (module docstring), resolved."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def publishing(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


def parse_kv_events_config(text: str) -> KVEventsConfig:
    """The value of `--kv-events-config` (JSON); `InputError` naming the field otherwise."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(FLAG, "<json>", f"not JSON: {exc.msg}") from None
    if not isinstance(doc, dict):
        raise InputError(FLAG, "<json>", "must be a JSON object")
    fields = {f.name: f for f in dataclasses.fields(KVEventsConfig)}
    unknown = sorted(set(doc) - set(fields))
    if unknown:
        raise InputError(FLAG, unknown[0], f"unknown field; valid: {', '.join(fields)}")
    enabled = doc.get("enable_kv_cache_events", False)
    if not isinstance(enabled, bool):
        raise InputError(FLAG, "enable_kv_cache_events", "must be true or false")
    values: dict[str, Any] = {"enable_kv_cache_events": enabled}
    values["publisher"] = doc.get("publisher") or ("zmq" if enabled else "null")
    if values["publisher"] not in ("zmq", "null"):
        raise InputError(FLAG, "publisher", f"must be zmq or null, got {values['publisher']!r}")
    for key in ("endpoint", "topic"):
        if key in doc:
            if not isinstance(doc[key], str):
                raise InputError(FLAG, key, "must be a string")
            values[key] = doc[key]
    replay = doc.get("replay_endpoint")
    if replay is not None and not isinstance(replay, str):
        raise InputError(FLAG, "replay_endpoint", "must be a string or null")
    values["replay_endpoint"] = replay
    for key in ("buffer_steps", "hwm", "max_queue_size"):
        if key in doc:
            v = doc[key]
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise InputError(FLAG, key, f"must be a positive integer, got {v!r}")
            values[key] = v
    return KVEventsConfig(**values)


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM binds wildcard and ipc/inproc endpoints and connects to the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=seq < 0)


@dataclasses.dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[Hashable, ...]
    parent_block_hash: Hashable | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str | None = "GPU"


@dataclasses.dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[Hashable, ...]
    medium: str | None = "GPU"


@dataclasses.dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclasses.dataclass(frozen=True, slots=True)
class EventBatch:
    ts: float
    events: tuple[Event, ...]
    data_parallel_rank: int | None = 0


def _encode_event(ev: Event) -> dict[str, Any]:
    if isinstance(ev, BlockStored):
        return {
            "type": "BlockStored",
            "block_hashes": list(ev.block_hashes),
            "parent_block_hash": ev.parent_block_hash,
            "token_ids": list(ev.token_ids),
            "block_size": ev.block_size,
            "lora_id": None,
            "medium": ev.medium,
            "lora_name": None,
        }
    if isinstance(ev, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": list(ev.block_hashes), "medium": ev.medium}
    return {"type": "AllBlocksCleared"}


def encode_batch(batch: EventBatch) -> bytes:
    """The payload frame of one batch, as vLLM's publisher encodes it."""
    doc: list[Any] = [batch.ts, [_encode_event(e) for e in batch.events]]
    if batch.data_parallel_rank is not None:  # a default, omitted as msgspec omits defaults
        doc.append(batch.data_parallel_rank)
    out = msgpack.packb(doc, use_bin_type=True)
    assert isinstance(out, bytes)
    return out


def _hashes(value: Any, where: str) -> tuple[Hashable, ...]:
    if not isinstance(value, list) or not all(isinstance(h, int | bytes) for h in value):
        raise KVEventError(f"{where}.block_hashes: must be a list of integers or bytes")
    return tuple(value)


def _decode_event(raw: Any, i: int) -> Event | None:
    where = f"events[{i}]"
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        # vLLM releases before PR #42892 (mid-2026) send each event as an array tagged by its
        # type, fields in order: read as the map it stands for.
        names = {
            "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size"),
            "BlockRemoved": ("block_hashes",),
            "AllBlocksCleared": (),
        }.get(raw[0], ())
        raw = {"type": raw[0], **dict(zip(names, raw[1:], strict=False))}
    if not isinstance(raw, dict) or not isinstance(raw.get("type"), str):
        raise KVEventError(f"{where}: must be a map tagged by 'type'")
    kind = raw["type"]
    medium = raw.get("medium", "GPU")
    if kind == "BlockStored":
        hashes = _hashes(raw.get("block_hashes"), where)
        parent = raw.get("parent_block_hash")
        if parent is not None and not isinstance(parent, int | bytes):
            raise KVEventError(f"{where}.parent_block_hash: must be an integer, bytes or null")
        tokens = raw.get("token_ids")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise KVEventError(f"{where}.token_ids: must be a list of integers")
        size = raw.get("block_size")
        if not isinstance(size, int) or not 1 <= size <= MAX_BLOCK_SIZE:
            # A block size the engine cannot have would size every later prefix lookup by it.
            raise KVEventError(f"{where}.block_size: must be an integer in 1..{MAX_BLOCK_SIZE}")
        if len(tokens) != size * len(hashes):
            raise KVEventError(
                f"{where}.token_ids: {len(tokens)} tokens for {len(hashes)} blocks of {size}"
            )
        return BlockStored(hashes, parent, tuple(tokens), size, medium)
    if kind == "BlockRemoved":
        return BlockRemoved(_hashes(raw.get("block_hashes"), where), medium)
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    return None  # an event type of a later vLLM: not ours to judge


def decode_batch(payload: bytes) -> EventBatch:
    """One payload frame; `KVEventError` when it is not a batch of KV events."""
    try:
        doc = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise KVEventError(f"payload: not msgpack ({type(exc).__name__})") from None
    if not isinstance(doc, list) or len(doc) < 2:
        raise KVEventError("payload: must be an array [ts, events, data_parallel_rank]")
    ts, raw_events = doc[0], doc[1]
    if not isinstance(ts, int | float) or isinstance(ts, bool):
        raise KVEventError("ts: must be a number")
    if not isinstance(raw_events, list):
        raise KVEventError("events: must be a list")
    rank = doc[2] if len(doc) > 2 else None
    events = [_decode_event(raw, i) for i, raw in enumerate(raw_events)]
    return EventBatch(float(ts), tuple(e for e in events if e is not None), rank)


def split_tokens(event: BlockStored) -> Sequence[tuple[int, ...]]:
    """The token ids of each block of a `BlockStored`, in order."""
    size = event.block_size
    toks = event.token_ids
    return [toks[i * size : (i + 1) * size] for i in range(len(event.block_hashes))]
