"""The prefill side's KV blocks: a real free-block pool and the leases on lent blocks.

A prefill leg's prompt takes ``ceil(prompt / block_size)`` blocks out of ``num_gpu_blocks``; the
block ids it got are what `remote_block_ids` advertises. When the prefill finishes, the blocks are
*lent*: held under the request's `remote_request_id` until the decode side reads them and
notifies (`release`) or the lease runs out (`expire`), as vLLM 0.33's NIXL pull connector does
(`kv_lease_duration`, extended by the decode side's heartbeats).

Pure bookkeeping with time passed in; `instance` arms the timer and `kv_side_channel` serves the
reads. Every path that ends a lease returns the blocks to the pool, so nothing can leak.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections import OrderedDict

__all__ = ["BlockPool", "Lease", "LeaseTable"]


class BlockPool:
    """`total` KV blocks, handed out lowest id first (vLLM's free queue is FIFO; ids are opaque)."""

    def __init__(self, total: int) -> None:
        self.total = total
        self._free: list[int] = list(range(total))  # a heap
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def allocate(self, n: int) -> list[int] | None:
        """`n` blocks, or None (and nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        blocks = [heapq.heappop(self._free) for _ in range(n)]
        self._used.update(blocks)
        return blocks

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if b in self._used:  # idempotent: a block can only be freed once
                self._used.remove(b)
                heapq.heappush(self._free, b)


@dataclasses.dataclass(slots=True, eq=False)
class Lease:
    """Blocks lent to a decode instance under a prefill request's internal id."""

    request_id: str
    blocks: list[int]
    prompt_tokens: int
    expires: float
    token: object = None  # the owner's handle (the engine request), returned on release


class LeaseTable:
    """Leases by request id, with their expiry times; O(log n) per operation."""

    def __init__(self, duration: float) -> None:
        self.duration = duration
        self._leases: dict[str, Lease] = {}
        self._heap: list[tuple[float, str]] = []  # (expiry, id), lazily cleaned
        # Recently expired ids, so a late reader is told "expired" rather than "unknown".
        self._expired: OrderedDict[str, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._leases

    def get(self, request_id: str) -> Lease | None:
        return self._leases.get(request_id)

    def held_tokens(self) -> int:
        return sum(lease.prompt_tokens for lease in self._leases.values())

    def hold(self, lease: Lease) -> None:
        self._leases[lease.request_id] = lease
        heapq.heappush(self._heap, (lease.expires, lease.request_id))

    def release(self, request_id: str) -> Lease | None:
        """The decode side is done with these blocks (or will never read them)."""
        return self._leases.pop(request_id, None)

    def extend(self, request_ids: list[str], now: float) -> int:
        """A heartbeat: each lease is pushed to at least 2/3 of a lease from now (vLLM V33)."""
        n = 0
        for rid in request_ids:
            lease = self._leases.get(rid)
            if lease is None:
                continue
            expires = now + self.duration * 2.0 / 3.0
            if expires > lease.expires:
                lease.expires = expires
                heapq.heappush(self._heap, (expires, rid))
            n += 1
        return n

    def was_expired(self, request_id: str) -> bool:
        return request_id in self._expired

    def next_expiry(self) -> float | None:
        self._clean()
        return self._heap[0][0] if self._heap else None

    def expire(self, now: float) -> list[Lease]:
        """Remove and return the leases whose time is up."""
        out: list[Lease] = []
        while True:
            self._clean()
            if not self._heap or self._heap[0][0] > now:
                return out
            _, rid = heapq.heappop(self._heap)
            lease = self._leases.pop(rid)
            self._expired[rid] = None
            if len(self._expired) > 10_000:
                self._expired.popitem(last=False)
            out.append(lease)

    def _clean(self) -> None:
        heap = self._heap
        while heap:
            expires, rid = heap[0]
            lease = self._leases.get(rid)
            if lease is not None and lease.expires == expires:
                return
            heapq.heappop(heap)  # released, or superseded by an extension
