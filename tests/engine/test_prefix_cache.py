"""The engine's prefix cache: vLLM's lookup and eviction rules on hand-worked cases, the prefill
engine computing only what it does not hold (and pricing it by the partial-prefill formula), and
the decode engine pulling, or computing on its local path, only what it does not hold."""

from __future__ import annotations

import dataclasses

import pytest

from disaggpool.core.hardware import builtin_profile
from disaggpool.core.profile import PrefillModel
from disaggpool.engine.decode import DecodeEngine
from disaggpool.engine.prefill import PrefillEngine
from disaggpool.engine.prefix_cache import PrefixCache
from disaggpool.engine.request import EngineRequest

A40 = builtin_profile("a40-llama3-8b")


def test_lookup_stops_at_the_first_miss_and_leaves_the_last_token() -> None:
    cache = PrefixCache(4)
    cache.acquire((1, 2, 3), 12)
    cache.release((1, 2, 3), 12)
    assert cache.hit_tokens((1, 2, 3), 13) == 12  # three full blocks, a 13th token to compute
    assert cache.hit_tokens((1, 2, 3), 12) == 8  # fully cached: the last block is recomputed
    assert cache.hit_tokens((1, 9, 3), 12) == 4  # the walk stops at the first miss
    assert cache.hit_tokens((7, 2, 3), 12) == 0


def test_eviction_order_is_vllms() -> None:
    """Released blocks queue by release time, a request's deepest first; a hit takes a block
    out of the queue; blocks in use are never evicted."""
    cache = PrefixCache(1)
    assert cache.acquire((1, 2, 3), 3) == [0, 1, 2]  # request A: three blocks stored
    assert cache.acquire((7, 8), 2) == [0, 1]  # request B
    assert cache.release((1, 2, 3), 3) == 3  # A done: queue 3, 2, 1
    assert cache.release((7, 8), 2) == 2  # B done: queue 3, 2, 1, 8, 7
    assert cache.acquire((1, 2), 2) == []  # a hit on 1 and 2 takes them out: queue 3, 8, 7
    assert cache.evict_to(2) == [3] and not cache.holds(3)  # the deepest block of A went first
    assert cache.evict_to(1) == [8] and not cache.holds(8) and cache.holds(7)
    assert cache.evict_to(0) == [7] and cache.holds(1) and cache.holds(2)  # in use: kept
    assert cache.release((1, 2), 2) == 2 and cache.cached_tokens == 2


def test_need_counts_what_comes_into_use_and_release_gives_it_back() -> None:
    cache = PrefixCache(4)
    assert cache.need_tokens((1, 2, 3), 10) == 10  # two new blocks and a private 2-token tail
    cache.acquire((1, 2, 3), 10)
    assert cache.need_tokens((1, 2, 5), 10) == 2  # 1 and 2 are in use already: shared
    assert cache.acquire((1, 2, 5), 10) == []  # its third block is only its private tail
    assert cache.acquire((1, 2, 5, 6), 16) == [2, 3]  # in use by the first: stored anew
    assert cache.release((1, 2, 5, 6), 16) == 8
    assert cache.release((1, 2, 3), 10) == 2  # only its tail: the blocks are still shared
    assert cache.release((1, 2, 5), 10) == 10
    assert cache.need_tokens((1, 2), 8) == 8  # cached but free: they come back into use


def test_prefill_computes_only_the_uncached_part() -> None:
    """Second request: the same 1,024-token prefix (two 512-token blocks) and 200 new tokens.
    Its prefill starts at offset 1,024: p0 + p1 * 200 + p2 * (1224**2 - 1024**2)."""
    prof = dataclasses.replace(A40, prefill=PrefillModel(0.01, 1e-4, 1e-8))
    eng = PrefillEngine("p", prof, prefix_caching=True)
    first = EngineRequest(0, 0.0, 1100, 1, "x", blocks=(10, 11, 12), block_tokens=512)
    eng.enqueue(first, 0.0)
    t = eng.next_wakeup()
    assert t is not None and eng.advance(t) == [first]
    eng.release(first, t)
    assert eng.kv_used == 0  # its full blocks stay cached, not in use
    second = EngineRequest(1, t, 1224, 1, "x", blocks=(10, 11, 13), block_tokens=512)
    eng.enqueue(second, t)
    assert second.cached_tokens == 1024
    expected = 0.01 + 1e-4 * 200 + 1e-8 * (1224**2 - 1024**2)
    assert eng.next_wakeup() == pytest.approx(t + expected)
    assert (eng.prefix_queries, eng.prefix_hits) == (1100 + 1224, 1024)
    assert eng.kv_used == 1224  # the hit blocks are in use again, plus its own new tokens


def test_caching_off_or_no_blocks_prefills_in_full() -> None:
    for eng, blocks in (
        (PrefillEngine("p", A40), (1, 2)),
        (PrefillEngine("p", A40, prefix_caching=True), ()),
    ):
        for i in range(2):
            req = EngineRequest(i, 0.0, 1000, 1, "x", blocks=blocks, block_tokens=512)
            eng.enqueue(req, 0.0)
            t = eng.next_wakeup()
            assert t is not None and eng.advance(t) == [req]
            eng.release(req, t)
            assert req.cached_tokens == 0
        assert eng.prefix_hits == 0


def test_cached_blocks_give_way_to_new_prompts() -> None:
    """The cache lives in the KV capacity: a prompt that needs the room evicts cached blocks."""
    eng = PrefillEngine("p", dataclasses.replace(A40, kv_capacity_tokens=2048), prefix_caching=True)
    a = EngineRequest(0, 0.0, 2048, 1, "x", blocks=(1, 2, 3, 4), block_tokens=512)
    eng.enqueue(a, 0.0)
    t = eng.next_wakeup()
    assert t is not None and eng.advance(t) == [a]
    eng.release(a, t)
    assert eng.cache is not None and eng.cache.cached_tokens == 2048
    b = EngineRequest(1, t, 1536, 1, "x", blocks=(5, 6, 7), block_tokens=512)
    eng.enqueue(b, t)
    assert eng.num_running == 1 and eng.kv_used == 1536
    assert eng.cache.cached_tokens == 512  # a's tail blocks went first
    assert eng.cache.holds(1) and not eng.cache.holds(4)


def _decode_one(eng: DecodeEngine, req: EngineRequest, now: float, **kw: bool) -> float:
    """Run `req` alone on `eng` from `now` to its finish; returns the finish time."""
    eng.enqueue(req, now, **kw)
    t = now
    while req.finish < 0:
        nxt = eng.next_wakeup()
        assert nxt is not None
        t = nxt
        eng.advance(t)
    return t


def test_decode_pulls_only_what_its_own_cache_lacks() -> None:
    """vLLM's NIXL connector on D pulls the prompt minus D's local hit: a second request that
    shares the first one's two leading blocks transfers 1500 - 1024 tokens."""
    eng = DecodeEngine("d", A40, prefix_caching=True)
    a = EngineRequest(0, 0.0, 1500, 4, "x", blocks=(1, 2), block_tokens=512)
    t = _decode_one(eng, a, 0.0)
    assert a.decode_cached_tokens == 0
    assert eng.cache is not None and eng.cache.cached_tokens == 1024  # a's blocks stay cached
    b = EngineRequest(1, t, 1500, 4, "x", blocks=(1, 2), block_tokens=512)
    started = eng.enqueue(b, t)
    assert started == [b] and b.decode_cached_tokens == 1024
    assert eng.next_wakeup() == pytest.approx(t + A40.kv_transfer.time(1500 - 1024))
    c = EngineRequest(2, t, 1500, 4, "x", blocks=(1, 9), block_tokens=512)
    eng.enqueue(c, t)  # b holds 1 and 2 now: c hits block 1 only
    assert c.decode_cached_tokens == 512
    assert (eng.prefix_queries, eng.prefix_hits) == (4500, 1536)


def test_decode_local_path_computes_only_the_uncached_part() -> None:
    """A prompt prefilled on the decode instance is charged the partial-prefill cost of its
    uncached tokens, exactly as the prefill engine charges it."""
    pf = A40.prefill
    eng = DecodeEngine("d", A40, prefix_caching=True)
    a = EngineRequest(0, 0.0, 1500, 2, "x", blocks=(1, 2), block_tokens=512)
    t = _decode_one(eng, a, 0.0, prefill_here=True)
    b = EngineRequest(1, t, 1500, 2, "x", blocks=(1, 2), block_tokens=512)
    eng.enqueue(b, t, prefill_here=True)
    eng.advance(t)  # joins now: its prefill is the extra time of the step it joins
    new, h = 1500 - 1024, 1024
    assert eng.prefill_end() - t == pytest.approx(pf.p0 + pf.p1 * new + pf.p2 * (1500**2 - h**2))


def test_decode_cache_gives_way_to_running_sequences() -> None:
    """Cached blocks live in the KV capacity beside the running sequences' growing contexts:
    decoding into the room evicts them (least recently released first), and caching off or a
    request without blocks looks nothing up."""
    eng = DecodeEngine("d", dataclasses.replace(A40, kv_capacity_tokens=3000), prefix_caching=True)
    a = EngineRequest(0, 0.0, 1024, 2, "x", blocks=(1, 2), block_tokens=512)
    t = _decode_one(eng, a, 0.0)
    assert eng.cache is not None and eng.cache.cached_tokens == 1024
    b = EngineRequest(1, t, 1536, 600, "x", blocks=(5, 6, 7), block_tokens=512)
    t = _decode_one(eng, b, t)  # ~1536 + 600 tokens in use at its last step: room for 1 block
    assert eng.cache.cached_tokens == 512 + 1536  # one of a's blocks, then b's three
    assert eng.cache.holds(1) and not eng.cache.holds(2)  # a's deeper block went first
    assert eng.cache.holds(5)
    for off, blocks in ((DecodeEngine("d", A40), (1, 2)), (eng, ())):
        r = EngineRequest(9, t, 1100, 2, "x", blocks=blocks, block_tokens=512)
        _decode_one(off, r, t)
        assert r.decode_cached_tokens == 0
