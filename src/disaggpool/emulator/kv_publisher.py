"""The emulator's KV events: vLLM's ZMQ publisher, for the prefill engine's prefix cache.

Started when `--kv-events-config` enables them (`formats.kv_events` says what vLLM does and
how it looks on the wire). After every prefill step that stored or evicted cache blocks the
instance publishes one batch: `BlockRemoved` for the blocks evicted to make room (vLLM announces
a removal when it hands the block out again, which is that moment), then `BlockStored` for each
run of consecutive blocks a request stored anew, with its parent's hash and its tokens. Block
hashes are the engine's block ids as unsigned 64-bit integers, the form of vLLM's default
`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`. Cache hits announce nothing, as in vLLM.

Sockets: PUB on `endpoint` (bound when it holds `*`, else connected, as vLLM does;
``tcp://*:PORT`` binds the emulator's own `--host`, port 0 a free one, where vLLM listens on
every interface), and, with `replay_endpoint`, a ROUTER that answers replay requests from the
last `buffer_steps` batches. A batch the PUB's high-water mark refuses is dropped (subscribers see
the gap in `seq`), never queued without bound.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Sequence

import zmq
import zmq.asyncio

from disaggpool.emulator.config import cannot_listen
from disaggpool.formats.kv_events import (
    END_SEQ,
    BlockStored,
    Event,
    EventBatch,
    KVEventsConfig,
    encode_batch,
    is_bind_endpoint,
    seq_bytes,
)

__all__ = ["KVEventPublisher", "external_hash", "stored_runs"]

log = logging.getLogger(__name__)

_U64 = (1 << 64) - 1


def external_hash(block: int) -> int:
    """A block id as vLLM's default integer hash: unsigned, 64 bits."""
    return block & _U64


def stored_runs(
    blocks: Sequence[int], positions: Sequence[int], token_ids: Sequence[int], block_size: int
) -> list[BlockStored]:
    """`BlockStored` events for a request's blocks stored anew (`positions` in `blocks`, in
    order): one per run of consecutive positions, chained to the block before the run."""
    events: list[BlockStored] = []
    run: list[int] = []
    for pos in [*positions, -2]:  # a sentinel closes the last run
        if run and pos == run[-1] + 1:
            run.append(pos)
            continue
        if run:
            first = run[0]
            events.append(
                BlockStored(
                    tuple(external_hash(blocks[i]) for i in run),
                    external_hash(blocks[first - 1]) if first > 0 else None,
                    tuple(token_ids[first * block_size : (run[-1] + 1) * block_size]),
                    block_size,
                )
            )
        run = [pos]
    return events


class KVEventPublisher:
    """One instance's publisher (module docstring)."""

    def __init__(self, config: KVEventsConfig, host: str) -> None:
        self.config = config
        self.host = host
        self.endpoint = config.endpoint  # the bound endpoint once started
        self.replay_endpoint = config.replay_endpoint
        self._ctx = zmq.asyncio.Context()
        self._pub: zmq.asyncio.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(
            maxlen=config.buffer_steps
        )
        self._seq = 0
        self.dropped = 0
        # While silenced, batches are neither sent nor numbered: a publisher that died, for tests
        # of what its subscribers do then.
        self.silenced = False

    def _bind(self, sock: zmq.asyncio.Socket, endpoint: str) -> str:
        wildcard = endpoint.startswith("tcp://*:")  # the emulator listens on its --host only
        local = f"tcp://{self.host}:{endpoint.removeprefix('tcp://*:')}" if wildcard else endpoint
        try:
            sock.bind(local)
        except zmq.ZMQError as exc:
            sock.close(linger=0)  # else the context's term() in close() waits for it forever
            change = (
                "give each emulator its own endpoint and replay_endpoint in --kv-events-config "
                "(port 0 picks a free one)"
            )
            raise cannot_listen(exc.errno, "KV events endpoint", local, change) from exc
        if not wildcard:
            return endpoint
        bound = sock.getsockopt(zmq.LAST_ENDPOINT)
        return bound.decode() if isinstance(bound, bytes) else str(bound)

    def start(self) -> None:
        pub = self._ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, self.config.hwm)
        pub.setsockopt(zmq.LINGER, 0)
        if is_bind_endpoint(self.config.endpoint):
            self.endpoint = self._bind(pub, self.config.endpoint)
        else:
            pub.connect(self.config.endpoint)
        self._pub = pub
        if self.config.replay_endpoint is not None:
            router = self._ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            self.replay_endpoint = self._bind(router, self.config.replay_endpoint)
            self._replay = router
            self._replay_task = asyncio.get_running_loop().create_task(self._serve_replay())
        log.info("KV events on %s (replay: %s)", self.endpoint, self.replay_endpoint)

    def publish(self, events: Sequence[Event]) -> None:
        """Send one batch now (never blocks: a full queue drops it, as a PUB does)."""
        if self._pub is None or not events or self.silenced:
            return
        seq = self._seq
        self._seq += 1
        payload = encode_batch(EventBatch(time.time(), tuple(events), 0))
        self._buffer.append((seq, payload))
        try:
            self._pub.send_multipart(
                [self.config.topic.encode(), seq_bytes(seq), payload], flags=zmq.NOBLOCK
            )
        except zmq.Again:
            self.dropped += 1

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("invalid KV event replay request (%d frames)", len(frames))
                continue
            client, start = frames[0], int.from_bytes(frames[2], "big")
            topic = self.config.topic.encode()
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await self._replay.send_multipart([client, b"", topic, seq_bytes(seq), payload])
            await self._replay.send_multipart([client, b"", b"", END_SEQ, b""])

    async def close(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            await asyncio.gather(self._replay_task, return_exceptions=True)
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()
