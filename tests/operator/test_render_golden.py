"""Pure rendering and planning: golden files for the samples, and the calibration decisions.

Regenerate the goldens after an intended change, then review the diff:
``DISAGGPOOL_REGEN_GOLDEN=1 .venv/bin/pytest tests/operator/test_render_golden.py``.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from operator_testkit import MANIFESTS

from disaggpool.core.hardware import builtin_profile
from disaggpool.formats.profiles import dump_profile
from disaggpool.kubeclient.paths import matches
from disaggpool.labels import PROBE_JOB_LABELS, of_pool
from disaggpool.operator.calibration_plan import plan_calibration, render_calibration_job
from disaggpool.operator.names import PoolRef
from disaggpool.operator.observed import (
    JobView,
    PodView,
    ProfileView,
    job_view,
    observed_errors,
    pod_view,
    profile_view,
)
from disaggpool.operator.render import render_pool, render_router_config
from disaggpool.operator.spec import PoolSpec, parse_spec
from disaggpool.operator.status import compute_status
from disaggpool.sidecar.config import parse_config

GOLDEN = Path(__file__).parent / "golden"
REGEN = os.environ.get("DISAGGPOOL_REGEN_GOLDEN") == "1"
NOW = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC)


def _spec(sample: str, **overrides: Any) -> tuple[PoolRef, PoolSpec]:
    doc = yaml.safe_load((MANIFESTS / "samples" / sample).read_text())
    for path, value in overrides.items():
        node = doc["spec"]
        *parents, leaf = path.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    spec, issues = parse_spec(doc["spec"], "ghcr.io/disaggpool/disaggpool:0.1.0")
    assert spec is not None, issues
    return PoolRef(
        doc["metadata"]["name"], "serving", "11111111-2222-3333-4444-555555555555", 3
    ), spec


def _check_golden(name: str, docs: Any) -> None:
    text = (
        yaml.safe_dump_all(docs, sort_keys=False)
        if isinstance(docs, list)
        else yaml.safe_dump(docs, sort_keys=False)
    )
    path = GOLDEN / name
    if REGEN:
        path.write_text(text)
    assert path.exists(), f"no golden {name}: run with DISAGGPOOL_REGEN_GOLDEN=1"
    assert text == path.read_text(), f"{name} differs from its golden (DISAGGPOOL_REGEN_GOLDEN=1)"


@pytest.mark.parametrize("sample", ["small.yaml", "heterogeneous.yaml", "gateway.yaml"])
def test_render_pool_matches_golden(sample: str) -> None:
    pool, spec = _spec(sample)
    pods = [f"{pool.name}-prefill-a", f"{pool.name}-decode-b"]
    docs = render_pool(pool, spec, pods)
    assert render_pool(pool, spec, pods) == docs  # pure: same input, same output
    _check_golden(f"pool-{sample}", docs)


def test_the_probe_may_patch_only_its_pools_profile_configmaps_by_name() -> None:
    pool, spec = _spec("small.yaml")

    def probe_rules(pods: list[str]) -> list[dict[str, Any]]:
        (role,) = [
            o for o in render_pool(pool, spec, pods)
            if o["kind"] == "Role" and o["metadata"]["name"] == "small-probe"
        ]  # fmt: skip
        return list(role["rules"])

    assert probe_rules(["small-decode-b", "small-prefill-a"]) == [
        {
            "apiGroups": [""],
            "resources": ["configmaps"],
            "resourceNames": ["small-profile-small-decode-b", "small-profile-small-prefill-a"],
            "verbs": ["patch"],
        }
    ]
    # No pods: no rule at all. (An empty resourceNames would grant every ConfigMap.)
    assert probe_rules([]) == []


def test_a_cpu_engine_asks_for_no_gpu_and_runs_one_worker() -> None:
    pool, _ = _spec("small.yaml")
    doc = yaml.safe_load((MANIFESTS / "samples" / "small.yaml").read_text())
    doc["spec"]["prefill"]["gpus"] = 0
    doc["spec"]["decode"]["gpus"] = 0
    doc["spec"]["engine"]["resources"] = {"requests": {"cpu": "4"}}
    spec, issues = parse_spec(doc["spec"], "img")
    assert spec is not None and not issues, issues
    engines = [
        d
        for d in render_pool(pool, spec)
        if d["kind"] == "Deployment" and "disaggpool.io/role" in d["metadata"]["labels"]
    ]
    assert len(engines) == 2
    for d in engines:
        (c,) = d["spec"]["template"]["spec"]["containers"]
        assert c["resources"] == {"requests": {"cpu": "4"}}
        assert c["args"][c["args"].index("--tensor-parallel-size") + 1] == "1"
        kv = json.loads(c["args"][c["args"].index("--kv-transfer-config") + 1])
        assert kv["kv_buffer_device"] == "cpu"  # as vLLM's CPU P/D needs (docs/vllm-protocol.md)
    doc["spec"]["decode"]["gpus"] = -1
    spec, issues = parse_spec(doc["spec"], "img")
    assert spec is None and any("gpus" in str(i) for i in issues), issues


def test_calibration_job_and_status_match_golden() -> None:
    pool, spec = _spec("small.yaml")
    pods = [
        PodView("small-prefill-a", "prefill", "198.18.0.1", True),
        PodView("small-decode-b", "decode", "198.18.0.2", True),
    ]
    profile = dataclasses.replace(
        builtin_profile("a40-llama3-8b"), quality="good", fitted_at="2026-01-02T00:00:00Z"
    )
    cm = {
        "metadata": {
            "name": "small-profile-small-prefill-a",
            "labels": {"disaggpool.io/pod": "small-prefill-a"},
            "ownerReferences": [{"kind": "DisaggPool", "uid": pool.uid}],
        },
        "data": {"profile.yaml": dump_profile(profile)},
    }
    plan = plan_calibration(pool, spec, pods, [profile_view(cm, pool.uid)], [], NOW)
    states = {c.pod.name: c.state for c in plan.pods}
    assert states == {"small-prefill-a": "calibrated", "small-decode-b": "probing"}
    assert len(plan.create_jobs) == 1
    # The probe may not create ConfigMaps: the one it writes into is created beforehand, owned
    # by the pool and not yet labelled as a profile (neither the router nor the operator counts
    # it until the probe writes one).
    (placeholder,) = plan.create_configmaps
    assert placeholder["metadata"]["name"] == "small-profile-small-decode-b"
    assert placeholder["metadata"]["labels"] == {
        "disaggpool.io/pool": "small",
        "disaggpool.io/pod": "small-decode-b",
    }
    assert placeholder["metadata"]["ownerReferences"][0]["uid"] == pool.uid
    job = plan.create_jobs[0]
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--peer") + 1] == "http://198.18.0.1:8000"
    # A running probe pod must not look like an engine pod of its pool (pool + role selects
    # those): on a real node the operator once probed its own probe pods, without end.
    assert pod_view(job["spec"]["template"]) is None
    assert "disaggpool.io/role" not in job["spec"]["template"]["metadata"]["labels"]
    status = compute_status(pool, spec, [], 3, pods, plan, 1, {}, NOW)
    assert status["phase"] == "Calibrating" and status["calibratedPods"] == 1
    again = compute_status(pool, spec, [], 3, pods, plan, 1, status, NOW + dt.timedelta(hours=1))
    assert again == status  # unchanged world, identical status (lastTransitionTime kept)
    _check_golden("calibration-job.yaml", job)
    _check_golden("status.yaml", status)


def _pv(name: str, quality: str = "good", fitted: str = "2026-01-02T00:00:00Z") -> ProfileView:
    p = dataclasses.replace(builtin_profile("a40-llama3-8b"), quality=quality, fitted_at=fitted)
    return ProfileView(f"small-profile-{name}", name, p)


def test_a_probe_job_carries_the_labels_the_operator_finds_its_jobs_by() -> None:
    # Without them the operator never saw its own probe Jobs: a failed probe left its pod
    # `probing` for ever (seen on a real node, docs/test-node.md).
    from kopf._core.intents.registries import get_default_registry

    import disaggpool.operator.handlers  # noqa: F401  (registers the handlers)

    pool, spec = _spec("small.yaml")
    pods = [PodView("d", "decode", "198.18.0.2", True), PodView("p", "prefill", "198.18.0.1", True)]
    jobs = plan_calibration(pool, spec, pods, [], [], NOW).create_jobs
    assert len(jobs) == 2
    # `reconcile` lists a pool's Jobs by this selector; the Job handler filters by these labels.
    handler = next(
        h for h in get_default_registry()._watching.get_all_handlers() if h.id == "_job_event"
    )
    for job in jobs:
        assert matches(job, of_pool(pool.name, PROBE_JOB_LABELS))
        labels = job["metadata"]["labels"]
        assert handler.labels is not None
        for key, want in handler.labels.items():
            assert key in labels and (not isinstance(want, str) or labels[key] == want), key
        view = job_view(job)
        assert view is not None and view.state == "active"


def test_stale_poor_and_failed_profiles_are_reprobed_up_to_max_attempts() -> None:
    pool, spec = _spec("small.yaml", calibration__maxAgeSeconds=3600, calibration__maxAttempts=2)
    pod = PodView("d", "decode", "198.18.0.2", True)
    peer = PodView("p", "prefill", "198.18.0.1", True)
    fresh = _pv("p", fitted="2026-01-02T03:00:00Z")
    # Stale: fitted a day before NOW -> a new attempt after the last (succeeded) one.
    plan = plan_calibration(
        pool, spec, [pod, peer], [_pv("d", fitted="2026-01-01T00:00:00Z"), fresh],
        [JobView("j1", "d", 1, "succeeded")], NOW,
    )  # fmt: skip
    assert [j["metadata"]["labels"]["disaggpool.io/attempt"] for j in plan.create_jobs] == ["2"]
    # Poor with one failure: retry; with two failures in a row: give up (Degraded).
    poor = _pv("d", quality="poor")
    plan = plan_calibration(
        pool, spec, [pod, peer], [poor, fresh], [JobView("j1", "d", 1, "failed")], NOW
    )
    assert len(plan.create_jobs) == 1
    jobs = [JobView("j1", "d", 1, "failed"), JobView("j2", "d", 2, "failed")]
    plan = plan_calibration(pool, spec, [pod, peer], [poor, fresh], jobs, NOW)
    assert not plan.create_jobs and plan.pods[0].state == "failed"
    status = compute_status(pool, spec, [], 3, [pod, peer], plan, 1, {}, NOW)
    assert status["phase"] == "Degraded"
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "CalibrationFailed"
    # An active probe is waited for, not duplicated.
    plan = plan_calibration(
        pool, spec, [pod, peer], [fresh], [JobView("j3", "d", 3, "active")], NOW
    )
    assert not plan.create_jobs and plan.pods[0].state == "probing"


def test_deleted_pods_lose_their_profiles_and_jobs_and_unready_pods_wait() -> None:
    pool, spec = _spec("small.yaml")
    pending = PodView("p", "prefill", "", False)
    plan = plan_calibration(
        pool, spec, [pending], [_pv("gone"), _pv("p")], [JobView("jg", "gone", 1, "active")], NOW
    )
    assert plan.delete_configmaps == ["small-profile-gone"]
    assert plan.delete_jobs == ["jg"]
    assert not plan.create_jobs  # the surviving pod is not Ready
    # Calibration off: no Jobs at all.
    pool, spec = _spec("small.yaml", calibration__enabled=False)
    plan = plan_calibration(pool, spec, [PodView("p", "prefill", "1.2.3.4", True)], [], [], NOW)
    assert not plan.create_jobs and plan.pods[0].state == "disabled"
    assert not [o for o in render_pool(pool, spec) if o["metadata"]["name"].endswith("-probe")]


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"decode": {"replicas": 5, "maxReplicas": 2}}, "decode.replicas"),
        ({"router": {"defaultSloClass": "nope"}}, "router.defaultSloClass"),
        ({"router": {"predictor": "psychic"}}, "router.predictor"),
        ({"engine": {"image": "x", "extraArgs": ["--port=9000"]}}, "engine.extraArgs"),
        ({"prefill": {"minReplicas": 1}}, "prefill.minReplicas"),
        ({"decode": {"variants": [{"name": "a"}, {"name": "a"}]}}, "decode.variants[1].name"),
        ({"kvTransfer": {"sideChannelPort": 8000}}, "kvTransfer.sideChannelPort"),
        ({"model": {"name": ""}}, "model.name"),
        ({"router": {"policy": "cache_aware"}}, "router.policy"),
        ({"router": {"prefixIndex": "yes"}}, "router.prefixIndex"),
        ({"router": {"kvEvents": True}}, "router.kvEvents"),
        ({"router": {"policy": "length", "priorityScheduling": True}}, "router.priorityScheduling"),
        ({"engine": {"image": "x", "podSecurity": "privileged"}}, "engine.podSecurity"),
        ({"auth": {"apiKeySecret": {"key": "k"}}}, "auth.apiKeySecret.name"),
        ({"auth": {"apiKeySecret": {"name": "Bad_Name"}}}, "auth.apiKeySecret.name"),
        ({"auth": {"apiKeySecret": {"name": "s", "key": "a/b"}}}, "auth.apiKeySecret.key"),
        ({"router": {"grpc": {"tokenSecret": {}}}}, "router.grpc.tokenSecret.name"),
        ({"networkPolicy": {"clients": [{"podSelectr": {}}]}}, "networkPolicy.clients[0]"),
        (
            {
                "networkPolicy": {
                    "clients": [{"ipBlock": {"cidr": "10.0.0.0/8"}, "podSelector": {}}]
                }
            },
            "networkPolicy.clients[0]",
        ),
        ({"networkPolicy": {"enabled": "yes"}}, "networkPolicy.enabled"),
    ],
)
def test_invalid_specs_name_the_field(patch: dict[str, Any], field: str) -> None:
    doc = yaml.safe_load((MANIFESTS / "samples" / "small.yaml").read_text())["spec"]
    for key, value in patch.items():
        doc.setdefault(key, {}).update(value)
    spec, issues = parse_spec(doc, "img")
    assert spec is None
    assert field in [i.field for i in issues], issues


def test_a_job_keeps_a_poor_fit_only_when_poor_fits_are_not_reprobed() -> None:
    pod = PodView("d", "decode", "198.18.0.2", True)
    for reprobe, accepted in ((True, False), (False, True)):
        pool, spec = _spec("small.yaml", calibration__reprobeOnPoor=reprobe)
        job = render_calibration_job(pool, spec, pod, "198.18.0.1", 1)
        args = job["spec"]["template"]["spec"]["containers"][0]["args"]
        assert ("--accept-poor" in args) is accepted


def test_render_job_for_prefill_has_no_peer() -> None:
    pool, spec = _spec("heterogeneous.yaml")
    job = render_calibration_job(
        pool, spec, PodView("x", "prefill", "1.1.1.1", True, gpu_type="H100"), "2.2.2.2", 1
    )
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--peer" not in args and args[args.index("--gpu") + 1] == "H100"
    assert len(job["metadata"]["name"]) <= 63


@pytest.mark.parametrize("sample", ["small.yaml", "heterogeneous.yaml"])
def test_rendered_router_config_is_accepted_by_the_sidecar(sample: str) -> None:
    """The contract with the sidecar: its own parser reads what the operator renders."""
    pool, spec = _spec(sample)
    cfg = parse_config(yaml.safe_load(render_router_config(pool, spec)), "sidecar.yaml")
    assert cfg.policy == spec.router.policy
    assert cfg.members_kubernetes is not None and cfg.profiles_kubernetes is not None
    assert cfg.members_kubernetes.selector == f"disaggpool.io/pool={pool.name}"
    assert cfg.profiles_kubernetes.namespace == pool.namespace
    assert cfg.profiles_kubernetes.selector == (
        f"disaggpool.io/pool={pool.name},disaggpool.io/profile=true"
    )


def test_prefix_index_and_kv_events_reach_the_router_and_the_prefill_pods() -> None:
    pool, spec = _spec(
        "small.yaml", router__policy="dynamo_kv", router__prefixIndex=True, router__kvEvents=True
    )
    docs = render_pool(pool, spec)
    cm = next(o for o in docs if o["kind"] == "ConfigMap" and "sidecar.yaml" in o["data"])
    config = yaml.safe_load(cm["data"]["sidecar.yaml"])
    assert (config["policy"], config["prefix_index"]) == ("dynamo_kv", True)
    assert config["kv_events"] == {"port": 5557}
    engines = {
        d["metadata"]["labels"]["disaggpool.io/role"]: d["spec"]["template"]["spec"]["containers"][
            0
        ]
        for d in docs
        if d["kind"] == "Deployment" and "disaggpool.io/role" in d["metadata"]["labels"]
    }
    args = engines["prefill"]["args"]
    events = json.loads(args[args.index("--kv-events-config") + 1])
    assert events == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://*:5557",
    }
    assert "--kv-events-config" not in engines["decode"]["args"]


def test_priority_scheduling_reaches_the_router_and_every_vllm_pod() -> None:
    """The router's priorities are refused by vLLM under fcfs: the switch renders both."""
    for on in (False, True):
        pool, spec = _spec("small.yaml", router__priorityScheduling=on)
        docs = render_pool(pool, spec)
        cm = next(o for o in docs if o["kind"] == "ConfigMap" and "sidecar.yaml" in o["data"])
        assert yaml.safe_load(cm["data"]["sidecar.yaml"])["priority_scheduling"] is on
        engines = [
            d["spec"]["template"]["spec"]["containers"][0]["args"]
            for d in docs
            if d["kind"] == "Deployment" and "disaggpool.io/role" in d["metadata"]["labels"]
        ]
        assert len(engines) >= 2
        for args in engines:
            has = "--scheduling-policy" in args
            assert has is on and (
                not on or args[args.index("--scheduling-policy") + 1] == "priority"
            )


def test_a_pod_whose_current_profile_drifts_is_reprobed_and_an_old_error_is_ignored() -> None:
    pool, spec = _spec("small.yaml", calibration__maxPredictionError=0.3)
    pod = PodView("d", "decode", "198.18.0.2", True)
    peer = PodView("p", "prefill", "198.18.0.1", True)
    cm = {
        "metadata": {"name": "small-profile-d", "labels": {"disaggpool.io/pod": "d"},
                     "ownerReferences": [{"kind": "DisaggPool", "uid": pool.uid}]},
        "data": {"profile.yaml": dump_profile(_pv("d").profile)},  # type: ignore[arg-type]
    }  # fmt: skip
    fitted = "2026-01-02T00:00:00Z"

    def plan_with(*errors: dict[str, object]) -> Any:
        report = {"observedErrors": {"pods": list(errors), "at": "x"}}  # status.router
        views = [profile_view(cm, pool.uid, observed_errors(report)), _pv("p")]
        return plan_calibration(pool, spec, [pod, peer], views, [], NOW)

    drifting = plan_with({"pod": "d", "error": 0.45, "profile": fitted})
    assert [c.reason for c in drifting.pods if c.pod.name == "d"] == ["drift"]
    assert len(drifting.create_jobs) == 1
    assert not drifting.create_configmaps  # re-probed into its own ConfigMap
    # Within the bound, about a profile the pod no longer has, or unreadable: nothing to do.
    for errors in (
        {"pod": "d", "error": 0.2, "profile": fitted},
        {"pod": "d", "error": 0.9, "profile": "2025-12-31T00:00:00Z"},
        {"pod": "d", "error": "high", "profile": fitted},
        {"pod": "d", "error": float("nan"), "profile": fitted},
        {"error": 0.9, "profile": fitted},
    ):
        assert not plan_with(errors).create_jobs, errors
    assert observed_errors({"observedErrors": "{oops"}) == {}
    assert observed_errors({"observedErrors": {"pods": {"d": {"error": 0.9}}}}) == {}


def test_a_profile_not_owned_by_this_pool_does_not_count() -> None:
    """Labels are not enough: a ConfigMap without an owner reference to this very pool (another
    pool's uid, none at all) is ignored, and the pod is probed as if it had none."""
    pool, spec = _spec("small.yaml")
    pod = PodView("p", "prefill", "198.18.0.1", True)
    text = dump_profile(_pv("p").profile)  # type: ignore[arg-type]

    def cm(owners: list[dict[str, str]]) -> dict[str, Any]:
        md = {"name": "small-profile-p", "labels": {"disaggpool.io/pod": "p"}}
        return {"metadata": md | {"ownerReferences": owners}, "data": {"profile.yaml": text}}

    for owners in (
        [],
        [{"kind": "DisaggPool", "uid": "another"}],
        [{"kind": "Job", "uid": pool.uid}],
    ):
        view = profile_view(cm(owners), pool.uid)
        assert not view.owned
        plan = plan_calibration(pool, spec, [pod], [view], [], NOW)
        assert plan.pods[0].state == "probing" and len(plan.create_jobs) == 1
        assert not plan.delete_configmaps  # not ours to delete either
    ours = profile_view(cm([{"kind": "DisaggPool", "uid": pool.uid}]), pool.uid)
    plan = plan_calibration(pool, spec, [pod], [ours], [], NOW)
    assert plan.pods[0].state == "calibrated" and not plan.create_jobs


def test_placeholders_are_created_once_and_deleted_with_their_pod() -> None:
    pool, spec = _spec("small.yaml")
    pod = PodView("p", "prefill", "198.18.0.1", True)
    first = plan_calibration(pool, spec, [pod], [], [], NOW)
    assert [c["metadata"]["name"] for c in first.create_configmaps] == ["small-profile-p"]
    # The failed probe's retry writes into the same, still empty ConfigMap: not created again.
    failed = [JobView("j1", "p", 1, "failed")]
    again = plan_calibration(pool, spec, [pod], [], failed, NOW, [("small-profile-p", "p")])
    assert len(again.create_jobs) == 1 and not again.create_configmaps
    gone = plan_calibration(pool, spec, [], [], [], NOW, [("small-profile-p", "p")])
    assert gone.delete_configmaps == ["small-profile-p"]


def _objects(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def test_the_pools_api_key_reaches_engines_router_and_probe() -> None:
    pool, spec = _spec("small.yaml", auth__apiKeySecret={"name": "pool-key"})
    docs = render_pool(pool, spec, ["small-decode-b"])
    deployments = _objects(docs, "Deployment")
    secret_ref = {"secretKeyRef": {"name": "pool-key", "key": "api-key"}}
    for name in ("small-prefill", "small-decode"):  # vLLM reads --api-key from VLLM_API_KEY
        env = deployments[name]["spec"]["template"]["spec"]["containers"][0]["env"]
        assert {"name": "VLLM_API_KEY", "valueFrom": secret_ref} in env
    router = deployments["small-router"]["spec"]["template"]["spec"]
    assert {
        "name": "api-key",
        "secret": {"secretName": "pool-key", "items": [{"key": "api-key", "path": "api-key"}]},
    } in router["volumes"]
    mounts = {m["name"]: m for m in router["containers"][0]["volumeMounts"]}
    assert mounts["api-key"] == {
        "name": "api-key", "mountPath": "/var/run/disaggpool/api-key", "readOnly": True,
    }  # fmt: skip
    assert "subPath" not in mounts["api-key"]  # a whole volume: the kubelet updates rotations
    config = yaml.safe_load(render_router_config(pool, spec))
    key_file = "/var/run/disaggpool/api-key/api-key"
    assert config["auth"] == {"api_keys_file": key_file, "upstream_api_key_file": key_file}
    pod = PodView("small-decode-b", "decode", "198.18.0.2", True)
    job = render_calibration_job(pool, spec, pod, "198.18.0.1", 1)
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["env"] == [{"name": "DISAGGPOOL_API_KEY", "valueFrom": secret_ref}]
    # Without the field: none of it.
    pool, plain = _spec("small.yaml")
    text = json.dumps(
        [*render_pool(pool, plain), render_calibration_job(pool, plain, pod, None, 1)]
    )
    assert "VLLM_API_KEY" not in text and "DISAGGPOOL_API_KEY" not in text
    assert "auth" not in yaml.safe_load(render_router_config(pool, plain))


def test_grpc_listens_beyond_loopback_only_with_a_token() -> None:
    for token in (None, {"name": "grpc", "key": "t"}):
        overrides = {"router__grpc": {"tokenSecret": token}} if token else {}
        pool, spec = _spec("small.yaml", **overrides)
        docs = render_pool(pool, spec)
        config = yaml.safe_load(render_router_config(pool, spec))
        service = _objects(docs, "Service")["small-router"]
        router = _objects(docs, "Deployment")["small-router"]["spec"]["template"]["spec"]
        ports = {p["name"] for p in router["containers"][0]["ports"]}
        exposed = {p["name"] for p in service["spec"]["ports"]}
        if token is None:
            assert config["listen"]["grpc"] == "127.0.0.1:50051" and "grpc" not in config
            assert "grpc" not in ports and exposed == {"http"}
        else:
            assert config["listen"]["grpc"] == "0.0.0.0:50051"
            assert config["grpc"] == {"token_file": "/var/run/disaggpool/grpc-token/token"}
            assert "grpc" in ports and exposed == {"http", "grpc"}
            volume = next(v for v in router["volumes"] if v["name"] == "grpc-token")
            assert volume["secret"] == {
                "secretName": "grpc", "items": [{"key": "t", "path": "token"}],
            }  # fmt: skip


@pytest.mark.parametrize(
    ("secret", "file", "key"),
    [("tokenSecret", "token", "token"), ("credentialsSecret", "nats.creds", "credentials_file")],
)
def test_shared_books_reach_every_router_replica_with_their_secret(
    secret: str, file: str, key: str
) -> None:
    """`router.sharedBooks`: the bus's URL and its Secret mounted as a file, in the sidecar's own
    words (and parsed by it); each replica names itself (no per-replica config)."""
    books = {"natsUrl": "nats://nats.infra:4222", secret: {"name": "nats-auth"}}
    pool, spec = _spec("small.yaml", router__replicas=3, router__sharedBooks=books)
    config = yaml.safe_load(render_router_config(pool, spec))
    path = f"/var/run/disaggpool/nats/{file}"
    option = "token_file" if key == "token" else key
    assert config["shared_books"] == {"nats_url": "nats://nats.infra:4222", option: path}
    parsed = parse_config(config, "sidecar.yaml")
    assert parsed.shared_books is not None and parsed.shared_books.replica_id == ""
    router = _objects(render_pool(pool, spec), "Deployment")["small-router"]["spec"]
    assert router["replicas"] == 3
    pod = router["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "nats-auth")
    assert volume["secret"]["items"][0]["path"] == file
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "nats-auth")
    assert mount["mountPath"] + "/" + file == path
    # Without the field: none of it.
    pool, plain = _spec("small.yaml", router__replicas=3)
    assert "shared_books" not in yaml.safe_load(render_router_config(pool, plain))
    assert "nats" not in json.dumps(render_pool(pool, plain))


@pytest.mark.parametrize(
    ("books", "field"),
    [
        ({"natsUrl": "nats://nats.infra:4222"}, "tokenSecret"),
        ({"natsUrl": "http://nats.infra:4222", "tokenSecret": {"name": "n"}}, "natsUrl"),
        ({"natsUrl": "nats://u:p@nats.infra:4222", "tokenSecret": {"name": "n"}}, "natsUrl"),
        ({"tokenSecret": {"name": "n"}}, "natsUrl"),
        (
            {
                "natsUrl": "nats://nats.infra:4222",
                "tokenSecret": {"name": "n"},
                "credentialsSecret": {"name": "c"},
            },
            "tokenSecret",
        ),
    ],
)
def test_shared_books_without_a_usable_bus_name_the_field(books: Any, field: str) -> None:
    doc = yaml.safe_load((MANIFESTS / "samples" / "small.yaml").read_text())["spec"]
    doc["router"]["sharedBooks"] = books
    spec, issues = parse_spec(doc, "img")
    assert spec is None
    assert [i.field for i in issues] == [f"router.sharedBooks.{field}"], issues


def test_the_drift_bound_reaches_the_router() -> None:
    pool, spec = _spec("small.yaml", calibration__maxPredictionError=0.25)
    config = yaml.safe_load(render_router_config(pool, spec))
    assert config["drift"] == {"pool": {"namespace": "serving", "name": "small"}, "max_error": 0.25}
    assert config["profiles"]["kubernetes"]["owner"] == "small"


def test_the_full_security_config_is_accepted_by_the_sidecar() -> None:
    """Auth, a gRPC token, drift and the owner filter, through the sidecar's own parser."""
    pool, spec = _spec(
        "small.yaml",
        auth__apiKeySecret={"name": "k"},
        router__grpc={"tokenSecret": {"name": "g"}},
        calibration__maxPredictionError=0.3,
    )
    cfg = parse_config(yaml.safe_load(render_router_config(pool, spec)), "sidecar.yaml")
    assert cfg.profiles_kubernetes is not None and cfg.profiles_kubernetes.owner == "small"
    assert cfg.drift is not None and cfg.drift.pool_name == "small"


def test_network_policies_select_the_pods_they_mean() -> None:
    pool, spec = _spec("small.yaml")
    assert not _objects(render_pool(pool, spec), "NetworkPolicy")  # optional, off by default
    clients = [{"namespaceSelector": {"matchLabels": {"team": "web"}}}]
    pool, spec = _spec(
        "small.yaml",
        networkPolicy={"enabled": True, "clients": clients},
        router__prefixIndex=True,
        router__kvEvents=True,
    )
    docs = render_pool(pool, spec)
    policies = _objects(docs, "NetworkPolicy")
    assert sorted(policies) == ["small-engines", "small-probe", "small-router"]
    pod_labels = {
        name: d["spec"]["template"]["metadata"]["labels"]
        for name, d in _objects(docs, "Deployment").items()
    }
    job = render_calibration_job(pool, spec, PodView("p", "prefill", "1.1.1.1", True), None, 1)
    pod_labels["probe"] = job["spec"]["template"]["metadata"]["labels"]

    def selected(selector: dict[str, Any]) -> set[str]:
        return {
            n
            for n, labels in pod_labels.items()
            if matches({"metadata": {"labels": labels}}, selector["matchLabels"])
        }

    engines = policies["small-engines"]["spec"]
    assert selected(engines["podSelector"]) == {"small-prefill", "small-decode"}
    router_rule, probe_rule, peer_rule = engines["ingress"]
    assert selected(router_rule["from"][0]["podSelector"]) == {"small-router"}
    assert router_rule["ports"] == [
        {"protocol": "TCP", "port": 8000},
        {"protocol": "TCP", "port": 5557},
    ]
    assert selected(probe_rule["from"][0]["podSelector"]) == {"probe"}
    assert probe_rule["ports"] == [{"protocol": "TCP", "port": 8000}]
    # Engines reach each other on every port: NIXL's side channel and the KV transfer itself.
    assert selected(peer_rule["from"][0]["podSelector"]) == {"small-prefill", "small-decode"}
    assert "ports" not in peer_rule
    router = policies["small-router"]["spec"]
    assert selected(router["podSelector"]) == {"small-router"}
    assert router["ingress"] == [{"from": clients, "ports": [{"protocol": "TCP", "port": 8000}]}]
    probe = policies["small-probe"]["spec"]
    assert selected(probe["podSelector"]) == {"probe"} and probe["ingress"] == []
    for policy in policies.values():
        assert policy["spec"]["policyTypes"] == ["Ingress"]  # egress stays open
    # No clients named: the pool's own namespace.
    pool, spec = _spec("small.yaml", networkPolicy={"enabled": True})
    (rule,) = _objects(render_pool(pool, spec), "NetworkPolicy")["small-router"]["spec"]["ingress"]
    assert rule["from"] == [{"podSelector": {}}]


def test_restricted_engines_get_a_writable_home_and_tmp() -> None:
    pool, spec = _spec("small.yaml", engine__podSecurity="restricted")
    decode = _objects(render_pool(pool, spec), "Deployment")["small-decode"]
    pod = decode["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert (env["HOME"], env["USER"]) == ("/home/vllm", "vllm")
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["home"] == {"name": "home", "emptyDir": {}}
    assert volumes["tmp"] == {"name": "tmp", "emptyDir": {}}
