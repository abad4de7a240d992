"""One engine's prefix cache, kept as vLLM v1 keeps it (`BlockPool` and its free-block queue).

Units are the request's prompt blocks (`EngineRequest.blocks`, `block_tokens` each, ids chained
so that an id names its whole prefix). What is modelled, from vLLM's own rules:

* only full blocks are cached; the last, partial block of a prompt is the request's own;
* a lookup walks the blocks from the first and stops at the first one not held; the hit is
  capped at prompt - 1 tokens and rounded down to whole blocks (a fully cached prompt still
  computes its last block);
* a block is held while a request uses it (reference count above 0) and stays cached once the
  last user releases it, in a free queue ordered by release time; a request releases its blocks
  tail first, so within one prompt the deeper blocks are evicted before its prefix;
* a hit on a free cached block takes it out of the queue; blocks in use are never evicted;
  new blocks evict from the head of the queue (least recently released first) only when the
  memory is needed.

The cache counts tokens "in use" (held by requests, what vLLM reports as KV usage) apart from
tokens only cached (free, evictable); the engine keeps both within its KV capacity.

Pure, no clock: used by `engine.prefill` and `engine.decode`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from disaggpool.core.prefix_index import leading_hit_tokens
from disaggpool.engine.request import EngineRequest

__all__ = ["PrefixCache", "cache_for"]


def cache_for(cache: PrefixCache | None, req: EngineRequest, engine: str) -> PrefixCache:
    """The engine's cache (made for its first request with blocks); every request must use the
    same block size."""
    if cache is None:
        return PrefixCache(req.block_tokens)
    if cache.block_tokens != req.block_tokens:
        raise ValueError(
            f"{engine}: request {req.index} has {req.block_tokens}-token blocks, "
            f"the cache {cache.block_tokens}"
        )
    return cache


class PrefixCache:
    """Blocks of `block_tokens` tokens, by id (module docstring)."""

    def __init__(self, block_tokens: int) -> None:
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self.block_tokens = block_tokens
        self._refs: dict[int, int] = {}  # blocks in use -> requests using them
        self._free: OrderedDict[int, None] = OrderedDict()  # cached, unused; head evicted first

    @property
    def cached_tokens(self) -> int:
        """Tokens held only as cache (evictable)."""
        return len(self._free) * self.block_tokens

    def hit_tokens(self, blocks: Sequence[int], prompt_tokens: int) -> int:
        """Prompt tokens a lookup finds cached (leading full blocks, capped: docstring)."""
        return leading_hit_tokens(blocks, prompt_tokens, self.block_tokens, self)

    def need_tokens(self, blocks: Sequence[int], prompt_tokens: int) -> int:
        """Tokens that come into use if the request is admitted: its private tail and every full
        block not already in use by another request (a cached block stops being evictable, a new
        one is stored). Exactly what `acquire` adds and `release` later gives back."""
        b = self.block_tokens
        full = prompt_tokens // b
        refs = self._refs
        return prompt_tokens - full * b + sum(b for block in blocks[:full] if block not in refs)

    def acquire(self, blocks: Sequence[int], prompt_tokens: int) -> list[int]:
        """Admit a request: its full blocks are now in use (hits touched, misses stored).
        Returns the positions (in `blocks`) of the blocks stored anew, what vLLM announces as
        `BlockStored`."""
        refs, free = self._refs, self._free
        stored = []
        for i, block in enumerate(blocks[: prompt_tokens // self.block_tokens]):
            count = refs.get(block)
            if count is not None:
                refs[block] = count + 1
                continue
            if block in free:  # cached, unused: in use again
                del free[block]
            else:
                stored.append(i)
            refs[block] = 1
        return stored

    def release(self, blocks: Sequence[int], prompt_tokens: int) -> int:
        """A request gave its blocks back (tail first); returns the tokens no longer in use
        (its private tail, and the blocks it was the last user of, which stay cached)."""
        b = self.block_tokens
        full = prompt_tokens // b
        freed = prompt_tokens - full * b
        refs, free = self._refs, self._free
        for block in reversed(blocks[:full]):
            count = refs[block] - 1
            if count:
                refs[block] = count
            else:
                del refs[block]
                free[block] = None  # to the tail: evicted after everything released before
                freed += b
        return freed

    def evict_to(self, room_tokens: int) -> list[int]:
        """Drop least recently released blocks until the cached tokens fit `room_tokens`;
        returns the blocks that went (vLLM's `BlockRemoved`)."""
        gone = []
        while self._free and len(self._free) * self.block_tokens > room_tokens:
            gone.append(self._free.popitem(last=False)[0])
        return gone

    def clear(self) -> bool:
        """Forget every cached block, as vLLM's `reset_prefix_cache`: only when no request holds
        any (False, and nothing changes, otherwise)."""
        if self._refs:
            return False
        self._free.clear()
        return True

    def __contains__(self, block: object) -> bool:
        return block in self._refs or block in self._free

    def holds(self, block: int) -> bool:
        return block in self
