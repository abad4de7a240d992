"""Decode autoscaling in the operator's pure half: the spec, the recommendation, the rendering."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from operator_testkit import load_sample

from disaggpool.labels import DECODE_RECOMMENDATION_KEY
from disaggpool.operator.names import PoolRef
from disaggpool.operator.render import ROUTER_CONFIG_KEY, render_pool
from disaggpool.operator.scaling import decode_scale, read_recommendation, with_decode_replicas
from disaggpool.operator.spec import PoolSpec, parse_spec
from disaggpool.sidecar.config import parse_config
from disaggpool.sidecar.service import RoutingService

POOL = PoolRef("small", "serving", "uid-1", 1)


def spec(**autoscaling: Any) -> PoolSpec:
    doc = load_sample("small.yaml")["spec"]
    doc["decode"] = {"replicas": 2, "minReplicas": 1, "maxReplicas": 4}
    doc["autoscaling"] = {"enabled": True, **autoscaling}
    parsed, issues = parse_spec(doc, "img")
    assert parsed is not None, issues
    return parsed


def rec(replicas: object, reason: str = "busy") -> dict[str, Any]:
    """The router's report (`status.router`) with a recommendation."""
    body = {"replicas": replicas, "reason": reason, "at": "2026-12-04T12:00:00+00:00"}
    return {DECODE_RECOMMENDATION_KEY: body}


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
    s = with_decode_replicas(spec(), 3)
    decode = next(
        o
        for o in render_pool(POOL, s)
        if o["kind"] == "Deployment" and o["metadata"]["name"] == "small-decode"
    )
    assert decode["spec"]["replicas"] == 3
    assert with_decode_replicas(s, 3) is s
