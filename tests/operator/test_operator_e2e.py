"""E2E layer: manifests, the operator and Helm against a real kube-apiserver 1.20.2.

Skips when scripts/k8s_env.sh has not built the binaries, and fails instead under
DISAGGPOOL_REQUIRE_K8S=1 (k8s_cluster.require_k8s); .ci/run builds them, so CI runs this. The
operator runs as a real process with its own service account's token, so the RBAC in manifests/
is exercised; the probe is played with the real ConfigMap sink and the probe's own
token (its Role is exercised too). There is no kubelet: the test patches pod status to Ready.

How the operator acts on what routers and probes report (decode autoscaling, re-probing a drifting
pod, failed probe Jobs) is in test_operator_e2e_feedback.py, against its own apiserver.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import functools
import json
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from k8s_cluster import Cluster, require_k8s, running_cluster
from operator_e2e_kit import kubectl_json, list_pods, play_kubelet
from operator_testkit import (
    CHART,
    CRD_PATH,
    MANIFESTS,
    TOKEN,
    eventually,
    load_sample,
    start_operator,
    stop_operator,
)

from disaggpool.calibration import sinks
from disaggpool.core.hardware import builtin_profile
from disaggpool.kubeclient import ApiError, Kube
from disaggpool.operator.reconcile import reconcile


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    require_k8s()
    with running_cluster(tmp_path_factory.mktemp("cluster"), [CRD_PATH]) as c:
        c.kubectl("apply", "-f", str(MANIFESTS))  # the documented install path
        yield c


def _raw_post(cluster: Cluster, path: str, body: dict[str, Any]) -> tuple[int, str]:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    req = urllib.request.Request(
        cluster.server + path,
        json.dumps(body).encode(),
        {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=10) as resp:
            return int(resp.status), resp.read().decode()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode()


def test_manifests_install_and_the_crd_rejects_bad_pools(cluster: Cluster) -> None:
    crd = kubectl_json(cluster, "crd", "disaggpools.disaggpool.io")
    assert crd["spec"]["names"]["shortNames"] == ["dpool"]
    dep = kubectl_json(cluster, "deployment", "-n", "disaggpool-system", "disaggpool-operator")
    sc = dep["spec"]["template"]["spec"]["containers"][0]["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    # Samples pass the server's schema validation (dry run: nothing is created).
    out = cluster.kubectl("apply", "--dry-run=server", "-f", str(MANIFESTS / "samples"))
    assert "small" in out and "hetero" in out

    bad = load_sample("small.yaml")
    bad["metadata"]["name"] = "bad"
    bad["spec"]["decode"]["replicas"] = -1
    del bad["spec"]["engine"]["image"]
    status, body = _raw_post(
        cluster, "/apis/disaggpool.io/v1alpha1/namespaces/default/disaggpools", bad
    )
    assert status == 422, body
    assert "spec.decode.replicas" in body and "spec.engine.image" in body
    bad["spec"]["engine"]["image"] = "x"
    bad["spec"]["decode"]["replicas"] = 1
    bad["spec"]["router"]["policy"] = "fastest"
    status, body = _raw_post(
        cluster, "/apis/disaggpool.io/v1alpha1/namespaces/default/disaggpools", bad
    )
    assert status == 422 and "spec.router.policy" in body, body


@pytest.mark.asyncio
async def test_operator_reconciles_calibrates_and_cleans_up(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    token = cluster.sa_token("disaggpool-system", "disaggpool-operator")
    kubeconfig = cluster.kubeconfig_for(tmp_path / "operator", token)
    log = tmp_path / "operator.log"
    proc = await start_operator(kubeconfig, log)
    ns = "default"
    try:
        cluster.kubectl("apply", "-f", str(MANIFESTS / "samples" / "small.yaml"))
        uid = kubectl_json(cluster, "dpool", "small", "-n", ns)["metadata"]["uid"]

        async def pods_of(role: str, n: int) -> list[dict[str, Any]] | None:
            pods = list_pods(cluster, ns, f"disaggpool.io/pool=small,disaggpool.io/role={role}")
            return pods if len(pods) >= n else None

        # The controller manager turns the operator's Deployments into Pods (Pending: no kubelet).
        prefill = (await eventually(lambda: pods_of("prefill", 1), "prefill pods", 60, 0.5, log))[0]
        decode = (await eventually(lambda: pods_of("decode", 1), "decode pods", 60, 0.5, log))[0]
        deployment = kubectl_json(cluster, "deployment", "small-decode", "-n", ns)
        assert deployment["metadata"]["ownerReferences"][0]["uid"] == uid
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        env = {e["name"]: e for e in container["env"]}
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == (
            "status.podIP"
        )
        assert container["startupProbe"]["httpGet"]["path"] == "/health"

        play_kubelet(cluster, ns, prefill["metadata"]["name"], "198.18.0.11")
        play_kubelet(cluster, ns, decode["metadata"]["name"], "198.18.0.12")

        async def jobs() -> list[dict[str, Any]] | None:
            items: list[dict[str, Any]] = kubectl_json(
                cluster, "jobs", "-n", ns, "-l", "disaggpool.io/pool=small"
            )["items"]
            return items if len(items) >= 2 else None

        found = await eventually(jobs, "calibration Jobs for both Ready pods", 60, 0.5, log)
        by_pod = {j["metadata"]["labels"]["disaggpool.io/pod"]: j for j in found}
        decode_args = by_pod[decode["metadata"]["name"]]["spec"]["template"]["spec"]["containers"][
            0
        ]["args"]
        assert decode_args[decode_args.index("--peer") + 1] == "http://198.18.0.11:8000"

        # The probe's Role: patch the profile ConfigMaps of the pool's pods, by name, nothing
        # else; the operator created each before its probe (the probe may not create one).
        role = kubectl_json(cluster, "role", "small-probe", "-n", ns)
        (rule,) = role["rules"]
        assert rule["verbs"] == ["patch"] and rule["resources"] == ["configmaps"]
        assert sorted(rule["resourceNames"]) == sorted(
            f"small-profile-{p}" for p in (prefill["metadata"]["name"], decode["metadata"]["name"])
        )
        router_rules = kubectl_json(cluster, "role", "small-router", "-n", ns)["rules"]
        assert router_rules == [
            {"apiGroups": [""], "resources": ["pods", "configmaps"], "verbs": ["list", "watch"]}
        ]  # no writes at all: this pool neither autoscales nor watches drift

        # Play the probe Job with the probe's own service account (its Role is exercised).
        probe_token = cluster.sa_token(ns, "small-probe")
        monkeypatch.setenv("KUBERNETES_API", cluster.server)
        monkeypatch.setenv("KUBERNETES_TOKEN", probe_token)
        monkeypatch.setenv("KUBERNETES_INSECURE", "1")
        probe_kube = Kube.from_environment()
        try:
            for verb, call in (
                ("create", probe_kube.create(
                    "/api/v1/namespaces/default/configmaps",
                    {"metadata": {"name": "small-profile-forged"}, "data": {}},
                )),
                ("patch another", probe_kube.merge_patch(
                    "/api/v1/namespaces/default/configmaps/small-router", {"data": {}}
                )),
                ("list", probe_kube.list("/api/v1/namespaces/default/configmaps", {})),
            ):  # fmt: skip
                with pytest.raises(ApiError) as refused:
                    await call
                assert refused.value.status == 403, verb
        finally:
            await probe_kube.close()
        fitted = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        for pod_name, job in by_pod.items():
            args = job["spec"]["template"]["spec"]["containers"][0]["args"]
            labels = dict(
                kv.split("=", 1) for kv in args[args.index("--configmap-labels") + 1].split(",")
            )
            owner = sinks.pool_owner(args[args.index("--configmap-owner") + 1])
            assert owner is not None and owner["uid"] == uid
            profile = dataclasses.replace(
                builtin_profile("a40-llama3-8b"),
                name=pod_name,
                source="probe",
                quality="good",
                fitted_at=fitted,
            )
            await asyncio.to_thread(
                functools.partial(
                    sinks.write_configmap,
                    profile,
                    args[args.index("--configmap") + 1],
                    {"quality": "good"},
                    labels,
                    owner=owner,
                )
            )
        for router_pod in list_pods(cluster, ns, "disaggpool.io/component=router"):
            play_kubelet(cluster, ns, router_pod["metadata"]["name"], "198.18.0.20")

        async def ready() -> dict[str, Any] | None:
            st: dict[str, Any] = (
                kubectl_json(cluster, "dpool", "small", "-n", ns).get("status") or {}
            )
            return st if st.get("phase") == "Ready" else None

        st = await eventually(ready, "phase Ready", 60, 0.5, log)
        assert st["calibratedPods"] == 2 and st["prefillReplicas"] == "1/1"
        conds = {c["type"]: c["status"] for c in st["conditions"]}
        assert conds == {"Ready": "True", "Calibrated": "True", "Degraded": "False"}
        table = cluster.kubectl("get", "dpool", "-n", ns)
        (tmp_path / "kubectl-get-dpool.txt").write_text(table)  # quoted in docs/install.md
        print(table)
        assert table.split()[:7] == [
            "NAME",
            "PREFILL",
            "DECODE",
            "CALIBRATED",
            "POLICY",
            "PHASE",
            "AGE",
        ]
        assert table.splitlines()[1].split()[:6] == [
            "small",
            "1/1",
            "1/1",
            "2",
            "calibrated",
            "Ready",
        ]
        events = cluster.kubectl(
            "get", "events", "-n", ns, "--field-selector", "involvedObject.name=small"
        )
        assert "Calibrated" in events and "CalibrationStarted" in events and "Created" in events

        # A bad edit (passes the schema, fails the operator's rules) is flagged, not applied.
        cluster.kubectl(
            "patch", "dpool", "small", "-n", ns, "--type=merge",
            "-p", json.dumps({"spec": {"decode": {"minReplicas": 9}}}),
        )  # fmt: skip

        async def degraded() -> dict[str, Any] | None:
            st = kubectl_json(cluster, "dpool", "small", "-n", ns).get("status") or {}
            c = {c["type"]: c for c in st.get("conditions") or []}.get("Degraded") or {}
            return c if c.get("status") == "True" else None

        cond = await eventually(degraded, "Degraded=True", 30, 0.5, log)
        assert cond["reason"] == "InvalidSpec" and "decode.minReplicas" in cond["message"]
        assert (
            kubectl_json(cluster, "deployment", "small-decode", "-n", ns)["spec"]["replicas"] == 1
        )
        assert proc.returncode is None

        # Deleting the pool garbage-collects everything it owns (profiles and Jobs included).
        t0 = time.monotonic()
        cluster.kubectl("delete", "dpool", "small", "-n", ns, "--wait=true")

        async def collected() -> bool:
            left = cluster.kubectl(
                "get", "deployments,services,configmaps,jobs,roles,rolebindings,serviceaccounts",
                "-n", ns, "-l", "disaggpool.io/pool=small", "-o", "name",
            )  # fmt: skip
            return not left.strip()

        await eventually(collected, "garbage collection of the pool's objects", 90, 0.5, log)
        print(f"garbage collected in {time.monotonic() - t0:.1f} s")
    finally:
        await stop_operator(proc)


@pytest.mark.asyncio
async def test_reconcile_twice_changes_nothing_on_a_real_apiserver(cluster: Cluster) -> None:
    """Idempotency, measured where it matters: a second pass writes nothing at all."""
    cluster.kubectl("create", "namespace", "idem")
    cr = load_sample("heterogeneous.yaml")
    cr["metadata"]["namespace"] = "idem"
    cluster.kubectl("apply", "-f", "-", stdin=json.dumps(cr))
    kube = Kube.from_environment(str(cluster.kubeconfig))
    try:
        first = await reconcile(kube, "idem", "hetero", default_image="disaggpool:test")
        assert first.created and first.status_written

        # The controller manager creates the pods (2 prefill, 2+2 decode, 2 router); once the
        # world stops changing, one pass catches up and the next one must write nothing.
        async def all_pods() -> bool:
            return len(list_pods(cluster, "idem", "disaggpool.io/pool=hetero")) == 8

        await eventually(all_pods, "the controller manager's pods", 60, 0.5)
        await reconcile(kube, "idem", "hetero", default_image="disaggpool:test")
        second = await reconcile(kube, "idem", "hetero", default_image="disaggpool:test")
        assert not second.changed, second
        # An update rolls out as a patch of exactly the changed object.
        cluster.kubectl(
            "patch", "dpool", "hetero", "-n", "idem", "--type=merge",
            "-p", json.dumps({"spec": {"router": {"policy": "p2c"}}}),
        )  # fmt: skip
        third = await reconcile(kube, "idem", "hetero", default_image="disaggpool:test")
        assert sorted(third.updated) == ["ConfigMap hetero-router", "Deployment hetero-router"]
        assert not third.created and not third.deleted
    finally:
        await kube.close()
        cluster.kubectl("delete", "namespace", "idem", "--wait=false")


def test_helm_install_upgrade_uninstall(cluster: Cluster, tmp_path: Path) -> None:
    ns = "helm-test"
    cluster.kubectl("create", "namespace", ns)
    cluster.helm(
        "install", "dp", str(CHART), "-n", ns,
        "--wait=false",
    )  # fmt: skip
    dep = kubectl_json(cluster, "deployment", "-n", ns, "dp-disaggpool-operator")
    assert dep["spec"]["template"]["spec"]["serviceAccountName"] == "dp-disaggpool-operator"
    cluster.helm(
        "upgrade", "dp", str(CHART), "-n", ns,
        "--set", "operator.resyncSeconds=30",
    )  # fmt: skip
    dep = kubectl_json(cluster, "deployment", "-n", ns, "dp-disaggpool-operator")
    env = {
        e["name"]: e.get("value") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["DISAGGPOOL_RESYNC_SECONDS"] == "30"
    assert "dp" in cluster.helm("list", "-n", ns)
    cluster.helm("uninstall", "dp", "-n", ns)
    left = cluster.kubectl("get", "deployments,serviceaccounts", "-n", ns, "-o", "name")
    assert "dp-disaggpool-operator" not in left
    # The CRD stays (Helm never deletes CRDs from crds/): pools survive an uninstall.
    assert kubectl_json(cluster, "crd", "disaggpools.disaggpool.io")["metadata"]["name"]


@pytest.mark.asyncio
async def test_an_operator_watching_namespaces_needs_only_roles_there(
    cluster: Cluster, tmp_path: Path
) -> None:
    """`operator.watchNamespaces`: the chart grants a Role and RoleBinding in each watched
    namespace and nothing cluster-wide; the operator, with its own token and `--namespace`,
    renders and reports a pool there and leaves other namespaces alone."""
    ns, other, home = "watched", "unwatched", "dp-ns"
    for n in (ns, other, home):
        cluster.kubectl("create", "namespace", n)
    cluster.helm(
        "install", "nsop", str(CHART), "-n", home, "--wait=false",
        "--set", f"operator.watchNamespaces={{{ns}}}",
    )  # fmt: skip
    try:
        release = "app.kubernetes.io/instance=nsop"
        roles = kubectl_json(cluster, "roles,rolebindings", "-n", ns, "-l", release)
        assert sorted(r["kind"] for r in roles["items"]) == ["Role", "RoleBinding"]
        cluster_wide = kubectl_json(cluster, "clusterroles,clusterrolebindings", "-l", release)
        assert cluster_wide["items"] == []
        token = cluster.sa_token(home, "nsop-disaggpool-operator")
        log = tmp_path / "operator.log"
        proc = await start_operator(
            cluster.kubeconfig_for(tmp_path / "operator", token), log, args=("--namespace", ns)
        )
        try:
            for n in (ns, other):
                cr = load_sample("small.yaml")
                cr["metadata"]["namespace"] = n
                cluster.kubectl("apply", "-f", "-", stdin=json.dumps(cr))

            async def reported() -> dict[str, Any] | None:
                st: dict[str, Any] = (
                    kubectl_json(cluster, "dpool", "small", "-n", ns).get("status") or {}
                )
                return st if st.get("phase") else None

            st = await eventually(reported, "the watched pool's status", 60, 0.5, log)
            assert st["phase"] == "Progressing"
            assert kubectl_json(cluster, "deployment", "small-router", "-n", ns)["metadata"]["name"]
            await asyncio.sleep(6)  # a resync period (5 s in these tests) and more
            assert kubectl_json(cluster, "dpool", "small", "-n", other).get("status") is None
            assert not kubectl_json(cluster, "deployments", "-n", other)["items"]
            text = log.read_text(errors="replace")
            assert "403" not in text and "Forbidden" not in text, text[-3000:]
            assert proc.returncode is None
        finally:
            await stop_operator(proc)
    finally:
        cluster.helm("uninstall", "nsop", "-n", home)
        for n in (ns, other, home):
            cluster.kubectl("delete", "namespace", n, "--wait=false")
