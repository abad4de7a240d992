"""Listening to the prefill pods' vLLM KV events: one ZMQ SUB socket per pod that publishes them.

Each prefill member with a `kv_events` endpoint (static and file members name it; with
Kubernetes membership it is ``tcp://<pod IP>:<kv_events.port>``) gets a subscriber task that
connects, subscribes to `kv_events.topic`, and applies every batch to the pod's
`core.prefix_index.EventIndex` through `PoolState.events_heard`. The wire format is
`formats.kv_events`. What can go wrong, and what is done:

* a message that is not three frames or whose payload does not decode: counted in
  `disaggpool_kv_events_malformed_total{pod}` and dropped; the index is untouched;
* a gap in the sequence numbers (the publisher's high-water mark dropped batches, or we
  reconnected): the pod's index cannot know what it missed, so it is emptied, as llm-d does, and
  counted in `disaggpool_kv_events_gaps_total{pod}`; it fills again from the next batches (vLLM
  0.32/0.33 publish no snapshot; replaying from the publisher's buffer is left out);
* a pod that publishes nothing: the routing service notices (`PoolState.cached_index`) and reads
  the approximate index instead, with a warning, until batches arrive again.

Members are reconciled every `RECONCILE_S`: a pod that joins is subscribed, one that leaves or
changes endpoint is unsubscribed. The reconciler and each subscriber run under the sidecar's
`Supervisor`: a subscriber that fails (a bad endpoint, a socket error, a bug on a message) is
counted and started again after a backoff, with a fresh sequence (so its index starts over).
"""

from __future__ import annotations

import functools
import logging

import zmq
import zmq.asyncio

from disaggpool.formats.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventError,
    decode_batch,
    split_tokens,
)
from disaggpool.sidecar.config import KVEventsSource
from disaggpool.sidecar.service import RoutingService
from disaggpool.sidecar.supervise import Supervisor

__all__ = ["KVEventSubscribers"]

log = logging.getLogger("disaggpool.sidecar")

RECONCILE_S = 0.5


class KVEventSubscribers:
    """The subscriber tasks of one sidecar (module docstring)."""

    def __init__(
        self, service: RoutingService, source: KVEventsSource, supervisor: Supervisor
    ) -> None:
        self.service = service
        self.source = source
        self.supervisor = supervisor
        self._ctx = zmq.asyncio.Context()
        self._endpoints: dict[str, str] = {}  # pod -> the endpoint its subscriber listens to

    def start(self) -> None:
        self.supervisor.periodic("kv_events_reconcile", self.reconcile, RECONCILE_S)

    async def stop(self) -> None:
        for name in self.supervisor.names("kv_events"):
            await self.supervisor.cancel(name)
        self._endpoints.clear()
        self._ctx.term()

    async def reconcile(self) -> None:
        wanted = {
            i.name: i.member.kv_events
            for i in self.service.state.members("prefill")
            if i.member.kv_events
        }
        for pod, endpoint in list(self._endpoints.items()):
            if wanted.get(pod) != endpoint:
                del self._endpoints[pod]
                await self.supervisor.cancel(f"kv_events/{pod}")
        for pod, endpoint in wanted.items():
            if pod not in self._endpoints:
                self._endpoints[pod] = endpoint
                listen = functools.partial(self._listen, pod, endpoint)
                self.supervisor.task(f"kv_events/{pod}", listen)

    async def _listen(self, pod: str, endpoint: str) -> None:
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, self.source.topic.encode())
        sock.connect(endpoint)
        log.info("pod %s: listening to its KV events at %s", pod, endpoint)
        last_seq: int | None = None
        try:
            while True:
                frames = await sock.recv_multipart()
                last_seq = self._apply(pod, frames, last_seq)
        finally:
            sock.close(linger=0)

    def _apply(self, pod: str, frames: list[bytes], last_seq: int | None) -> int | None:
        """Apply one message; returns the sequence number to expect after it."""
        metrics = self.service.metrics
        try:
            if len(frames) != 3 or len(frames[1]) != 8:
                raise KVEventError("message: must be [topic, 8-byte seq, payload]")
            seq = int.from_bytes(frames[1], "big")
            batch = decode_batch(frames[2])
        except KVEventError as exc:
            metrics.kv_events_malformed.labels(pod).inc()
            log.debug("pod %s: dropped a malformed KV event message: %s", pod, exc)
            return last_seq
        index = self.service.state.events_heard(pod, self.service.clock())
        if index is None:  # left the pool meanwhile
            return seq
        if last_seq is not None and seq != last_seq + 1:
            metrics.kv_events_gaps.labels(pod).inc()
            log.warning(
                "pod %s: KV events %d..%d lost: its prefix index starts over", pod, last_seq + 1,
                seq - 1,
            )  # fmt: skip
            index.cleared()
        metrics.kv_events_batches.labels(pod).inc()
        for event in batch.events:
            if isinstance(event, BlockStored):
                if event.medium in (None, "GPU"):  # offloaded tiers are not this engine's cache
                    index.stored(
                        event.block_hashes,
                        event.parent_block_hash,
                        split_tokens(event),
                        event.block_size,
                    )
            elif isinstance(event, BlockRemoved):
                if event.medium in (None, "GPU"):
                    index.removed(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                index.cleared()
        return seq
