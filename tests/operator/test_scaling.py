"""Autoscaling in the operator's pure half (decode, and prefill with prefill.maxReplicas): the
spec, the recommendations, the rendering."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from operator_testkit import load_sample

from disaggpool.labels import DECODE_RECOMMENDATION_KEY, PREFILL_RECOMMENDATION_KEY
from disaggpool.operator.names import PoolRef
from disaggpool.operator.render import ROUTER_CONFIG_KEY, render_pool
from disaggpool.operator.scaling import (
    pool_scale,
    read_recommendation,
    role_scale,
    with_replicas,
)
from disaggpool.operator.spec import PoolSpec, parse_spec
from disaggpool.sidecar.config import parse_config
from disaggpool.sidecar.service import RoutingService

POOL = PoolRef("small", "serving", "uid-1", 1)


def spec(prefill: dict[str, Any] | None = None, **autoscaling: Any) -> PoolSpec:
    doc = load_sample("small.yaml")["spec"]
    doc["decode"] = {"replicas": 2, "minReplicas": 1, "maxReplicas": 4}
    if prefill is not None:
        doc["prefill"] = prefill
    doc["autoscaling"] = {"enabled": True, **autoscaling}
    parsed, issues = parse_spec(doc, "img")
    assert parsed is not None, issues
    return parsed


def rec(
    replicas: object, reason: str = "busy", key: str = DECODE_RECOMMENDATION_KEY
) -> dict[str, Any]:
    """The router's report (`status.router`) with a recommendation."""
    body = {"replicas": replicas, "reason": reason, "at": "2026-12-04T12:00:00+00:00"}
    return {key: body}


def decode_scale(s: PoolSpec, report: dict[str, Any], previous: Any = None) -> Any:
    return role_scale(s, "decode", report, previous)


def test_the_recommendation_is_applied_within_the_bounds() -> None:
    s = spec()
    assert decode_scale(s, rec(3)).replicas == 3
    high = decode_scale(s, rec(9))
    assert high.replicas == 4 and high.reason == "busy (router asked 9, bounds 1..4)"
    assert decode_scale(s, rec(0)).replicas == 1
    assert high.status()["recommendedReplicas"] == 9 and high.status()["source"] == "autoscaler"


def test_without_a_recommendation_or_autoscaling_the_spec_count_stands() -> None:
    first = decode_scale(spec(), {})
    assert (first.replicas, first.source) == (2, "spec")
    assert "no recommendation from the router yet" in first.reason
    off, _ = parse_spec(load_sample("small.yaml")["spec"], "img")
    assert off is not None
    assert decode_scale(off, rec(3)).replicas == off.decode.replicas


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("{not json", "must be an object"),
        ([1, 2], "must be an object"),
        ({"replicas": -1}, "non-negative integer, got -1"),
        ({"replicas": True}, "non-negative integer, got True"),
        ({"replicas": "3"}, "non-negative integer, got '3'"),
        ({"reason": "x"}, "non-negative integer, got None"),
    ],
)
def test_a_bad_recommendation_is_reported_and_ignored(body: object, message: str) -> None:
    # The CRD's schema refuses most of these on a real API server; kmock and older CRDs do not.
    got, error = read_recommendation({DECODE_RECOMMENDATION_KEY: body})
    assert got is None and message in error
    assert "status.router.decodeRecommendation" in error
    scale = decode_scale(spec(), {DECODE_RECOMMENDATION_KEY: body})
    assert scale.replicas == 2 and scale.status()["error"] == error  # nothing applied before
    kept = decode_scale(
        spec(),
        {DECODE_RECOMMENDATION_KEY: body},
        {"replicas": 4, "source": "autoscaler"},
    )
    assert kept.replicas == 4 and kept.error == error  # the pool keeps the count it has


def test_bad_autoscaling_specs_name_their_field() -> None:
    doc = load_sample("heterogeneous.yaml")["spec"]
    doc["autoscaling"] = {"enabled": True, "targetGoodput": 1.0, "burstWindowSeconds": 60}
    _, issues = parse_spec(doc, "img")
    messages = {i.field: i.message for i in issues}
    assert "a single decode variant" in messages["autoscaling.enabled"]
    assert "[0.5, 1)" in messages["autoscaling.targetGoodput"]
    assert "120" in messages["autoscaling.burstWindowSeconds"]


def test_only_an_autoscaled_pool_lets_its_router_write_its_status_and_nothing_else() -> None:
    def router_rules(s: PoolSpec) -> list[dict[str, Any]]:
        role = next(
            o
            for o in render_pool(POOL, s)
            if o["kind"] == "Role" and "router" in o["metadata"]["name"]
        )
        return list(role["rules"])

    off, _ = parse_spec(load_sample("small.yaml")["spec"], "img")
    assert off is not None
    assert all(r["apiGroups"] == [""] for r in router_rules(off))
    (pool_rule,) = [r for r in router_rules(spec()) if r["apiGroups"] == ["disaggpool.io"]]
    # The status subresource of its own pool, patch only: never the spec the operator deploys.
    assert pool_rule == {
        "apiGroups": ["disaggpool.io"],
        "resources": ["disaggpools/status"],
        "resourceNames": ["small"],
        "verbs": ["patch"],
    }


def test_the_rendered_router_config_carries_the_autoscaler_and_parses() -> None:
    s = spec(
        startupSeconds=90, stabilizationWindowSeconds=120, targetGoodput=0.95,
        burstWindowSeconds=180,
    )  # fmt: skip
    cm = next(o for o in render_pool(POOL, s) if o["kind"] == "ConfigMap")
    config = parse_config(yaml.safe_load(cm["data"][ROUTER_CONFIG_KEY]), "rendered")
    a = config.autoscaling
    assert a is not None
    assert (a.min_replicas, a.max_replicas, a.startup_s, a.stabilization_s) == (1, 4, 90, 120)
    assert a.burst_window_s == 180
    # ... and the router measures burstiness over that window.
    assert RoutingService(config).demand.burst_window_s == 180
    assert (a.target_goodput, a.pool_namespace, a.pool_name) == (0.95, "serving", "small")


def test_the_decode_deployment_is_rendered_at_the_applied_count() -> None:
    s = with_replicas(spec(), "decode", 3)
    decode = next(
        o
        for o in render_pool(POOL, s)
        if o["kind"] == "Deployment" and o["metadata"]["name"] == "small-decode"
    )
    assert decode["spec"]["replicas"] == 3
    assert with_replicas(s, "decode", 3) is s


SCALED_PREFILL = {"replicas": 2, "minReplicas": 1, "maxReplicas": 5}


def test_prefill_follows_its_recommendation_within_its_own_bounds() -> None:
    s = spec(SCALED_PREFILL)
    report = {**rec(3), **rec(9, "long prompts", PREFILL_RECOMMENDATION_KEY)}
    scale = pool_scale(s, report)
    assert scale.decode.replicas == 3 and scale.prefill is not None
    assert scale.prefill.replicas == 5  # prefill's bounds (1..5), not decode's (1..4)
    assert scale.prefill.reason == "long prompts (router asked 9, bounds 1..5)"
    assert pool_scale(s, rec(0, key=PREFILL_RECOMMENDATION_KEY)).prefill.replicas == 1  # type: ignore[union-attr]
    status = scale.status()
    # Decode's fields stay at the top of status.autoscaling; prefill's are beside them.
    assert (status["replicas"], status["recommendedReplicas"]) == (3, 3)
    assert status["prefill"]["replicas"] == 5 and status["prefill"]["recommendedReplicas"] == 9
    applied = scale.apply(s)
    assert (applied.prefill.replicas, applied.decode.replicas) == (5, 3)
    deployments = {
        o["metadata"]["name"]: o["spec"]["replicas"]
        for o in render_pool(POOL, applied)
        if o["kind"] == "Deployment"
    }
    assert deployments["small-prefill"] == 5 and deployments["small-decode"] == 3


def test_prefill_without_max_replicas_keeps_its_replicas() -> None:
    s = spec({"replicas": 2})
    scale = pool_scale(s, {**rec(3), **rec(9, key=PREFILL_RECOMMENDATION_KEY)})
    assert scale.prefill is None and "prefill" not in scale.status()
    assert scale.apply(s).prefill.replicas == 2
    first = pool_scale(spec(SCALED_PREFILL), rec(3)).prefill
    assert first is not None and (first.replicas, first.source) == (2, "spec")
    assert "no recommendation from the router yet: prefill.replicas" in first.reason


def test_a_bad_prefill_recommendation_keeps_the_prefill_count() -> None:
    bad = {PREFILL_RECOMMENDATION_KEY: {"replicas": -2}}
    got, error = read_recommendation(bad, "prefill")
    assert got is None and "status.router.prefillRecommendation" in error
    previous = {"replicas": 3, "source": "autoscaler", "prefill": {"replicas": 4,
                "source": "autoscaler"}}  # fmt: skip
    scale = pool_scale(spec(SCALED_PREFILL), {**rec(2), **bad}, previous)
    assert scale.prefill is not None and scale.prefill.replicas == 4
    assert scale.prefill.error == error and scale.decode.replicas == 2


@pytest.mark.parametrize(
    ("autoscaling", "prefill", "field", "message"),
    [
        (None, {"replicas": 1, "maxReplicas": 3}, "prefill.maxReplicas", "autoscaling.enabled"),
        ({"enabled": True}, {"replicas": 1, "minReplicas": 1}, "prefill.minReplicas", "both"),
        ({"enabled": True}, {"replicas": 4, "minReplicas": 1, "maxReplicas": 3}, "prefill.replicas",
         "outside"),
        ({"enabled": True}, {"replicas": 0, "maxReplicas": 0}, "autoscaling.enabled",
         "prefill.maxReplicas >= 1"),
        ({"enabled": True}, {"maxReplicas": 3, "variants": [{"name": "a"}, {"name": "b"}]},
         "autoscaling.enabled", "a single prefill variant"),
        ({"enabled": True, "minHeadroom": -0.5}, None, "autoscaling.minHeadroom", ">= 0"),
        ({"enabled": True, "minHeadroom": 11}, None, "autoscaling.minHeadroom", "at most 10"),
    ],
)  # fmt: skip
def test_bad_prefill_bounds_name_their_field(
    autoscaling: dict[str, Any] | None, prefill: dict[str, Any] | None, field: str, message: str
) -> None:
    doc = load_sample("small.yaml")["spec"]
    if autoscaling is not None:
        doc["autoscaling"] = autoscaling
    if prefill is not None:
        doc["prefill"] = prefill
    _, issues = parse_spec(doc, "img")
    messages = {i.field: i.message for i in issues}
    assert message in messages.get(field, ""), messages


def test_prefill_bounds_with_autoscaling_parse() -> None:
    s = spec(SCALED_PREFILL, minHeadroom=0.25)
    assert (s.prefill.min_replicas, s.prefill.max_replicas) == (1, 5)
    assert s.autoscaling.min_headroom == 0.25
    assert spec({"replicas": 2}).prefill.max_replicas is None  # not autoscaled


def test_the_rendered_router_config_carries_the_prefill_bounds_and_headroom() -> None:
    def rendered(s: PoolSpec) -> Any:
        cm = next(o for o in render_pool(POOL, s) if o["kind"] == "ConfigMap")
        a = parse_config(yaml.safe_load(cm["data"][ROUTER_CONFIG_KEY]), "rendered").autoscaling
        assert a is not None
        return a

    a = rendered(spec(SCALED_PREFILL, minHeadroom=0.5))
    assert a.prefill is not None and (a.prefill.min_replicas, a.prefill.max_replicas) == (1, 5)
    assert a.min_headroom == 0.5 and (a.min_replicas, a.max_replicas) == (1, 4)
    assert rendered(spec()).prefill is None  # prefill not autoscaled: no prefill recommendation
