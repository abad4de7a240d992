"""The sidecar's prefix index in front of emulated pods whose prefill engines cache prefixes.

Real emulators (vLLM's prefix caching rules in their prefill engines) and a real sidecar on
loopback: the router's approximate index must agree with what the engines really find cached,
and a prefix-cache rule must keep a conversation on the pod that holds it.
"""

from __future__ import annotations

import pytest
from sidecar_testkit import A40, metric, post

from disaggpool.errors import InputError
from disaggpool.sidecar.config import parse_config

SLO = [{"name": "chat", "ttft_s": 30.0, "tpot_s": 1.0}]


def conversations(sessions: int = 4, turns: int = 3) -> list[list[str]]:
    """Prompts of multi-turn chats: each turn repeats the conversation so far and adds to it."""
    out = []
    for s in range(sessions):
        history = " ".join(f"s{s}w{i}" for i in range(60))  # a 60-word system prompt per session
        prompts = []
        for t in range(turns):
            history += " " + " ".join(f"s{s}t{t}x{i}" for i in range(20))
            prompts.append(history)
        out.append(prompts)
    return out


def engine_hits(pool, role: str = "prefill") -> float:
    return sum(
        metric(emu.url, "vllm:prefix_cache_hits_total")
        for r, emu in pool.pods.values()
        if r == role
    )


@pytest.mark.parametrize("policy", ["calibrated", "cache_aware", "dynamo_kv"])
def test_the_index_matches_the_engines_and_keeps_conversations_together(
    start_pool, start_sidecar, policy: str
) -> None:
    pool = start_pool([A40, A40, A40], [A40])
    sc = start_sidecar(pool, policy=policy, prefix_index=True, slo_classes=SLO)
    chats = conversations()
    for turn in range(3):  # the sessions interleaved, as a server sees them
        for s, prompts in enumerate(chats):
            status, body = post(
                f"{sc.url}/v1/completions",
                {"prompt": prompts[turn], "max_tokens": 4},
                {"X-Request-Id": f"s{s}-t{turn}"},
            )
            assert status == 200, body
    routed_hits = metric(sc.url, "disaggpool_prefix_hit_tokens_total")
    looked_up = metric(sc.url, "disaggpool_prefix_lookup_tokens_total")
    # Every later turn finds its conversation cached where it went, by the engine's own count,
    # and the router expected exactly that: same tokens, same blocks, nothing evicted.
    assert routed_hits == engine_hits(pool) > 0
    assert routed_hits > 0.4 * looked_up
    assert metric(sc.url, "disaggpool_prefix_index_blocks") > 0


def test_without_the_index_nothing_is_expected_cached(start_pool, start_sidecar) -> None:
    pool = start_pool([A40, A40, A40], [A40])
    sc = start_sidecar(pool, policy="round_robin", slo_classes=SLO)
    for prompts in conversations(sessions=2):
        for prompt in prompts:
            status, _ = post(f"{sc.url}/v1/completions", {"prompt": prompt, "max_tokens": 2})
            assert status == 200
    assert metric(sc.url, "disaggpool_prefix_lookup_tokens_total") == 0
    # round-robin over three pods sends each turn of a conversation somewhere else
    assert engine_hits(pool) == 0


def test_prefix_rules_need_the_index() -> None:
    pods = {
        "prefill": [{"name": "p0", "url": "http://127.0.0.1:1"}],
        "decode": [{"name": "d0", "url": "http://127.0.0.1:2"}],
    }
    doc = {"policy": "cache_aware", "model": "m", "slo_classes": SLO, "pool": {"static": pods}}
    with pytest.raises(InputError, match=r"policy.*prefix_index"):
        parse_config(doc, "<test>")
    assert parse_config({**doc, "prefix_index": True}, "<test>").prefix_index
