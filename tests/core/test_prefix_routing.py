"""The router's side of prefix caching: the approximate index, the cost model's credit for a
cached prefix (hand-computed), the ledger booking only the uncached work, and the peers' rules."""

from __future__ import annotations

import dataclasses
import random

import pytest

from disaggpool.core import costmodel
from disaggpool.core.contracts import InstanceSnapshot, PoolSnapshot, RequestFeatures, SLOClass
from disaggpool.core.hardware import builtin_profile
from disaggpool.core.ledger import Entry, Ledger, view
from disaggpool.core.policies.registry import make_policy
from disaggpool.core.prefix_index import EventIndex, PrefixIndex, prompt_blocks
from disaggpool.core.profile import PrefillModel

SLO = SLOClass("chat", 3.0, 0.1)
A40 = builtin_profile("a40-llama3-8b")


def test_index_matches_leading_blocks_and_forgets_the_oldest() -> None:
    index = PrefixIndex()
    index.record("p0", (1, 2, 3), 1536, 512, capacity_tokens=1536)
    assert index.hit_tokens("p0", (1, 2, 3, 4), 2000, 512) == 1536
    assert index.hit_tokens("p0", (1, 2, 3), 1536, 512) == 1024  # the engine's prompt - 1 cap
    assert index.hit_tokens("p0", (1, 5, 3), 1536, 512) == 512
    assert index.hit_tokens("p1", (1, 2, 3), 1536, 512) == 0
    index.record("p0", (1, 7), 1024, 512, capacity_tokens=1536)  # 1 refreshed, 7 new: 2 goes
    assert index.size("p0") == 3 and index.hit_tokens("p0", (1, 2), 1100, 512) == 512
    assert index.hits(["p0", "p1"], (1, 7, 9), 1536, 512) == {"p0": 1024}
    index.forget("p0")
    assert index.hits(["p0"], (1, 7, 9), 1536, 512) == {}


def _prefill(name: str, **kw: object) -> InstanceSnapshot:
    prof = dataclasses.replace(A40, name=name, prefill=PrefillModel(0.01, 1e-4, 1e-8))
    return InstanceSnapshot(name=name, role="prefill", profile=prof, **kw)  # type: ignore[arg-type]


def test_cost_model_credits_the_cached_prefix() -> None:
    """Prompt 2,000 tokens, 1,536 cached on p0, nothing queued: p0 prefills 464 tokens over the
    whole context, 0.01 + 1e-4 * 464 + 1e-8 * (2000**2 - 1536**2) = 0.0804 s; p1 all 2,000:
    0.01 + 0.2 + 0.04 = 0.25 s."""
    req = RequestFeatures("r", 2000, 100.0, 50.0, SLO, prefix_hits={"p0": 1536})
    p0, p1 = _prefill("p0"), _prefill("p1")
    assert costmodel.prefill_ready_time(req, p0, p0.profile) == pytest.approx(  # type: ignore[arg-type]
        0.01 + 1e-4 * 464 + 1e-8 * (2000**2 - 1536**2)
    )
    assert costmodel.prefill_ready_time(req, p1, p1.profile) == pytest.approx(0.25)  # type: ignore[arg-type]


def test_ledger_books_only_the_uncached_work() -> None:
    led = Ledger()
    led.routed(Entry("a", "p0", "d0", 2000, 50.0, SLO, 0.0, cached_tokens=1536))
    snap = view("p0", "prefill", led.accounts["p0"], None)
    assert snap.queued_tokens == 464
    assert snap.queued_sq_tokens == pytest.approx(2000**2 - 1536**2)
    led.prefilled("a")
    assert led.accounts["p0"].queued_tokens == 0 and led.accounts["p0"].queued_sq_tokens == 0


def _pool(queued: dict[str, int]) -> PoolSnapshot:
    prefill = [_prefill(n, queued=1 if q else 0, inflight=1 if q else 0, queued_tokens=q)
               for n, q in queued.items()]  # fmt: skip
    decode = [InstanceSnapshot(name="d0", role="decode", profile=A40)]
    return PoolSnapshot(now=0.0, prefill=prefill, decode=decode)


def test_calibrated_trades_a_cache_hit_against_a_queue_in_seconds() -> None:
    """p0 holds 1,536 tokens of the prompt. Behind a short queue it still wins; behind a queue
    longer than what the hit saves, the idle p1 wins."""
    policy = make_policy("calibrated")
    req = RequestFeatures("r", 2000, 100.0, 50.0, SLO, prefix_hits={"p0": 1536})
    rng = random.Random(1)
    assert policy.route(req, _pool({"p0": 500, "p1": 0}), rng).prefill == "p0"
    assert policy.route(req, _pool({"p0": 3000, "p1": 0}), rng).prefill == "p1"
    blind = dataclasses.replace(req, prefix_hits={})
    assert policy.route(blind, _pool({"p0": 500, "p1": 0}), rng).prefill == "p1"


def test_peer_rules() -> None:
    rng = random.Random(1)
    req = RequestFeatures("r", 2000, 100.0, 50.0, SLO, prefix_hits={"p0": 1536})
    # vLLM router: 1536 / 2000 > 0.3 and loads balanced -> the longest match, whatever its queue.
    assert make_policy("cache_aware").route(req, _pool({"p0": 3000, "p1": 0}), rng).prefill == "p0"
    low = dataclasses.replace(req, prefix_hits={"p0": 512})  # 0.26 of the prompt: by load
    assert make_policy("cache_aware").route(low, _pool({"p0": 3000, "p1": 0}), rng).prefill == "p1"
    # Dynamo: queued + prompt - cached, in blocks: p0 3000 + 464 > p1 2000; 500 + 464 < 2000.
    dyn = make_policy("dynamo_kv")
    assert dyn.route(req, _pool({"p0": 3000, "p1": 0}), rng).prefill == "p1"
    assert dyn.route(req, _pool({"p0": 500, "p1": 0}), rng).prefill == "p0"


def test_llmd_weighted_sums_its_scorers() -> None:
    """2 x cached share + (1 - KV in use) + waiting min-max: p0 (1536 of 2000 cached, 4 waiting)
    scores 1.536 + 1 + 0 = 2.536 against the idle p1's 0 + 1 + 1 = 2; with p0's KV full,
    1.536 < 2. Decode: the emptier queue."""
    llmd = make_policy("llmd_weighted")
    req = RequestFeatures("r", 2000, 100.0, 50.0, SLO, prefix_hits={"p0": 1536})
    full = A40.kv_capacity_tokens

    def pool(p0_kv: int) -> PoolSnapshot:
        return PoolSnapshot(
            now=0.0,
            prefill=[_prefill("p0", waiting=4, kv_tokens_used=p0_kv), _prefill("p1")],
            decode=[
                InstanceSnapshot(name="d0", role="decode", profile=A40, waiting=3),
                InstanceSnapshot(name="d1", role="decode", profile=A40, waiting=1),
            ],
        )

    rng = random.Random(1)
    d = llmd.route(req, pool(0), rng)
    assert (d.prefill, d.decode) == ("p0", "d1")
    assert llmd.route(req, pool(full), rng).prefill == "p1"


def test_event_index_recomputes_the_routers_ids_from_the_events() -> None:
    """Whatever hashes the engine announces, blocks chained from its tokens get the ids the
    router computes from the same tokens; removals and a clear take them away."""
    tokens = list(range(100, 140))  # 40 tokens: two full blocks of 16 and a tail
    blocks = prompt_blocks(tokens, 16)
    assert len(blocks) == 2
    index = EventIndex()
    assert index.hit_tokens(blocks, 40) == 0
    index.stored([b"h0"], None, [tokens[:16]], 16)  # the engine's own opaque hashes
    index.stored([b"h1"], b"h0", [tokens[16:32]], 16)
    assert index.hit_tokens(blocks, 40) == 32
    other = prompt_blocks([*tokens[:16], *range(16)], 16)  # same first block only
    assert index.hit_tokens(other, 40) == 16
    index.removed([b"h1", b"unknown"])
    assert index.hit_tokens(blocks, 40) == 16
    index.stored([b"h9"], b"never-announced", [tokens[16:32]], 16)  # cannot be chained
    assert index.unlinked == 1 and index.hit_tokens(blocks, 40) == 16
    index.cleared()
    assert index.hit_tokens(blocks, 40) == 0 and index.size() == 0
