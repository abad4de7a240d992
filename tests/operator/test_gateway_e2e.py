"""Gateway mode on a real kube-apiserver 1.20.2: the operator renders, switches and prunes it.

The control plane of k8s_cluster (etcd, kube-apiserver, controller manager; skipped without the
binaries, failed under DISAGGPOOL_REQUIRE_K8S=1) with the DisaggPool CRD and an InferencePool
CRD written for the tests (tests/operator/fixtures/inferencepool-crd.yaml), both applied before
the controller manager starts so that its garbage collector follows InferencePools too. The
operator runs as a real process with the token of the service account manifests/02-rbac.yaml
binds, so its InferencePool rule is exercised. No kubelet: the pods the controller manager
creates stay Pending, which is enough to read their containers.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from k8s_cluster import Cluster, require_k8s, running_cluster
from operator_testkit import CRD_PATH, MANIFESTS, eventually, load_sample, start_operator
from operator_testkit import stop_operator as stop

from disaggpool.kubeclient import ApiError, Kube, path_for
from disaggpool.operator.gateway import INFERENCE_POOL_API_VERSION
from disaggpool.operator.reconcile import reconcile

INFERENCE_POOL_CRD = Path(__file__).parent / "fixtures" / "inferencepool-crd.yaml"
NS = "gw"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    require_k8s()
    with running_cluster(tmp_path_factory.mktemp("cluster"), [CRD_PATH, INFERENCE_POOL_CRD]) as c:
        c.kubectl("apply", "-f", str(MANIFESTS))
        c.kubectl("create", "namespace", NS)
        yield c


def _get(cluster: Cluster, *args: str) -> Any:
    """The object as JSON, or None when it does not exist."""
    out = cluster.kubectl("get", *args, "-n", NS, "-o", "json", "--ignore-not-found", check=False)
    return json.loads(out) if out.strip().startswith("{") else None


def _pool(name: str, **router: Any) -> str:
    cr = load_sample("small.yaml")
    cr["metadata"].update(name=name, namespace=NS)
    cr["spec"]["router"].update(router)
    return json.dumps(cr)


GATEWAY = {"mode": "gateway", "grpc": {"tokenSecret": {"name": "gw-grpc"}}}


def test_the_crd_refuses_an_unknown_router_mode(cluster: Cluster) -> None:
    out = cluster.kubectl(
        "apply", "--dry-run=server", "-f", "-", stdin=_pool("bad", mode="gatewy"), check=False
    )
    assert "spec.router.mode" in out and "Unsupported value" in out, out


@pytest.mark.asyncio
async def test_gateway_mode_renders_the_inference_pool_and_frontdoor_removes_it(
    cluster: Cluster, tmp_path: Path
) -> None:
    token = cluster.sa_token("disaggpool-system", "disaggpool-operator")
    log = tmp_path / "operator.log"
    proc = await start_operator(cluster.kubeconfig_for(tmp_path / "operator", token), log)
    try:
        clients = [{"namespaceSelector": {"matchLabels": {"gateway": "true"}}}]
        doc = json.loads(_pool("small", **GATEWAY))
        doc["spec"]["networkPolicy"] = {"enabled": True, "clients": clients}
        cluster.kubectl("apply", "-f", "-", stdin=json.dumps(doc))

        async def inference_pool() -> Any:
            return _get(cluster, "inferencepool", "small")

        ip = await eventually(inference_pool, "the InferencePool", 60, 0.5, log)
        spec = ip["spec"]
        assert spec["targetPorts"] == [{"number": 8001}]
        ref = spec["endpointPickerRef"]
        assert (ref["kind"], ref["name"], ref["port"], ref["failureMode"]) == (
            "Service", "small-router", {"number": 9002}, "FailClose",
        )  # fmt: skip
        owner = ip["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["name"]) == ("DisaggPool", "small")

        service = _get(cluster, "service", "small-router")
        epp = next(p for p in service["spec"]["ports"] if p["port"] == 9002)
        assert (epp["name"], epp["appProtocol"]) == ("grpc-epp", "grpc")
        config = _get(cluster, "configmap", "small-router")["data"]["sidecar.yaml"]
        assert "ext_proc: 0.0.0.0:9002" in config and "destination_port: 8001" in config

        # The controller manager's pods: the InferencePool's selector finds exactly the decode
        # pod, whose pd-proxy the API server accepted as rendered.
        async def pods() -> list[dict[str, Any]] | None:
            items = _get(cluster, "pods", "-l", "disaggpool.io/pool=small")["items"]
            return items if len(items) == 3 else None  # prefill, decode, router

        every = await eventually(pods, "the pool's pods", 60, 0.5, log)
        selector = ",".join(f"{k}={v}" for k, v in spec["selector"]["matchLabels"].items())
        selected = _get(cluster, "pods", "-l", selector)["items"]
        decode = [p for p in every if p["metadata"]["labels"].get("disaggpool.io/role") == "decode"]
        assert [p["metadata"]["name"] for p in selected] == [p["metadata"]["name"] for p in decode]
        containers = {c["name"]: c for c in decode[0]["spec"]["containers"]}
        assert sorted(containers) == ["pd-proxy", "vllm"]
        proxy = containers["pd-proxy"]
        assert proxy["args"][:3] == ["pd-proxy", "--listen", "0.0.0.0:8001"]
        assert proxy["securityContext"]["runAsNonRoot"] is True
        gateway_policy = _get(cluster, "networkpolicy", "small-gateway")
        assert gateway_policy["spec"]["ingress"][0]["from"] == clients

        # Back to frontdoor: the InferencePool, the port, the proxies and the policy go.
        cluster.kubectl(
            "patch", "dpool", "small", "-n", NS, "--type=merge",
            "-p", json.dumps({"spec": {"router": {"mode": "frontdoor"}}}),
        )  # fmt: skip

        async def pruned() -> bool:
            return _get(cluster, "inferencepool", "small") is None

        await eventually(pruned, "the InferencePool pruned", 60, 0.5, log)
        ports = {p["port"] for p in _get(cluster, "service", "small-router")["spec"]["ports"]}
        assert 9002 not in ports
        template = _get(cluster, "deployment", "small-decode")["spec"]["template"]["spec"]
        assert [c["name"] for c in template["containers"]] == ["vllm"]
        assert _get(cluster, "networkpolicy", "small-gateway") is None

        # A gateway pool without the gRPC token is refused, naming the field.
        cluster.kubectl("apply", "-f", "-", stdin=_pool("open", mode="gateway"))

        async def degraded() -> dict[str, Any] | None:
            st = (_get(cluster, "dpool", "open") or {}).get("status") or {}
            c = {c["type"]: c for c in st.get("conditions") or []}.get("Degraded") or {}
            return c if c.get("status") == "True" else None

        cond = await eventually(degraded, "Degraded=True", 60, 0.5, log)
        assert "spec.router.grpc.tokenSecret" in cond["message"], cond
        assert _get(cluster, "inferencepool", "open") is None

        # Deleting a gateway pool garbage-collects its InferencePool (owner reference).
        cluster.kubectl("apply", "-f", "-", stdin=_pool("gone", **GATEWAY))

        async def created() -> Any:
            return _get(cluster, "inferencepool", "gone")

        await eventually(created, "the second pool's InferencePool", 60, 0.5, log)
        cluster.kubectl("delete", "dpool", "gone", "-n", NS, "--wait=true")

        async def collected() -> bool:
            return _get(cluster, "inferencepool", "gone") is None

        await eventually(collected, "the InferencePool collected", 90, 0.5, log)
        text = log.read_text(errors="replace")
        assert "403" not in text and "Forbidden" not in text, text[-3000:]
        assert proc.returncode is None
    finally:
        await stop(proc)


@pytest.mark.asyncio
async def test_replicated_routers_get_a_service_whose_endpoints_their_leader_writes(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Two gateway-mode routers (active/passive): the operator takes the selector off their
    Service and creates its Endpoints, owned by the pool, for the leader to fill in; back to
    one router, the selector returns and the operator prunes its Endpoints (the endpoints
    controller keeps its own)."""
    token = cluster.sa_token("disaggpool-system", "disaggpool-operator")
    log = tmp_path / "operator.log"
    proc = await start_operator(cluster.kubeconfig_for(tmp_path / "operator", token), log)

    def owners() -> list[str]:
        ep = _get(cluster, "endpoints", "ha-router") or {}
        return [o["kind"] for o in ep.get("metadata", {}).get("ownerReferences") or []]

    def replicas(n: int) -> None:
        patch = {"spec": {"router": {"replicas": n}}}
        cluster.kubectl("patch", "dpool", "ha", "-n", NS, "--type=merge", "-p", json.dumps(patch))

    try:
        cluster.kubectl("apply", "-f", "-", stdin=_pool("ha", **GATEWAY))

        async def selected() -> bool:
            service = _get(cluster, "service", "ha-router")
            return service is not None and "selector" in service["spec"]

        await eventually(selected, "the router Service, with a selector", 60, 0.5, log)
        replicas(2)

        async def led() -> bool:
            return "selector" not in _get(cluster, "service", "ha-router")["spec"] and (
                owners() == ["DisaggPool"]
            )

        await eventually(led, "a selector-less Service and the pool's Endpoints", 60, 0.5, log)
        role = _get(cluster, "role", "ha-router")
        assert {
            "apiGroups": [""],
            "resources": ["endpoints"],
            "resourceNames": ["ha-router"],
            "verbs": ["patch"],
        } in role["rules"]
        config = _get(cluster, "configmap", "ha-router")["data"]["sidecar.yaml"]
        assert "endpoints:" in config and "name: ha-router" in config
        replicas(1)

        async def back() -> bool:
            service = _get(cluster, "service", "ha-router")
            return "selector" in service["spec"] and "DisaggPool" not in owners()

        await eventually(back, "the selector back, the pool's Endpoints pruned", 60, 0.5, log)
        text = log.read_text(errors="replace")
        assert "403" not in text and "Forbidden" not in text, text[-3000:]
        assert proc.returncode is None
    finally:
        await stop(proc)


@pytest.mark.asyncio
async def test_without_the_inference_pool_crd_the_pool_runs_and_says_why(cluster: Cluster) -> None:
    """A cluster without GIE's CRD (this one, once the test removes it; run last): a gateway
    pool gets everything else and a CRDMissing warning, and pruning tolerates the missing kind."""
    cluster.kubectl("delete", "-f", str(INFERENCE_POOL_CRD), "--wait=true")
    cluster.kubectl("apply", "-f", "-", stdin=_pool("nocrd", **GATEWAY))
    kube = Kube.from_environment(str(cluster.kubeconfig))
    try:
        for _ in range(60):  # until discovery forgets the kind (the CRD's deletion is async)
            try:
                await kube.list(path_for(INFERENCE_POOL_API_VERSION, "InferencePool", NS), {})
            except ApiError as exc:
                if exc.status == 404:
                    break
            await asyncio.sleep(0.5)
        result = await reconcile(kube, NS, "nocrd", default_image="disaggpool:test")
        assert "InferencePool nocrd" not in result.created
        assert {"Deployment nocrd-decode", "Service nocrd-router"} <= set(result.created)
        events = cluster.kubectl(
            "get", "events", "-n", NS, "--field-selector", "involvedObject.name=nocrd"
        )
        assert "CRDMissing" in events and "inference.networking.k8s.io/v1 InferencePool" in events
        # Back to frontdoor: the prune lists InferencePools too, and finds the kind gone.
        cluster.kubectl(
            "patch", "dpool", "nocrd", "-n", NS, "--type=merge",
            "-p", json.dumps({"spec": {"router": {"mode": "frontdoor"}}}),
        )  # fmt: skip
        result = await reconcile(kube, NS, "nocrd", default_image="disaggpool:test")
        assert "Deployment nocrd-decode" in result.updated and not result.deleted
    finally:
        await kube.close()
