"""KV events that are garbage, absurd, or never come: the subscriber drops or applies each message
(counted once either way) and keeps listening, requests are answered whatever the index was fed,
and a publisher that falls silent only sends its pod back to the approximate index.

The publisher is a ZMQ PUB socket the test binds and the sidecar connects to, as it would to a
prefill pod's vLLM (`formats.kv_events` is the wire format; `sidecar.kv_events` the subscriber).
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import zmq
from emulator_testkit import eventually
from faultkit import Accounting, Kit, metric, pod, post_json, sidecar_doc

from disaggpool.formats.kv_events import BlockStored, EventBatch, encode_batch

TOPIC = b"kv@p0"


class Publisher:
    """A prefill pod's KV event publisher that the test scripts, message by message."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
        self.sock = ctx.socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:0")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.seq = 0
        self.block = 0

    def frames(self, payload: bytes) -> list[bytes]:
        out = [TOPIC, self.seq.to_bytes(8, "big"), payload]
        self.seq += 1
        return out

    def valid(self) -> None:
        """One good batch: a new root block of 16 tokens."""
        self.block += 1
        stored = BlockStored(
            (10_000 + self.block,), None, tuple(range(self.block, self.block + 16)), 16
        )
        self.sock.send_multipart(self.frames(encode_batch(EventBatch(time.time(), (stored,)))))

    def raw(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)


@pytest.fixture
def publisher() -> Iterator[Publisher]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pub = Publisher(ctx)
    yield pub
    pub.sock.close(linger=0)
    ctx.term()


def pack(doc: Any) -> bytes:
    out = msgpack.packb(doc, use_bin_type=True)
    assert isinstance(out, bytes)
    return out


def stored(**fields: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None}
    doc.update(token_ids=list(range(16)), block_size=16, lora_id=None, medium="GPU")
    doc.update(fields)
    return doc


SEQ = (7).to_bytes(8, "big")
# Messages the subscriber must drop as malformed (not three frames, or a payload that is not a
# batch of KV events), each counted once in disaggpool_kv_events_malformed_total.
GARBAGE: list[list[bytes]] = [
    [TOPIC],
    [TOPIC, SEQ],
    [TOPIC, SEQ, b"", b"extra"],
    [TOPIC, b"short", pack([1.0, []])],
    [TOPIC, SEQ, b""],
    [TOPIC, SEQ, b"\xc1"],  # never valid msgpack
    [TOPIC, SEQ, b"\x93\x01"],  # truncated
    [TOPIC, SEQ, bytes(range(256)) * 4096],  # 1 MiB of noise
    [TOPIC, SEQ, pack(42)],
    [TOPIC, SEQ, pack({"ts": 1.0, "events": []})],
    [TOPIC, SEQ, pack([1.0])],
    [TOPIC, SEQ, pack(["yesterday", []])],
    [TOPIC, SEQ, pack([1.0, "events"])],
    [TOPIC, SEQ, pack([1.0, [42]])],
    [TOPIC, SEQ, pack([1.0, [{"type": 7}]])],
    [TOPIC, SEQ, pack([1.0, [stored(block_hashes="not a list")]])],
    [TOPIC, SEQ, pack([1.0, [stored(block_hashes=[1.5])]])],
    [TOPIC, SEQ, pack([1.0, [stored(parent_block_hash=[1])]])],
    [TOPIC, SEQ, pack([1.0, [stored(token_ids=[1, 2])]])],
    [TOPIC, SEQ, pack([1.0, [stored(token_ids="abc")]])],
    [TOPIC, SEQ, pack([1.0, [stored(block_size=0)]])],
    [TOPIC, SEQ, pack([1.0, [stored(block_size=-16)]])],
    [TOPIC, SEQ, pack([1.0, [{"type": "BlockRemoved", "block_hashes": {"a": 1}}]])],
]
# Messages that decode but say absurd things: each is applied or dropped (the subscriber's
# choice), and none may stop the subscriber or break routing.
ABSURD: list[bytes] = [
    # A block size no engine has: on 49d2704 every later request was a 500 (a MemoryError
    # cutting each prompt into 2**62-token blocks on the routing path).
    pack([1.0, [stored(block_hashes=[], token_ids=[], block_size=2**62)]]),
    pack([1.0, [stored(block_hashes=[], token_ids=[], block_size=3)]]),  # not the pods' 16
    pack([1.0, [stored(token_ids=[2**64 - 1] * 16)]]),
    pack([1.0, [stored(medium={"tier": "GPU"})]]),
    pack([1.0, [{"type": "BlockRemoved", "block_hashes": [2**64 - 1, b"\x00" * 64]}]]),
    pack([1.0, [{"type": "SomethingNew", "payload": [1, 2, 3]}], 0, "extra"]),
    pack([float("nan"), [{"type": "AllBlocksCleared"}]]),
    pack([1e308, [stored(block_hashes=[5, 5], token_ids=list(range(32)))]]),
]


def livez(url: str) -> int:
    try:
        with urllib.request.urlopen(f"{url}/livez", timeout=5) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return exc.code


PROMPT = " ".join(f"w{i}" for i in range(60))  # several full 16-token blocks


def kv_sidecar(kit: Kit, publisher: Publisher) -> Any:
    p0, d0 = kit.emulator(), kit.emulator()
    return kit.sidecar(
        sidecar_doc(
            [pod("p0", p0.url, kv_events=publisher.endpoint)],
            [pod("d0", d0.url)],
            prefix_index=True,
            kv_events={"stale_after_s": 0.5},
        )
    )


def joined(sc: Any, publisher: Publisher) -> None:
    """Send good batches until the subscriber hears one (ZMQ drops what precedes the join)."""

    def heard() -> None:
        publisher.valid()
        assert metric(sc.url, "disaggpool_kv_events_batches_total", pod="p0") >= 1

    eventually(heard, timeout=10.0, interval=0.1)


def test_kv_event_garbage_is_dropped_counted_and_routing_goes_on(
    kit: Kit, publisher: Publisher
) -> None:
    sc = kv_sidecar(kit, publisher)
    joined(sc, publisher)
    books = Accounting(sc.url)

    def counts() -> tuple[float, float, float]:
        return (
            metric(sc.url, "disaggpool_kv_events_batches_total", pod="p0"),
            metric(sc.url, "disaggpool_kv_events_malformed_total", pod="p0"),
            metric(sc.url, "disaggpool_kv_events_gaps_total", pod="p0"),
        )

    batches, malformed, gaps = counts()
    for frames in GARBAGE:
        publisher.raw(frames)
    publisher.valid()  # garbage takes no sequence number: no gap before this one

    def garbage_dropped() -> None:
        assert counts() == (batches + 1, malformed + len(GARBAGE), gaps)

    eventually(garbage_dropped, timeout=5.0)
    for i in range(2):
        status, _, raw = post_json(
            f"{sc.url}/v1/completions", {"prompt": f"{PROMPT} g{i}", "max_tokens": 2}
        )
        assert status == 200, raw

    # Each absurd message alone, then a request routed on whatever the index now believes.
    for n, payload in enumerate(ABSURD):
        before = counts()
        publisher.raw(publisher.frames(payload))

        def counted_once(before: tuple[float, float, float] = before) -> None:
            # A message dropped after taking a sequence number leaves the next one a gap: the
            # index cannot know what the lost batch removed, so it starts over (at most one).
            b, m, g = counts()
            assert (b - before[0]) + (m - before[1]) == 1 and g - before[2] <= 1

        eventually(counted_once, timeout=5.0)
        body = {"prompt": f"{PROMPT} a{n}", "max_tokens": 2}
        status, _, raw = post_json(f"{sc.url}/v1/completions", body)
        assert status == 200, (n, raw)
    before = counts()
    publisher.valid()  # still listening

    def still_listening() -> None:
        assert counts()[0] == before[0] + 1

    eventually(still_listening, timeout=5.0)
    assert livez(sc.url) == 200
    books.settle(sent=2 + len(ABSURD), admitted=2 + len(ABSURD))


def test_a_publisher_that_falls_silent_sends_its_pod_back_to_the_approximate_index(
    kit: Kit, publisher: Publisher
) -> None:
    sc = kv_sidecar(kit, publisher)
    joined(sc, publisher)
    books = Accounting(sc.url)
    assert metric(sc.url, "disaggpool_prefix_index_source", pod="p0", source="events") == 1
    # From now on it announces nothing, though it is sent prompts it did not hold.
    for i in range(3):
        status, _, raw = post_json(
            f"{sc.url}/v1/completions", {"prompt": f"{PROMPT} s{i}", "max_tokens": 2}
        )
        assert status == 200, raw

    def fell_back() -> None:
        assert metric(sc.url, "disaggpool_prefix_index_source", pod="p0", source="routed") == 1

    eventually(fell_back, timeout=5.0)
    for i in range(2):  # and the router goes on routing to it
        status, _, raw = post_json(
            f"{sc.url}/v1/completions", {"prompt": f"{PROMPT} t{i}", "max_tokens": 2}
        )
        assert status == 200, raw
    assert metric(sc.url, "disaggpool_pod_healthy", pod="p0") == 1
    publisher.valid()  # it speaks again: its events are read again

    def heard_again() -> None:
        assert metric(sc.url, "disaggpool_prefix_index_source", pod="p0", source="events") == 1

    eventually(heard_again, timeout=5.0)
    books.settle(sent=5, admitted=5)
