"""Fast layer: the real operator process (`disaggpool operator`, Kopf) against kmock, every run.

kmock is a stateful in-memory Kubernetes API (watch streams, merge patches); the shim in
operator_testkit stamps uid/resourceVersion like a real server. The test plays the kubelet (pod
status) and the probe (the real `calibration.sinks.write_configmap` writes a profile ConfigMap),
and asserts on the objects the operator creates and on the status it writes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
from pathlib import Path
from typing import Any

import kmock as km
import pytest
import yaml
from operator_testkit import (
    eventually,
    load_sample,
    ready_pod_status,
    realistic_emulator_class,
    start_operator,
    stop_operator,
    write_kubeconfig,
)

from disaggpool.calibration import sinks
from disaggpool.core.hardware import builtin_profile
from disaggpool.operator.names import profile_configmap_name

POOLS = "disaggpool.io/v1alpha1/disaggpools"
RealisticEmulator = realistic_emulator_class()


def _get(kmock: Any, resource: str, ns: str, name: str) -> dict[str, Any] | None:
    try:
        obj = kmock.objects[resource, ns, name]
    except (KeyError, IndexError):
        return None
    if obj.deleted:
        return None
    raw: dict[str, Any] = obj.raw
    return raw


def _setup(kmock: Any, tmp_path: Path) -> Path:
    kmock.resources.load_bundled()
    kmock.resources[POOLS] = km.ResourceInfo(
        kind="DisaggPool",
        namespaced=True,
        verbs={"get", "list", "watch", "create", "patch", "delete"},
        subresources={"status"},
    )
    return write_kubeconfig(tmp_path, str(kmock.url))


async def _post(kmock: Any, path: str, body: dict[str, Any]) -> dict[str, Any]:
    import aiohttp

    async with (
        aiohttp.ClientSession() as s,
        s.post(str(kmock.url).rstrip("/") + path, json=body) as r,
    ):
        assert r.status < 300, await r.text()
        doc: dict[str, Any] = await r.json(content_type=None)
        return doc


async def _patch(kmock: Any, path: str, body: dict[str, Any]) -> None:
    import aiohttp

    async with (
        aiohttp.ClientSession() as s,
        s.patch(
            str(kmock.url).rstrip("/") + path,
            json=body,
            headers={"Content-Type": "application/merge-patch+json"},
        ) as r,
    ):
        assert r.status < 300, await r.text()


async def _delete(kmock: Any, path: str) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as s, s.delete(str(kmock.url).rstrip("/") + path) as r:
        assert r.status < 300, await r.text()


def _pod(name: str, pool: str, role: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "default",
            "labels": {"disaggpool.io/pool": pool, "disaggpool.io/role": role},
        },
        "spec": {"containers": [{"name": "vllm", "image": "vllm"}]},
        "status": {"phase": "Pending"},
    }


@pytest.mark.asyncio
@pytest.mark.kmock(cls=RealisticEmulator)
async def test_operator_renders_calibrates_and_reports_on_kmock(
    kmock: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kubeconfig = _setup(kmock, tmp_path)
    log = tmp_path / "operator.log"
    proc = await start_operator(kubeconfig, log)
    try:
        cr = load_sample("small.yaml")
        created = await _post(
            kmock, "/apis/disaggpool.io/v1alpha1/namespaces/default/disaggpools", cr
        )
        uid = created["metadata"]["uid"]

        async def rendered() -> bool:
            return all(
                _get(kmock, res, "default", name) is not None
                for res, name in [
                    ("apps/v1/deployments", "small-prefill"),
                    ("apps/v1/deployments", "small-decode"),
                    ("apps/v1/deployments", "small-router"),
                    ("v1/configmaps", "small-router"),
                    ("v1/services", "small-router"),
                    ("v1/services", "small-prefill"),
                    ("rbac.authorization.k8s.io/v1/roles", "small-probe"),
                ]
            )

        await eventually(rendered, "the pool's objects", log_path=log)
        decode = _get(kmock, "apps/v1/deployments", "default", "small-decode")
        assert decode is not None
        assert decode["metadata"]["ownerReferences"][0]["uid"] == uid
        container = decode["spec"]["template"]["spec"]["containers"][0]
        assert '"kv_role":"kv_consumer"' in " ".join(container["args"])
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        router_cm = _get(kmock, "v1/configmaps", "default", "small-router")
        assert router_cm is not None
        cfg = yaml.safe_load(router_cm["data"]["sidecar.yaml"])
        assert cfg["policy"] == "calibrated" and cfg["model"] == "llama-8b"
        assert [c["name"] for c in cfg["slo_classes"]] == ["chat", "code"]

        async def status() -> dict[str, Any] | None:
            obj = _get(kmock, POOLS, "default", "small")
            return (obj or {}).get("status") or None

        st = await eventually(status, "a status", log_path=log)
        assert st["prefillReplicas"] == "0/1" and st["phase"] == "Progressing"
        assert {c["type"] for c in st["conditions"]} == {"Ready", "Calibrated", "Degraded"}

        # Play the kubelet: a prefill pod appears, then turns Ready with an IP.
        pods = "/api/v1/namespaces/default/pods"
        await _post(kmock, pods, _pod("small-prefill-0", "small", "prefill"))
        await _patch(kmock, f"{pods}/small-prefill-0", {"status": ready_pod_status("198.18.0.5")})

        async def job_for_pod() -> dict[str, Any] | None:
            for key in list(kmock.objects):
                if key[0] == km.resource("batch/v1/jobs"):
                    job = kmock.objects[key]
                    if job.deleted:
                        continue
                    labels = job.raw["metadata"]["labels"]
                    if labels.get("disaggpool.io/pod") == "small-prefill-0":
                        raw: dict[str, Any] = job.raw
                        return raw
            return None

        job = await eventually(job_for_pod, "a calibration Job for the Ready pod", log_path=log)
        args = job["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--endpoint") + 1] == "http://198.18.0.5:8000"
        assert args[args.index("--configmap") + 1] == "default/small-profile-small-prefill-0"
        assert job["metadata"]["ownerReferences"][0]["uid"] == uid

        # The ConfigMap the probe writes into exists before it runs (the probe may not create
        # one): owned by the pool, not yet labelled as a profile.
        cm_name = profile_configmap_name("small", "small-prefill-0")
        placeholder = _get(kmock, "v1/configmaps", "default", cm_name)
        assert placeholder is not None and not placeholder.get("data")
        assert placeholder["metadata"]["ownerReferences"][0]["uid"] == uid
        assert "disaggpool.io/profile" not in placeholder["metadata"]["labels"]
        assert args[args.index("--configmap-owner") + 1] == f"small/{uid}"

        # Play the probe: the real ConfigMap sink writes the profile, labelled and owned as the
        # Job asks.
        labels = dict(
            kv.split("=", 1) for kv in args[args.index("--configmap-labels") + 1].split(",")
        )
        owner = sinks.pool_owner(args[args.index("--configmap-owner") + 1])
        monkeypatch.setenv("KUBERNETES_API", str(kmock.url))
        monkeypatch.setenv("KUBERNETES_TOKEN", "t")
        fitted = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        profile = dataclasses.replace(
            builtin_profile("a40-llama3-8b"), source="probe", quality="good", fitted_at=fitted
        )
        await asyncio.to_thread(
            sinks.write_configmap,
            profile,
            "default/" + profile_configmap_name("small", "small-prefill-0"),
            {"quality": profile.quality},
            labels,
            owner=owner,
        )

        async def calibrated() -> dict[str, Any] | None:
            st = await status()
            pods = (st or {}).get("pods") or []
            hit = [p for p in pods if p["name"] == "small-prefill-0"]
            return hit[0] if hit and hit[0]["calibration"] == "calibrated" else None

        entry = await eventually(calibrated, "the pod's calibration in status", log_path=log)
        assert entry["profileRef"] == "small-profile-small-prefill-0"
        assert entry["constants"]["prefill"]["p1"] == pytest.approx(profile.prefill.p1, rel=1e-5)
        assert entry["quality"] == profile.quality
        cm = _get(kmock, "v1/configmaps", "default", "small-profile-small-prefill-0")
        assert cm is not None
        assert cm["metadata"]["ownerReferences"][0]["uid"] == uid  # GC'd with the pool

        # A deleted pod's profile goes away.
        await _delete(kmock, f"{pods}/small-prefill-0")

        async def profile_gone() -> bool:
            return _get(kmock, "v1/configmaps", "default", "small-profile-small-prefill-0") is None

        await eventually(profile_gone, "the deleted pod's profile to be deleted", log_path=log)

        # An invalid edit is a condition, not a teardown.
        await _patch(
            kmock,
            "/apis/disaggpool.io/v1alpha1/namespaces/default/disaggpools/small",
            {"metadata": {"generation": 2}, "spec": {"decode": {"minReplicas": 9}}},
        )

        async def degraded() -> dict[str, Any] | None:
            st = await status()
            conds = {c["type"]: c for c in (st or {}).get("conditions") or []}
            c = conds.get("Degraded")
            return c if c and c["status"] == "True" else None

        cond = await eventually(degraded, "Degraded=True for the bad edit", log_path=log)
        assert cond["reason"] == "InvalidSpec" and "decode.minReplicas" in cond["message"]
        assert _get(kmock, "apps/v1/deployments", "default", "small-decode") is not None
        assert proc.returncode is None  # no crash loop
    finally:
        await stop_operator(proc)


@pytest.mark.asyncio
@pytest.mark.kmock(cls=RealisticEmulator)
async def test_the_running_operator_follows_the_routers_recommendation(
    kmock: Any, tmp_path: Path
) -> None:
    """The Kopf wiring: the router writing its recommendation on the pool wakes the operator,
    which scales decode within the bounds and reports it; a malformed one is reported, ignored."""
    kubeconfig = _setup(kmock, tmp_path)
    log = tmp_path / "operator.log"
    proc = await start_operator(kubeconfig, log)
    path = "/apis/disaggpool.io/v1alpha1/namespaces/default/disaggpools/small"
    try:
        cr = load_sample("small.yaml")
        cr["spec"]["decode"] = {"replicas": 1, "minReplicas": 1, "maxReplicas": 3}
        cr["spec"]["autoscaling"] = {"enabled": True}
        await _post(kmock, "/apis/disaggpool.io/v1alpha1/namespaces/default/disaggpools", cr)

        def decode_replicas() -> int | None:
            d = _get(kmock, "apps/v1/deployments", "default", "small-decode")
            return None if d is None else int(d["spec"]["replicas"])

        async def replicas_are(n: int) -> bool:
            return decode_replicas() == n

        await eventually(lambda: replicas_are(1), "decode at decode.replicas", log_path=log)
        # The router writes on the status subresource only (status.router), as pool_writer does.
        body = {"replicas": 5, "reason": "busy", "at": "2026-12-04T12:00:00+00:00"}
        report = {"status": {"router": {"decodeRecommendation": body}}}
        await _patch(kmock, path + "/status", report)
        await eventually(lambda: replicas_are(3), "decode scaled to the bound", log_path=log)

        async def autoscaling_status() -> dict[str, Any] | None:
            st = (_get(kmock, POOLS, "default", "small") or {}).get("status") or {}
            a = st.get("autoscaling") or {}
            return a if a.get("replicas") == 3 else None

        a = await eventually(autoscaling_status, "status.autoscaling", log_path=log)
        assert a["recommendedReplicas"] == 5 and "bounds 1..3" in a["reason"]
        # The operator's own status writes left the router's report as it was.
        st = (_get(kmock, POOLS, "default", "small") or {})["status"]
        assert st["router"] == {"decodeRecommendation": body}

        bad = {"replicas": "many", "reason": "?", "at": "x"}
        await _patch(kmock, path + "/status", {"status": {"router": {"decodeRecommendation": bad}}})

        async def reported() -> str | None:
            st = (_get(kmock, POOLS, "default", "small") or {}).get("status") or {}
            error: str | None = (st.get("autoscaling") or {}).get("error")
            return error

        error = await eventually(reported, "the bad recommendation", log_path=log)
        assert "non-negative integer" in error
        assert decode_replicas() == 3  # ignored: the pool keeps the count it has
        assert proc.returncode is None
    finally:
        await stop_operator(proc)
