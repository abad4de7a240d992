"""The operator as users install it: `helm install` of the chart, the operator running as a pod
from the locally built image (non-root, read-only root filesystem, its own service account),
then pools: the sample a user applies first, and a CPU pool whose every pod runs here (engines,
calibration Jobs, router), with a request served through the router pod."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from images import PROJECT
from node_cluster import POD_SUBNET, NodeCluster

REPO = Path(__file__).resolve().parents[2]
NS = "disaggpool-system"

#: 1 prefill + 2 decode on CPUs (`gpus: 0`). The image's `vllm` runs the emulator with the
#: command line the operator renders (vllm_shim.py), so the probe measures a real HTTP engine.
CPU_POOL = {
    "apiVersion": "disaggpool.io/v1alpha1",
    "kind": "DisaggPool",
    "metadata": {"name": "cpu", "namespace": "default"},
    "spec": {
        "model": {"name": "Qwen/Qwen2.5-3B", "servedModelName": "qwen", "maxModelLen": 4096},
        "engine": {
            "image": f"{PROJECT[0]}:{PROJECT[1]}",
            "imagePullPolicy": "Never",
            "env": [{"name": "DISAGGPOOL_EMULATOR_PROFILE", "value": "a40-qwen2.5-3b"}],
            "sharedMemory": "64Mi",
        },
        "prefill": {"replicas": 1, "gpus": 0},
        "decode": {"replicas": 2, "gpus": 0},
        "calibration": {"budgetSeconds": 10},
        "router": {"policy": "calibrated"},
    },
}


@pytest.fixture(scope="module")
def operator(node: NodeCluster) -> Iterator[dict[str, Any]]:
    node.helm(
        "install", "dp", str(REPO / "helm" / "disaggpool"), "--namespace", NS,
        "--create-namespace",
        "--set", f"image.repository={PROJECT[0]}",
        "--set", f"image.tag={PROJECT[1]}",
        "--set", "image.pullPolicy=Never",
        "--set", "operator.resyncSeconds=5",
    )  # fmt: skip
    (deployment,) = node.get("deployments", "-n", NS)["items"]
    name = deployment["metadata"]["name"]
    node.kubectl("rollout", "status", "-n", NS, f"deployment/{name}", "--timeout=240s")
    yield deployment
    node.helm("uninstall", "dp", "--namespace", NS, "--wait", check=False)


def _deployments(node: NodeCluster, pool: str) -> dict[str, dict[str, Any]]:
    items = node.get("deployments", "-n", "default", "-l", f"disaggpool.io/pool={pool}")["items"]
    return {d["metadata"]["name"]: d for d in items}


def _role(obj: dict[str, Any]) -> str:
    return str(obj["spec"]["template"]["metadata"]["labels"].get("disaggpool.io/role", "router"))


def _delete_pool(node: NodeCluster, pool: str) -> None:
    node.kubectl("delete", "dpool", "-n", "default", pool, "--wait=true", "--timeout=120s")
    node.wait_for(
        f"pool {pool}'s objects to be garbage-collected",
        lambda: (
            not _deployments(node, pool)
            and not node.get("pods", "-n", "default", "-l", f"disaggpool.io/pool={pool}")["items"]
        ),
        timeout=180,
    )


def test_the_operator_runs_as_a_pod_from_the_local_image(
    node: NodeCluster, operator: dict[str, Any]
) -> None:
    (pod,) = node.get("pods", "-n", NS)["items"]
    assert pod["status"]["phase"] == "Running"
    assert pod["spec"]["containers"][0]["image"] == f"{PROJECT[0]}:{PROJECT[1]}"
    assert pod["spec"]["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True
    assert (
        pod["spec"]["serviceAccountName"]
        == operator["spec"]["template"]["spec"]["serviceAccountName"]
    )


def test_the_sample_pool_renders_and_waits_for_gpus(
    node: NodeCluster, operator: dict[str, Any]
) -> None:
    """The user's first step. Its engines ask for GPUs this node does not have: the real
    scheduler keeps them Pending and says why."""
    node.kubectl("apply", "-f", str(REPO / "manifests" / "samples" / "small.yaml"))
    found = node.wait_for(
        "the operator to render the sample pool",
        lambda: d if len(d := _deployments(node, "small")) >= 3 else {},
        timeout=120,
    )
    assert sorted(_role(d) for d in found.values()) == ["decode", "prefill", "router"]

    def unschedulable() -> list[str]:
        pods = node.get("pods", "-n", "default", "-l", "disaggpool.io/role=prefill")["items"]
        return [
            c.get("message", "")
            for p in pods
            for c in p["status"].get("conditions", [])
            if c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable"
        ]

    messages = node.wait_for("the scheduler's verdict", unschedulable, timeout=120)
    assert "nvidia.com/gpu" in messages[0], messages
    _delete_pool(node, "small")


def test_a_cpu_pool_runs_calibrates_and_serves_through_its_router(
    node: NodeCluster, operator: dict[str, Any]
) -> None:
    node.kubectl("apply", "-f", "-", stdin=json.dumps(CPU_POOL))

    def calibrated() -> dict[str, Any]:
        status = node.get("dpool", "-n", "default", "cpu").get("status") or {}
        return status if status.get("calibratedPods") == 3 else {}

    status = node.wait_for("3 calibrated engine pods", calibrated, timeout=600, every=2)
    conds = {c["type"]: c["status"] for c in status["conditions"]}
    assert conds.get("Ready") == "True", status

    pods = node.get("pods", "-n", "default", "-l", "disaggpool.io/pool=cpu")["items"]
    engines = [p for p in pods if p["metadata"]["labels"].get("disaggpool.io/role")]
    assert sorted(p["metadata"]["labels"]["disaggpool.io/role"] for p in engines) == [
        "decode", "decode", "prefill",
    ]  # fmt: skip
    for p in engines:
        assert p["status"]["phase"] == "Running"
        assert p["spec"]["containers"][0]["command"] == ["vllm"]
        limits = p["spec"]["containers"][0].get("resources", {}).get("limits", {})
        assert "nvidia.com/gpu" not in limits
    jobs = node.get("jobs", "-n", "default", "-l", "disaggpool.io/pool=cpu")["items"]
    probed = {j["metadata"]["labels"]["disaggpool.io/pod"] for j in jobs}
    assert probed == {p["metadata"]["name"] for p in engines}
    assert all(j["status"].get("succeeded") == 1 for j in jobs)

    def ready_routers() -> list[dict[str, Any]]:
        pods = node.get("pods", "-n", "default", "-l", "disaggpool.io/pool=cpu")["items"]
        return [
            p
            for p in pods
            if "disaggpool.io/role" not in p["metadata"]["labels"]
            and any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in p["status"].get("conditions", [])
            )
        ]

    router = node.wait_for("a Ready router pod", ready_routers, timeout=120)[0]
    assert router["status"]["podIP"].startswith(POD_SUBNET.rsplit(".", 2)[0])
    body = {"model": "qwen", "prompt": "hello " * 50, "max_tokens": 8, "ignore_eos": True}
    req = urllib.request.Request(
        f"http://{router['status']['podIP']}:8000/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        out = json.loads(resp.read())
    assert out["usage"]["completion_tokens"] == 8
    assert out["choices"][0]["finish_reason"] == "length"
    _delete_pool(node, "cpu")


def test_helm_uninstall_removes_the_operator(node: NodeCluster, operator: dict[str, Any]) -> None:
    node.helm("uninstall", "dp", "--namespace", NS, "--wait")
    node.wait_for("the operator pod to go", lambda: not node.get("pods", "-n", NS)["items"])
