"""The sidecar's prefix index in front of emulated pods whose prefill engines cache prefixes.

Real emulators (vLLM's prefix caching rules in their prefill engines) and a real sidecar on
loopback: the router's approximate index must agree with what the engines really find cached,
and a prefix-cache rule must keep a conversation on the pod that holds it.
"""

from __future__ import annotations

import time

import pytest
from sidecar_testkit import A40, metric, post

from disaggpool.core.prefix_index import prompt_blocks
from disaggpool.errors import InputError
from disaggpool.formats.kv_events import (
    BlockRemoved,
    BlockStored,
    EventBatch,
    encode_batch,
    parse_kv_events_config,
)
from disaggpool.sidecar.config import parse_config
from disaggpool.sidecar.kv_events import KVEventSubscribers
from disaggpool.sidecar.service import RoutingService
from disaggpool.sidecar.supervise import Supervisor

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


@pytest.mark.parametrize("policy", ["calibrated", "cache_aware", "dynamo_kv", "llmd_weighted"])
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


EVENTS_ON = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:0"}'


def with_events(pool) -> dict:
    """The static pool, each prefill pod naming the endpoint its emulator bound."""
    prefill = [
        {"name": n, "url": e.url, "kv_events": e.instance.kv_events.endpoint}
        for n, (r, e) in pool.pods.items()
        if r == "prefill"
    ]
    return {"static": {"prefill": prefill, "decode": pool.urls("decode")}}


def test_kv_events_feed_the_index_and_a_silent_pod_falls_back(start_pool, start_sidecar) -> None:
    pool = start_pool(
        [A40, A40], [A40], kv_events=parse_kv_events_config(EVENTS_ON), kv_lease_duration=1.0
    )
    sc = start_sidecar(
        pool,
        policy="dynamo_kv",
        prefix_index=True,
        kv_events={"stale_after_s": 0.5},
        pool=with_events(pool),
        slo_classes=SLO,
    )
    time.sleep(0.8)  # the subscribers connect (ZMQ's slow joiner drops what comes before)
    chats = conversations(sessions=4)
    for turn in range(3):
        for prompts in chats:
            status, body = post(
                f"{sc.url}/v1/completions", {"prompt": prompts[turn], "max_tokens": 2}
            )
            assert status == 200, body
        time.sleep(0.3)  # the turn's events arrive before the next turn is routed
    assert metric(sc.url, "disaggpool_kv_events_batches_total") > 0
    assert metric(sc.url, "disaggpool_kv_events_malformed_total") == 0
    for pod in ("p0", "p1"):
        assert metric(sc.url, "disaggpool_prefix_index_source", pod=pod, source="events") == 1
    assert metric(sc.url, "disaggpool_prefix_hit_tokens_total") == engine_hits(pool) > 0

    # p0's publisher dies; a prompt it does not hold goes there (Dynamo's rule picks the pod with
    # the least to prefill, p1 is made busier) and nothing is announced: p0 falls back.
    pool.emulator("p0").call(
        lambda: setattr(pool.emulator("p0").instance.kv_events, "silenced", True)
    )
    for i in range(6):
        post(f"{sc.url}/v1/completions", {"prompt": f"fresh prompt {i} " * 20, "max_tokens": 2})
    time.sleep(0.7)
    post(f"{sc.url}/v1/completions", {"prompt": "one more " * 20, "max_tokens": 2})
    assert metric(sc.url, "disaggpool_prefix_index_source", pod="p0", source="routed") == 1
    assert metric(sc.url, "disaggpool_prefix_index_source", pod="p1", source="events") == 1


def test_malformed_messages_are_dropped_and_a_gap_restarts_the_index() -> None:
    pods = {
        "prefill": [{"name": "p0", "url": "http://127.0.0.1:1", "kv_events": "tcp://127.0.0.1:2"}],
        "decode": [{"name": "d0", "url": "http://127.0.0.1:3"}],
    }
    config = parse_config(
        {
            "policy": "calibrated",
            "model": "m",
            "slo_classes": SLO,
            "pool": {"static": pods},
            "prefix_index": True,
            "kv_events": {},
        },
        "<test>",
    )
    service = RoutingService(config)
    service.state.set_members(config.static_members)
    subs = KVEventSubscribers(service, config.kv_events, _supervisor(service))
    tokens = tuple(range(32))

    def batch(seq: int, *events: object) -> list[bytes]:
        return [b"", seq.to_bytes(8, "big"), encode_batch(EventBatch(1.0, tuple(events)))]

    stored = BlockStored((11, 12), None, tokens, 16)
    assert subs._apply("p0", batch(0, stored), None) == 0
    index = service.state.instances["p0"].events
    assert index is not None and index.hit_tokens(prompt_blocks(tokens, 16), 33) == 32
    for junk in (
        [b"only two", b"frames"],
        [b"", b"short", b"x"],
        [b"", (1).to_bytes(8, "big"), b"\xc1"],
    ):
        assert subs._apply("p0", junk, 0) == 0  # dropped, the sequence still expects 1
    assert index.size() == 2
    assert subs._apply("p0", batch(5, BlockRemoved((99,))), 0) == 5  # 1..4 lost
    assert index.size() == 0  # what it missed may have removed anything: it starts over
    metrics = service.metrics.render().decode()
    assert 'disaggpool_kv_events_malformed_total{pod="p0"} 3.0' in metrics
    assert 'disaggpool_kv_events_gaps_total{pod="p0"} 1.0' in metrics


def _supervisor(service: RoutingService) -> Supervisor:
    return Supervisor(service.metrics.loop_errors, service.metrics.loop_restarts)
