"""What a router believes each instance holds in its prefix cache, from what it routed there.

The approximate index of llm-d's estimated-prefix scorer and of Dynamo's router without KV
events: after every decision the chosen instance is assumed to hold the request's full prompt
blocks; each instance's entries are an LRU bounded by the blocks its KV cache can hold, so the
index forgets, oldest use first, roughly what the engine evicts. It never hears of the engine's
real evictions (nor of requests other routers sent), which is why it is approximate; an index fed
by vLLM's KV events replaces it where pods publish them.

`hit_tokens` answers the question the cost model asks: how many of this prompt's tokens would
instance i find cached, by the engine's own lookup rule (`leading_hit_tokens`, which the engine
model's cache uses too). Pure, no clock: the simulator's router keeps one per replica.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Iterable, Mapping, Sequence

__all__ = ["PrefixIndex", "leading_hit_tokens", "prompt_blocks"]


def prompt_blocks(token_ids: Sequence[int], block_tokens: int) -> tuple[int, ...]:
    """Ids of the prompt's full blocks, each chained to all before it (as vLLM chains its block
    hashes): equal ids mean equal token prefixes. Python's hash of a tuple of ints is the same in
    every process, so the router and the emulator compute the same ids from the same tokens;
    they are not vLLM's own hashes, which an index fed by its KV events would read instead."""
    out = []
    parent = 0
    for start in range(0, len(token_ids) - block_tokens + 1, block_tokens):
        parent = hash((parent, tuple(token_ids[start : start + block_tokens])))
        out.append(parent)
    return tuple(out)


def leading_hit_tokens(
    blocks: Sequence[int], prompt_tokens: int, block_tokens: int, held: Container[int]
) -> int:
    """vLLM's prefix-cache lookup: the leading full blocks `held` holds, stopping at the first
    miss, capped at prompt - 1 tokens in whole blocks (a fully cached prompt still computes its
    last block)."""
    hits = 0
    for block in blocks[: (prompt_tokens - 1) // block_tokens]:
        if block not in held:
            break
        hits += 1
    return hits * block_tokens


class PrefixIndex:
    """Per-instance LRU sets of block ids (module docstring)."""

    def __init__(self) -> None:
        self._held: dict[str, OrderedDict[int, None]] = {}

    def hit_tokens(
        self, instance: str, blocks: Sequence[int], prompt_tokens: int, block_tokens: int
    ) -> int:
        held = self._held.get(instance)
        if not held or not blocks:
            return 0
        return leading_hit_tokens(blocks, prompt_tokens, block_tokens, held)

    def hits(
        self,
        instances: Iterable[str],
        blocks: Sequence[int],
        prompt_tokens: int,
        block_tokens: int,
    ) -> Mapping[str, int]:
        """Instance -> cached prompt tokens, for the instances with any."""
        out = {}
        for name in instances:
            h = self.hit_tokens(name, blocks, prompt_tokens, block_tokens)
            if h:
                out[name] = h
        return out

    def record(
        self,
        instance: str,
        blocks: Sequence[int],
        prompt_tokens: int,
        block_tokens: int,
        capacity_tokens: int,
    ) -> None:
        """`instance` now holds the prompt's full blocks (most recently used); the oldest go
        once more than `capacity_tokens` worth are held."""
        held = self._held.get(instance)
        if held is None:
            held = self._held[instance] = OrderedDict()
        for block in blocks[: prompt_tokens // block_tokens]:
            if block in held:
                held.move_to_end(block)
            else:
                held[block] = None
        limit = max(0, capacity_tokens // block_tokens)
        while len(held) > limit:
            held.popitem(last=False)

    def forget(self, instance: str) -> None:
        """An instance left the pool (or restarted): it holds nothing we know of."""
        self._held.pop(instance, None)

    def size(self, instance: str) -> int:
        held = self._held.get(instance)
        return len(held) if held else 0
