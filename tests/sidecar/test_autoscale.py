"""The router's recommenders (`sidecar.autoscale`) on a routing service fed by its own routes.

The service routes real requests (its router, its books, its demand window) on a fake clock,
over two profiled pods; the recommenders read what routing recorded: the prefill one sizes the
prefill pool by the prompts routed (`DemandWindow.admitted`), which only the service's route
path feeds.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from disaggpool.core.hardware import builtin_profile
from disaggpool.core.ledger import Gauges
from disaggpool.labels import DECODE_RECOMMENDATION_KEY, PREFILL_RECOMMENDATION_KEY
from disaggpool.sidecar.autoscale import DecodeRecommender, PrefillRecommender
from disaggpool.sidecar.config import Member, parse_config
from disaggpool.sidecar.service import RoutingService

CONFIG: dict[str, Any] = {
    "model": "m",
    "max_inflight": 100_000,
    "slo_classes": [
        {"name": "strict", "ttft_s": 0.5, "tpot_s": 0.1},
        {"name": "loose", "ttft_s": 5, "tpot_s": 1},
    ],
    "pool": {
        "static": {
            "prefill": [{"name": "p", "url": "http://h:1"}],
            "decode": [{"name": "d", "url": "http://h:2"}],
        }
    },
}


def service(**autoscaling: Any) -> tuple[RoutingService, list[float]]:
    bounds = {"min_replicas": 1, "max_replicas": 4, **autoscaling}
    config = parse_config({**CONFIG, "autoscaling": bounds}, "sidecar.yaml")
    clock = [1000.0]
    svc = RoutingService(config, clock=lambda: clock[0])
    svc.state.set_members(
        [Member("p", "prefill", "http://h:1"), Member("d", "decode", "http://h:2")]
    )
    profile = dataclasses.replace(builtin_profile("a40-llama3-8b"), quality="good")
    for pod in ("p", "d"):
        svc.install_profile(pod, profile, clock[0])
        svc.state.scraped(pod, Gauges(4, 2, 0.2, 190_000), clock[0])
    return svc, clock


def route(svc: RoutingService, clock: list[float], rps: float, seconds: float, prompt: int) -> None:
    """`rps` requests a second for `seconds`, each of `prompt` tokens, through `route`."""
    for i in range(int(rps * seconds)):
        clock[0] += 1.0 / rps
        svc.route(f"r{i}", prompt, "loose", max_tokens=64)


def test_the_prefill_recommendation_follows_the_prompts_routed() -> None:
    svc, clock = service(prefill={"min_replicas": 1, "max_replicas": 3})
    prefill = PrefillRecommender(svc.config.autoscaling, svc)  # type: ignore[arg-type]
    assert prefill.key == PREFILL_RECOMMENDATION_KEY == "prefillRecommendation"
    route(svc, clock, 40.0, 30.0, 6000)
    got = prefill.current()
    assert got is not None
    replicas, body = got
    # Long prompts at 40 req/s keep more than three prefill pods busy: the router asks for
    # them, and its own bounds (autoscaling.prefill) cap the count at 3.
    wish = int(body["reason"].rsplit("-> ", 1)[1])
    assert wish > 3 and replicas == body["replicas"] == 3, body
    assert svc.metrics.desired_prefill._value.get() == 3  # type: ignore[attr-defined]
    assert prefill.last == 3

    # The same traffic with short prompts needs fewer prefill pods than long ones.
    short, clock2 = service(prefill={"min_replicas": 1, "max_replicas": 64})
    route(short, clock2, 40.0, 30.0, 100)
    long_, clock3 = service(prefill={"min_replicas": 1, "max_replicas": 64})
    route(long_, clock3, 40.0, 30.0, 6000)
    few = PrefillRecommender(short.config.autoscaling, short).recommend()  # type: ignore[arg-type]
    many = PrefillRecommender(long_.config.autoscaling, long_).recommend()  # type: ignore[arg-type]
    assert few is not None and many is not None
    assert few.replicas < many.replicas, (few, many)


def test_min_headroom_raises_the_prefill_floor() -> None:
    def wish(headroom: float) -> int:
        svc, clock = service(min_headroom=headroom, prefill={"min_replicas": 0, "max_replicas": 64})
        route(svc, clock, 40.0, 30.0, 3000)
        rec = PrefillRecommender(svc.config.autoscaling, svc)  # type: ignore[arg-type]
        decision = rec.recommend()
        assert decision is not None
        return int(decision.reason.rsplit("-> ", 1)[1])

    assert wish(3.0) > wish(0.0)


def test_without_a_trusted_prefill_profile_there_is_no_prefill_recommendation() -> None:
    svc, clock = service(prefill={"min_replicas": 1, "max_replicas": 3})
    svc.install_profile("p", None, clock[0])
    route(svc, clock, 10.0, 5.0, 1000)
    assert PrefillRecommender(svc.config.autoscaling, svc).current() is None  # type: ignore[arg-type]
    decode = DecodeRecommender(svc.config.autoscaling, svc)  # type: ignore[arg-type]
    assert decode.key == DECODE_RECOMMENDATION_KEY
    assert decode.current() is not None  # decode is sized all the same


def test_a_prefill_recommender_needs_prefill_bounds() -> None:
    svc, _ = service()
    assert svc.config.autoscaling is not None and svc.config.autoscaling.prefill is None
    with pytest.raises(ValueError, match=r"autoscaling\.prefill"):
        PrefillRecommender(svc.config.autoscaling, svc)


def test_kv_the_prefill_pods_park_for_decode_holds_prefill_pods() -> None:
    def wish(kv_usage: float) -> int:
        svc, clock = service(prefill={"min_replicas": 1, "max_replicas": 64})
        route(svc, clock, 1.0, 30.0, 100)
        svc.state.scraped("p", Gauges(4, 2, kv_usage, 190_000), clock[0])
        decision = PrefillRecommender(svc.config.autoscaling, svc).recommend()  # type: ignore[arg-type]
        assert decision is not None
        return int(decision.reason.rsplit("-> ", 1)[1])

    # A trickle of short prompts needs one pod; the scraped vllm:kv_cache_usage_perc of 0.9
    # (KV waiting for decode) keeps four, at most a quarter of each one's cache.
    assert wish(0.0) == 1
    assert wish(0.9) == 4
