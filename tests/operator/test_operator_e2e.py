"""E2E layer: manifests, the operator and Helm against a real kube-apiserver 1.20.2.

Skips when scripts/k8s_env.sh has not built the binaries, and fails instead under
DISAGGPOOL_REQUIRE_K8S=1 (k8s_cluster.require_k8s); .ci/run builds them, so CI runs this. The
operator runs as a real process with its own service account's token, so the RBAC in manifests/
is exercised; the probe is played with the real ConfigMap sink and the probe's own
token (its Role is exercised too). There is no kubelet: the test patches pod status to Ready.
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
import yaml
from k8s_cluster import Cluster, require_k8s, running_cluster
from operator_testkit import (
    CHART,
    CRD_PATH,
    MANIFESTS,
    TOKEN,
    eventually,
    load_sample,
    ready_pod_status,
    start_operator,
    stop_operator,
)

from disaggpool.calibration import sinks
from disaggpool.core.hardware import builtin_profile
from disaggpool.formats.profiles import dump_profile
from disaggpool.kubeclient import ApiError, Kube
from disaggpool.operator.reconcile import reconcile


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    require_k8s()
    with running_cluster(tmp_path_factory.mktemp("cluster"), [CRD_PATH]) as c:
        c.kubectl("apply", "-f", str(MANIFESTS))  # the documented install path
        yield c


def _json(cluster: Cluster, *args: str) -> Any:
    return json.loads(cluster.kubectl("get", *args, "-o", "json"))


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
    crd = _json(cluster, "crd", "disaggpools.disaggpool.io")
    assert crd["spec"]["names"]["shortNames"] == ["dpool"]
    dep = _json(cluster, "deployment", "-n", "disaggpool-system", "disaggpool-operator")
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


def _pods(cluster: Cluster, ns: str, selector: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = _json(cluster, "pods", "-n", ns, "-l", selector)["items"]
    return items


def _play_kubelet(cluster: Cluster, ns: str, pod: str, ip: str) -> None:
    cluster.kubectl(
        "patch",
        "pod",
        pod,
        "-n",
        ns,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps({"status": ready_pod_status(ip)}),
    )


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
        uid = _json(cluster, "dpool", "small", "-n", ns)["metadata"]["uid"]

        async def pods_of(role: str, n: int) -> list[dict[str, Any]] | None:
            pods = _pods(cluster, ns, f"disaggpool.io/pool=small,disaggpool.io/role={role}")
            return pods if len(pods) >= n else None

        # The controller manager turns the operator's Deployments into Pods (Pending: no kubelet).
        prefill = (await eventually(lambda: pods_of("prefill", 1), "prefill pods", 60, 0.5, log))[0]
        decode = (await eventually(lambda: pods_of("decode", 1), "decode pods", 60, 0.5, log))[0]
        deployment = _json(cluster, "deployment", "small-decode", "-n", ns)
        assert deployment["metadata"]["ownerReferences"][0]["uid"] == uid
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        env = {e["name"]: e for e in container["env"]}
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == (
            "status.podIP"
        )
        assert container["startupProbe"]["httpGet"]["path"] == "/health"

        _play_kubelet(cluster, ns, prefill["metadata"]["name"], "198.18.0.11")
        _play_kubelet(cluster, ns, decode["metadata"]["name"], "198.18.0.12")

        async def jobs() -> list[dict[str, Any]] | None:
            items: list[dict[str, Any]] = _json(
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
        role = _json(cluster, "role", "small-probe", "-n", ns)
        (rule,) = role["rules"]
        assert rule["verbs"] == ["patch"] and rule["resources"] == ["configmaps"]
        assert sorted(rule["resourceNames"]) == sorted(
            f"small-profile-{p}" for p in (prefill["metadata"]["name"], decode["metadata"]["name"])
        )
        router_rules = _json(cluster, "role", "small-router", "-n", ns)["rules"]
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
        for router_pod in _pods(cluster, ns, "disaggpool.io/component=router"):
            _play_kubelet(cluster, ns, router_pod["metadata"]["name"], "198.18.0.20")

        async def ready() -> dict[str, Any] | None:
            st: dict[str, Any] = _json(cluster, "dpool", "small", "-n", ns).get("status") or {}
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
            st = _json(cluster, "dpool", "small", "-n", ns).get("status") or {}
            c = {c["type"]: c for c in st.get("conditions") or []}.get("Degraded") or {}
            return c if c.get("status") == "True" else None

        cond = await eventually(degraded, "Degraded=True", 30, 0.5, log)
        assert cond["reason"] == "InvalidSpec" and "decode.minReplicas" in cond["message"]
        assert _json(cluster, "deployment", "small-decode", "-n", ns)["spec"]["replicas"] == 1
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
            return len(_pods(cluster, "idem", "disaggpool.io/pool=hetero")) == 8

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
    dep = _json(cluster, "deployment", "-n", ns, "dp-disaggpool-operator")
    assert dep["spec"]["template"]["spec"]["serviceAccountName"] == "dp-disaggpool-operator"
    cluster.helm(
        "upgrade", "dp", str(CHART), "-n", ns,
        "--set", "operator.resyncSeconds=30",
    )  # fmt: skip
    dep = _json(cluster, "deployment", "-n", ns, "dp-disaggpool-operator")
    env = {
        e["name"]: e.get("value") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["DISAGGPOOL_RESYNC_SECONDS"] == "30"
    assert "dp" in cluster.helm("list", "-n", ns)
    cluster.helm("uninstall", "dp", "-n", ns)
    left = cluster.kubectl("get", "deployments,serviceaccounts", "-n", ns, "-o", "name")
    assert "dp-disaggpool-operator" not in left
    # The CRD stays (Helm never deletes CRDs from crds/): pools survive an uninstall.
    assert _json(cluster, "crd", "disaggpools.disaggpool.io")["metadata"]["name"]


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
        roles = _json(cluster, "roles,rolebindings", "-n", ns, "-l", release)
        assert sorted(r["kind"] for r in roles["items"]) == ["Role", "RoleBinding"]
        cluster_wide = _json(cluster, "clusterroles,clusterrolebindings", "-l", release)
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
                st: dict[str, Any] = _json(cluster, "dpool", "small", "-n", ns).get("status") or {}
                return st if st.get("phase") else None

            st = await eventually(reported, "the watched pool's status", 60, 0.5, log)
            assert st["phase"] == "Progressing"
            assert _json(cluster, "deployment", "small-router", "-n", ns)["metadata"]["name"]
            await asyncio.sleep(6)  # a resync period (5 s in these tests) and more
            assert _json(cluster, "dpool", "small", "-n", other).get("status") is None
            assert not _json(cluster, "deployments", "-n", other)["items"]
            text = log.read_text(errors="replace")
            assert "403" not in text and "Forbidden" not in text, text[-3000:]
            assert proc.returncode is None
        finally:
            await stop_operator(proc)
    finally:
        cluster.helm("uninstall", "nsop", "-n", home)
        for n in (ns, other, home):
            cluster.kubectl("delete", "namespace", n, "--wait=false")


@pytest.mark.asyncio
async def test_decode_autoscaling_from_the_routers_recommendation(
    cluster: Cluster, tmp_path: Path
) -> None:
    """The loop's Kubernetes half on a real API server: the router's autoscaler (real code, the
    router's own service-account token, so its Role is exercised) writes a recommendation on its
    pool; a reconcile pass scales the decode Deployment within the bounds, with an Event and
    `status.autoscaling`; a bad autoscaling spec is flagged and leaves the pool as it runs."""
    from disaggpool.core.profile import CalibrationProfile
    from disaggpool.sidecar.autoscale import DecodeRecommender
    from disaggpool.sidecar.config import Member, parse_config
    from disaggpool.sidecar.pool_writer import PoolWriter
    from disaggpool.sidecar.service import RoutingService
    from disaggpool.sidecar.state import Gauges

    cluster.kubectl("create", "namespace", "scale")
    cr = load_sample("small.yaml")
    cr["metadata"]["namespace"] = "scale"
    cr["spec"]["decode"] = {"replicas": 1, "minReplicas": 1, "maxReplicas": 3}
    cr["spec"]["autoscaling"] = {"enabled": True, "startupSeconds": 60}
    cluster.kubectl("apply", "-f", "-", stdin=json.dumps(cr))
    deployment = ("deployment", "small-decode", "-n", "scale")
    kube = Kube.from_environment(str(cluster.kubeconfig))
    try:
        await reconcile(kube, "scale", "small", default_image="disaggpool:test")
        assert _json(cluster, *deployment)["spec"]["replicas"] == 1
        status = _json(cluster, "dpool", "small", "-n", "scale")["status"]
        assert status["autoscaling"]["source"] == "spec"
        assert status["decode"]["selector"] == "disaggpool.io/pool=small,disaggpool.io/role=decode"

        # The router, as the operator renders its config, with a decode pod it has profiled
        # and a busy minute of traffic behind it.
        rendered = _json(cluster, "configmap", "small-router", "-n", "scale")["data"]
        config = parse_config(yaml.safe_load(rendered["sidecar.yaml"]), "sidecar.yaml")
        assert config.autoscaling is not None and config.autoscaling.pool_name == "small"
        clock = [1000.0]
        service = RoutingService(
            dataclasses.replace(config, members_kubernetes=None, profiles_kubernetes=None),
            clock=lambda: clock[0],
        )
        service.state.set_members([Member("small-decode-a", "decode", "http://127.0.0.1:1")])
        profile: CalibrationProfile = dataclasses.replace(
            builtin_profile("a40-llama3-8b"), quality="good"
        )
        service.state.set_profile("small-decode-a", profile, clock[0])
        service.state.scraped("small-decode-a", Gauges(40, 12, 0.9, 190_000), clock[0])
        for i in range(3000):  # 50 req/s over the last minute
            service.demand.arrived(940.0 + i / 50.0)
        for _ in range(100):
            service.demand.finished(990.0, 1000, 200, 0.5, 0.5)
        token = cluster.sa_token("scale", "small-router")
        router_cfg = cluster.kubeconfig_for(tmp_path / "router", token)
        recommender = DecodeRecommender(config.autoscaling, service)
        task = PoolWriter(
            service, [recommender], namespace="scale", name="small", period_s=15.0, session=None,
            kube=lambda: Kube.from_environment(str(router_cfg)),
        )  # fmt: skip
        written = await task.step()
        decision = written["decodeRecommendation"]
        # 50 req/s needs 9 pods of this profile; the router's own bounds (rendered from the
        # pool's) cap its recommendation at 3.
        assert decision["replicas"] == 3 and "-> 9" in decision["reason"]
        assert await task.step() == {}  # unchanged: not written again
        pool = _json(cluster, "dpool", "small", "-n", "scale")
        # On the status subresource, as the router's report; never on the pool's metadata.
        assert pool["status"]["router"]["decodeRecommendation"] == decision
        assert "disaggpool.io/decode-recommendation" not in pool["metadata"].get("annotations", {})

        # Its Role lets it patch its own pool's status and nothing else: not its spec (what the
        # operator deploys), not another pool's status, not even a read.
        other = load_sample("small.yaml")
        other["metadata"].update(name="other", namespace="scale")
        cluster.kubectl("apply", "-f", "-", stdin=json.dumps(other))
        router_kube = Kube.from_environment(str(router_cfg))
        pools = "/apis/disaggpool.io/v1alpha1/namespaces/scale/disaggpools"
        try:
            for what, call in (
                ("its spec", router_kube.merge_patch(
                    f"{pools}/small", {"spec": {"engine": {"image": "evil"}}}
                )),
                ("its annotations", router_kube.merge_patch(
                    f"{pools}/small", {"metadata": {"annotations": {"x": "y"}}}
                )),
                ("another's status", router_kube.merge_patch(
                    f"{pools}/other/status", {"status": {"router": {}}}
                )),
                ("a read", router_kube.get(f"{pools}/small")),
            ):  # fmt: skip
                with pytest.raises(ApiError) as refused:
                    await call
                assert refused.value.status == 403, what
        finally:
            await router_kube.close()

        await reconcile(kube, "scale", "small", default_image="disaggpool:test")
        assert _json(cluster, *deployment)["spec"]["replicas"] == 3
        status = _json(cluster, "dpool", "small", "-n", "scale")["status"]
        assert status["autoscaling"]["replicas"] == 3
        assert status["autoscaling"]["recommendedReplicas"] == 3
        assert status["autoscaling"]["reason"] == decision["reason"]
        events = _json(cluster, "events", "-n", "scale")["items"]
        scaled = [e["message"] for e in events if e["reason"] == "DecodeScaled"]
        assert any(m.startswith("decode 1 -> 3") for m in scaled), scaled

        # A bad autoscaling spec: Degraded, naming the field; the pool keeps running as it is.
        cluster.kubectl(
            "patch", "dpool", "small", "-n", "scale", "--type=merge",
            "-p", json.dumps({"spec": {"decode": {"minReplicas": 4}}}),
        )  # fmt: skip
        result = await reconcile(kube, "scale", "small", default_image="disaggpool:test")
        assert any(i.field.endswith("minReplicas") for i in result.issues)
        status = _json(cluster, "dpool", "small", "-n", "scale")["status"]
        degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
        assert degraded["status"] == "True" and "minReplicas" in degraded["message"]
        assert _json(cluster, *deployment)["spec"]["replicas"] == 3

        # The other path: autoscaling off, an HPA (here `kubectl scale`) drives decode.replicas
        # through the scale subresource.
        cluster.kubectl(
            "patch", "dpool", "small", "-n", "scale", "--type=merge",
            "-p", json.dumps({"spec": {"decode": {"minReplicas": 1}, "autoscaling": None}}),
        )  # fmt: skip
        cluster.kubectl("scale", "dpool", "small", "-n", "scale", "--replicas=2")
        await reconcile(kube, "scale", "small", default_image="disaggpool:test")
        assert _json(cluster, *deployment)["spec"]["replicas"] == 2
        scale = json.loads(
            cluster.kubectl(
                "get",
                "--raw",
                "/apis/disaggpool.io/v1alpha1/namespaces/scale/disaggpools/small/scale",
            )
        )
        assert scale["spec"]["replicas"] == 2
        assert scale["status"]["selector"] == "disaggpool.io/pool=small,disaggpool.io/role=decode"
        await task.stop()
    finally:
        await kube.close()
        cluster.kubectl("delete", "namespace", "scale", "--wait=false")


@pytest.mark.asyncio
async def test_a_drifting_pod_is_reprobed_from_the_routers_errors(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Drift on a real API server: the router (its own token) writes its pods' prediction errors
    on the pool; a pass re-probes the pod whose error about its current profile is over
    `calibration.maxPredictionError`, and only that one."""
    from disaggpool.sidecar.config import Member, parse_config
    from disaggpool.sidecar.pool_writer import DriftReport, PoolWriter
    from disaggpool.sidecar.service import RoutingService

    ns = "drift"
    cluster.kubectl("create", "namespace", ns)
    cr = load_sample("small.yaml")
    cr["metadata"]["namespace"] = ns
    cr["spec"]["calibration"] = {"maxPredictionError": 0.3}
    cluster.kubectl("apply", "-f", "-", stdin=json.dumps(cr))
    kube = Kube.from_environment(str(cluster.kubeconfig))
    monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig))  # the probe's sink, as admin here
    try:
        await reconcile(kube, ns, "small", default_image="disaggpool:test")
        uid = _json(cluster, "dpool", "small", "-n", ns)["metadata"]["uid"]

        async def both() -> list[dict[str, Any]] | None:
            pods = _pods(cluster, ns, "disaggpool.io/pool=small,disaggpool.io/role")
            return pods if len(pods) == 2 else None

        pods = {
            p["metadata"]["labels"]["disaggpool.io/role"]: p
            for p in await eventually(both, "pods", 60, 0.5)
        }
        fitted = "2026-12-04T10:00:00+00:00"
        for k, (_, pod) in enumerate(sorted(pods.items())):  # decode .31, prefill .32
            name = pod["metadata"]["name"]
            _play_kubelet(cluster, ns, name, f"198.18.0.{31 + k}")
            profile = dataclasses.replace(
                builtin_profile("a40-llama3-8b"), name=name, quality="good", fitted_at=fitted
            )
            labels = {"disaggpool.io/pool": "small", "disaggpool.io/pod": name,
                      "disaggpool.io/profile": "true"}  # fmt: skip
            owner = sinks.pool_owner(f"small/{uid}")
            await asyncio.to_thread(
                functools.partial(
                    sinks.write_configmap,
                    profile,
                    f"{ns}/small-profile-{name}",
                    {},
                    labels,
                    owner=owner,
                )
            )
        calm = await reconcile(kube, ns, "small", default_image="disaggpool:test")
        assert not calm.jobs_created, calm

        rendered = _json(cluster, "configmap", "small-router", "-n", ns)["data"]["sidecar.yaml"]
        config = parse_config(yaml.safe_load(rendered), "sidecar.yaml")
        assert config.drift is not None and config.drift.pool_name == "small"
        service = RoutingService(
            dataclasses.replace(config, members_kubernetes=None, profiles_kubernetes=None)
        )
        decode = pods["decode"]["metadata"]["name"]
        prefill = pods["prefill"]["metadata"]["name"]
        service.state.set_members(
            [Member(decode, "decode", "http://198.18.0.31:8000"),
             Member(prefill, "prefill", "http://198.18.0.32:8000")]
        )  # fmt: skip
        for name in (decode, prefill):
            profile = dataclasses.replace(
                builtin_profile("a40-llama3-8b"), quality="good", fitted_at=fitted
            )
            service.install_profile(name, profile, 0.0)
        for _ in range(20):  # the decode pod now takes twice as long per token as predicted
            service.drift.observe(decode, "tpot", 0.02, 0.04)
            service.drift.observe(prefill, "ttft", 0.50, 0.52)
        router_cfg = cluster.kubeconfig_for(
            tmp_path / "router", cluster.sa_token(ns, "small-router")
        )
        writer = PoolWriter(
            service, [DriftReport(service)], namespace=ns, name="small", period_s=15.0,
            session=None, kube=lambda: Kube.from_environment(str(router_cfg)),
        )  # fmt: skip
        written = await writer.step()
        errors = {e["pod"]: e for e in written["observedErrors"]["pods"]}
        assert errors[decode] == {"pod": decode, "error": 0.5, "profile": fitted}
        await writer.stop()
        report = _json(cluster, "dpool", "small", "-n", ns)["status"]["router"]
        assert report["observedErrors"] == written["observedErrors"]

        drifted = await reconcile(kube, ns, "small", default_image="disaggpool:test")
        assert len(drifted.jobs_created) == 1, drifted
        job = _json(cluster, "job", drifted.jobs_created[0], "-n", ns)
        assert job["metadata"]["labels"]["disaggpool.io/pod"] == decode
        status = _json(cluster, "dpool", "small", "-n", ns)["status"]
        by_pod = {p["name"]: p for p in status["pods"]}
        assert by_pod[decode]["calibration"] == "probing"
        assert by_pod[prefill]["calibration"] == "calibrated"
        # The operator's status write left the router's report alone.
        assert status["router"]["observedErrors"] == written["observedErrors"]

        # A profile that does not parse or validate: a Warning Event naming the field, once
        # however many passes see it, and the pod is probed again.
        bad = yaml.safe_load(
            _json(cluster, "configmap", f"small-profile-{prefill}", "-n", ns)["data"][
                "profile.yaml"
            ]
        )
        bad["decode"]["d1"] = "fast"
        cluster.kubectl(
            "patch", "configmap", f"small-profile-{prefill}", "-n", ns, "--type=merge",
            "-p", json.dumps({"data": {"profile.yaml": yaml.safe_dump(bad)}}),
        )  # fmt: skip
        rejected = await reconcile(kube, ns, "small", default_image="disaggpool:test")
        await reconcile(kube, ns, "small", default_image="disaggpool:test")
        assert [
            j for j in rejected.jobs_created
            if _json(cluster, "job", j, "-n", ns)["metadata"]["labels"]["disaggpool.io/pod"]
            == prefill
        ]  # fmt: skip
        events = [
            e for e in _json(cluster, "events", "-n", ns)["items"]
            if e["reason"] == "ProfileRejected"
        ]  # fmt: skip
        assert len(events) == 1 and events[0]["type"] == "Warning", events
        assert "decode.d1" in events[0]["message"] and prefill in events[0]["message"]
        assert events[0]["count"] == 1

        # A profile not owned by this pool (labels alone) is ignored: the pod is probed, into
        # a ConfigMap the operator takes over.
        cluster.kubectl("delete", "configmap", f"small-profile-{decode}", "-n", ns)
        forged = {
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": f"small-profile-{decode}", "namespace": ns,
                         "labels": {"disaggpool.io/pool": "small", "disaggpool.io/pod": decode,
                                    "disaggpool.io/profile": "true"}},
            "data": {"profile.yaml": dump_profile(dataclasses.replace(
                builtin_profile("a40-llama3-8b"), quality="good", fitted_at=fitted))},
        }  # fmt: skip
        cluster.kubectl("apply", "-f", "-", stdin=json.dumps(forged))
        for job in _json(cluster, "jobs", "-n", ns, "-l", f"disaggpool.io/pod={decode}")["items"]:
            _play_failed_job(cluster, ns, job["metadata"]["name"])  # end the drift probe
        await reconcile(kube, ns, "small", default_image="disaggpool:test")
        taken = _json(cluster, "configmap", f"small-profile-{decode}", "-n", ns)
        assert taken["metadata"]["ownerReferences"][0]["uid"] == uid
        assert "disaggpool.io/profile" not in taken["metadata"]["labels"]
        assert not taken.get("data")
        status = _json(cluster, "dpool", "small", "-n", ns)["status"]
        by_pod = {p["name"]: p for p in status["pods"]}
        assert by_pod[decode]["calibration"] == "probing" and "profileRef" not in by_pod[decode]
    finally:
        await kube.close()
        cluster.kubectl("delete", "namespace", ns, "--wait=false")


def _play_failed_job(cluster: Cluster, ns: str, job: str) -> None:
    """What the Job controller writes once a probe's pods have failed `backoffLimit` times."""
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    failed = {"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded",
              "lastProbeTime": now, "lastTransitionTime": now}  # fmt: skip
    cluster.kubectl(
        "patch", "job", job, "-n", ns, "--subresource=status", "--type=merge",
        "-p", json.dumps({"status": {"conditions": [failed], "failed": 1}}),
    )  # fmt: skip


@pytest.mark.asyncio
async def test_a_failed_probe_is_retried_then_the_pod_is_marked_failed(
    cluster: Cluster, tmp_path: Path
) -> None:
    """The running operator sees its probe Jobs end (its Job watch and its Job list): a failed
    probe is run again as the next attempt, and after `calibration.maxAttempts` failures the
    pod is `failed`. Before the probe Jobs carried the labels the operator finds them by, the
    first failure left the pod `probing` for ever."""
    ns = "failing"
    cluster.kubectl("create", "namespace", ns)
    cr = load_sample("small.yaml")
    cr["metadata"]["namespace"] = ns
    cr["spec"]["calibration"] = {"maxAttempts": 2}
    token = cluster.sa_token("disaggpool-system", "disaggpool-operator")
    log = tmp_path / "operator.log"
    proc = await start_operator(cluster.kubeconfig_for(tmp_path / "operator", token), log)
    try:
        cluster.kubectl("apply", "-f", "-", stdin=json.dumps(cr))

        async def both() -> list[dict[str, Any]] | None:
            pods = _pods(cluster, ns, "disaggpool.io/pool=small,disaggpool.io/role")
            return pods if len(pods) == 2 else None

        pods = {
            p["metadata"]["labels"]["disaggpool.io/role"]: p["metadata"]["name"]
            for p in await eventually(both, "pods", 60, 0.5, log)
        }
        _play_kubelet(cluster, ns, pods["prefill"], "198.18.0.41")
        _play_kubelet(cluster, ns, pods["decode"], "198.18.0.42")
        prefill = pods["prefill"]

        def attempt(n: int) -> Any:
            async def job() -> str | None:
                sel = f"disaggpool.io/pod={prefill},disaggpool.io/attempt={n}"
                items = _json(cluster, "jobs", "-n", ns, "-l", sel)["items"]
                return str(items[0]["metadata"]["name"]) if items else None

            return job

        first = await eventually(attempt(1), "the prefill pod's first probe", 60, 0.5, log)
        _play_failed_job(cluster, ns, first)
        # Only the Job's own event can start the next pass here: nothing else changes.
        second = await eventually(attempt(2), "a second probe after the first failed", 60, 0.5, log)
        _play_failed_job(cluster, ns, second)

        async def given_up() -> dict[str, Any] | None:
            st = _json(cluster, "dpool", "small", "-n", ns).get("status") or {}
            by_pod = {p["name"]: p for p in st.get("pods") or []}
            got = by_pod.get(prefill) or {}
            return got if got.get("calibration") == "failed" else None

        got = await eventually(given_up, "the prefill pod marked failed", 60, 0.5, log)
        assert "2 probe attempts failed" in str(got), got
        await asyncio.sleep(2)  # no third attempt follows
        assert await attempt(3)() is None
        assert proc.returncode is None
    finally:
        await stop_operator(proc)
        cluster.kubectl("delete", "namespace", ns, "--wait=false")


@pytest.mark.asyncio
async def test_a_job_holding_a_probes_name_without_its_labels_is_reported(
    cluster: Cluster,
) -> None:
    """A Job the operator cannot find by its labels but whose name a probe needs is a Warning
    event on the pool, not a silent skip (how a label drift once hid every probe Job); each
    later pass counts on that Event rather than adding one."""
    from disaggpool.operator.names import PoolRef, job_name

    ns = "squatted"
    cluster.kubectl("create", "namespace", ns)
    cr = load_sample("small.yaml")
    cr["metadata"]["namespace"] = ns
    cluster.kubectl("apply", "-f", "-", stdin=json.dumps(cr))
    kube = Kube.from_environment(str(cluster.kubeconfig))
    try:
        await reconcile(kube, ns, "small", default_image="disaggpool:test")

        async def prefill() -> str | None:
            pods = _pods(cluster, ns, "disaggpool.io/pool=small,disaggpool.io/role=prefill")
            return str(pods[0]["metadata"]["name"]) if pods else None

        pod = await eventually(prefill, "the prefill pod", 60, 0.5)
        uid = _json(cluster, "dpool", "small", "-n", ns)["metadata"]["uid"]
        squatter = job_name(PoolRef("small", ns, uid), pod, 1)
        cluster.kubectl(
            "create", "job", squatter, "-n", ns, "--image=busybox", "--", "true"
        )  # fmt: skip
        _play_kubelet(cluster, ns, pod, "198.18.0.51")
        result = await reconcile(kube, ns, "small", default_image="disaggpool:test")
        assert squatter not in result.jobs_created
        events = cluster.kubectl(
            "get", "events", "-n", ns, "--field-selector", "involvedObject.name=small"
        )
        line = next((x for x in events.splitlines() if "CalibrationBlocked" in x), "")
        assert "Warning" in line and squatter in line, events
        await reconcile(kube, ns, "small", default_image="disaggpool:test")
        blocked = [
            e for e in _json(cluster, "events", "-n", ns)["items"]
            if e["reason"] == "CalibrationBlocked"
        ]  # fmt: skip
        assert [e["count"] for e in blocked] == [2], blocked
    finally:
        await kube.close()
        cluster.kubectl("delete", "namespace", ns, "--wait=false")
