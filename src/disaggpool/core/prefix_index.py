"""What a router believes each instance holds in its prefix cache, from what it routed there.

The approximate index of llm-d's estimated-prefix scorer and of Dynamo's router without KV
events: after every decision the chosen instance is assumed to hold the request's full prompt
blocks; each instance's entries are an LRU bounded by the blocks its KV cache can hold, so the
index forgets, oldest use first, roughly what the engine evicts. It never hears of the engine's
real evictions (nor of requests other routers sent), which is why it is approximate; an index fed
by vLLM's KV events replaces it where pods publish them.

`EventIndex` is the precise one: a pod's prefix cache as its KV events announce it (what vLLM
stored and removed). Block ids are recomputed from each stored block's tokens with
`prompt_blocks`'s chaining, linked through the engine's own block hashes, so the ids match the
router's for equal tokens whatever hash the engine uses (Dynamo's and llm-d's approach).

`hit_tokens` answers the question the cost model asks: how many of this prompt's tokens would
instance i find cached, by the engine's own lookup rule (`leading_hit_tokens`, which the engine
model's cache uses too). Pure, no clock: the simulator's router keeps one per replica.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Hashable, Iterable, Mapping, Sequence

__all__ = ["EventIndex", "PrefixIndex", "leading_hit_tokens", "prompt_blocks"]


def _chain(parent: int, tokens: Sequence[int]) -> int:
    """The id of a block of `tokens` after the block `parent` (0: first): one rule for the
    router, the emulator and the events."""
    return hash((parent, tuple(tokens)))


def prompt_blocks(token_ids: Sequence[int], block_tokens: int) -> tuple[int, ...]:
    """Ids of the prompt's full blocks, each chained to all before it (as vLLM chains its block
    hashes): equal ids mean equal token prefixes. Python's hash of a tuple of ints is the same in
    every process, so the router and the emulator compute the same ids from the same tokens;
    they are not vLLM's own hashes, which an index fed by its KV events would read instead."""
    out = []
    parent = 0
    tokens = iter(token_ids)
    # zip over one iterator yields the full blocks as tuples (the partial tail is dropped): half
    # the cost of slicing, on the sidecar's hot path. Same ids as `_chain`.
    for block in zip(*[tokens] * block_tokens, strict=False):
        parent = hash((parent, block))
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


class EventIndex:
    """One pod's prefix cache from its KV events (module docstring). Pure: the subscriber feeds
    it decoded events."""

    def __init__(self) -> None:
        self._ours: dict[Hashable, int] = {}  # engine block hash -> our block id
        self._held: dict[int, int] = {}  # our block id -> engine blocks naming it
        self.block_tokens = 0  # the engine's block size, from its events (0 before any)
        self.unlinked = 0  # stored blocks whose parent we never heard of (lost events)

    def stored(
        self,
        hashes: Sequence[Hashable],
        parent: Hashable | None,
        blocks: Sequence[Sequence[int]],
        block_tokens: int,
    ) -> None:
        """`BlockStored`: blocks with these engine hashes and tokens follow block `parent`."""
        if parent is None:
            ours = 0
        elif parent in self._ours:
            ours = self._ours[parent]
        else:  # its prefix was announced before we listened, or lost: it cannot be chained
            self.unlinked += len(hashes)
            return
        self.block_tokens = block_tokens
        for engine_hash, tokens in zip(hashes, blocks, strict=True):
            ours = _chain(ours, tokens)
            if engine_hash in self._ours:
                self._forget(engine_hash)
            self._ours[engine_hash] = ours
            self._held[ours] = self._held.get(ours, 0) + 1

    def removed(self, hashes: Iterable[Hashable]) -> None:
        """`BlockRemoved` (unknown hashes are ignored: evicted before we listened)."""
        for engine_hash in hashes:
            if engine_hash in self._ours:
                self._forget(engine_hash)

    def cleared(self) -> None:
        """`AllBlocksCleared`, or a gap in the events: nothing is known to be held."""
        self._ours.clear()
        self._held.clear()

    def _forget(self, engine_hash: Hashable) -> None:
        ours = self._ours.pop(engine_hash)
        left = self._held[ours] - 1
        if left:
            self._held[ours] = left
        else:
            del self._held[ours]

    def hit_tokens(self, blocks: Sequence[int], prompt_tokens: int) -> int:
        """Cached tokens of a prompt whose block ids (at `block_tokens`) are `blocks`."""
        if not self._held or not blocks or not self.block_tokens:
            return 0
        return leading_hit_tokens(blocks, prompt_tokens, self.block_tokens, self._held)

    def size(self) -> int:
        return len(self._held)
