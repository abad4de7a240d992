"""The test node itself: a real kubelet runs the project's image as the manifests ask (non-root,
read-only root filesystem), and every address stays inside 198.18.0.0/15."""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from node_cluster import (
    CONFINED,
    NODE_IP,
    NODE_NAME,
    POD_SUBNET,
    SERVICE_SUBNET,
    TOKEN,
    NodeCluster,
    ip_routes,
    left_by_a_killed_run,
    route_problems,
)

from disaggpool.kubeclient.paths import pod_ready

EMULATOR_POD = {
    "apiVersion": "v1",
    "kind": "Pod",
    "metadata": {"name": "emulator", "namespace": "default"},
    "spec": {
        "securityContext": {"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532},
        "containers": [
            {
                "name": "engine",
                "image": "disaggpool.local/disaggpool:test",
                "imagePullPolicy": "Never",
                "command": ["disaggpool", "emulate", "--profile", "a40-qwen2.5-3b"],
                "args": ["--host", "0.0.0.0", "--port", "8000"],
                "securityContext": {
                    "readOnlyRootFilesystem": True,
                    "allowPrivilegeEscalation": False,
                    "capabilities": {"drop": ["ALL"]},
                },
                "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
                "readinessProbe": {
                    "httpGet": {"path": "/health", "port": 8000},
                    "periodSeconds": 1,
                },
            }
        ],
        "volumes": [{"name": "tmp", "emptyDir": {}}],
    },
}


def _route(dst: str, dev: str, gateway: str | None = None) -> dict[str, str]:
    return {"dst": dst, "dev": dev, **({"gateway": gateway} if gateway else {})}


def test_route_rules_name_what_would_leave_the_machine() -> None:
    host = [
        _route("default", "eth0", "192.0.2.1"),
        _route("192.0.2.0/24", "eth0"),
        _route(POD_SUBNET, "dpool0"),
        _route(CONFINED, "dpool0"),
    ]
    assert route_problems(host, pod=False) == []
    assert route_problems(host[:3], pod=False) == [f"host does not route {CONFINED} to dpool0"]
    leak = [*host, _route("198.19.7.0/24", "eth0")]
    assert route_problems(leak, pod=False) == [
        f"host route 198.19.7.0/24 via eth0 overlaps {CONFINED}"
    ]
    pod = [_route(POD_SUBNET, "eth0"), _route(CONFINED, "eth0", NODE_IP)]
    assert route_problems(pod, pod=True) == []
    assert route_problems([*pod, _route("default", "eth0", NODE_IP)], pod=True) == [
        f"pod route to default leaves {CONFINED}"
    ]
    assert route_problems(pod[:1], pod=True) == [f"pod has no route for {CONFINED}"]


def test_a_node_a_killed_run_left_is_cleared_and_a_live_one_refused(tmp_path: Path) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / "pids").write_text(f"{dead.pid} etcd\n")
    assert left_by_a_killed_run(f"{dead.pid} {tmp_path}") == tmp_path
    (tmp_path / "pids").write_text(f"{dead.pid} etcd\n{os.getpid()} kubelet\n")
    with pytest.raises(RuntimeError, match=f"the test node in {tmp_path} is up"):
        left_by_a_killed_run(f"{dead.pid} {tmp_path}")
    (tmp_path / "pids").unlink()
    with pytest.raises(RuntimeError, match="is up"):  # its starter is still spawning
        left_by_a_killed_run(f"{os.getpid()} {tmp_path}")
    with pytest.raises(RuntimeError, match="another test node is up"):  # no owner named
        left_by_a_killed_run("")


def test_the_host_routes_the_whole_range_to_the_bridge(node: NodeCluster) -> None:
    assert route_problems(ip_routes(), pod=False) == []


def test_the_node_registers_at_its_bridge_address(node: NodeCluster) -> None:
    doc = node.get("node", NODE_NAME)
    addresses = {a["type"]: a["address"] for a in doc["status"]["addresses"]}
    assert addresses["InternalIP"] == NODE_IP
    assert doc["status"]["nodeInfo"]["containerRuntimeVersion"].startswith("containerd://1.6")
    assert doc["status"]["nodeInfo"]["kubeletVersion"] == "v1.20.2"
    svc = node.get("service", "kubernetes", "-n", "default")
    assert ipaddress.ip_address(svc["spec"]["clusterIP"]) in ipaddress.ip_network(SERVICE_SUBNET)


@pytest.fixture(scope="module")
def emulator(node: NodeCluster) -> dict[str, Any]:
    node.kubectl("apply", "-f", "-", stdin=json.dumps(EMULATOR_POD))
    node.wait_for("the emulator pod to be Ready", lambda: _ready(node, "emulator"), timeout=240)
    return node.get("pod", "-n", "default", "emulator")


def _ready(node: NodeCluster, pod: str) -> bool:
    return pod_ready(node.get("pod", "-n", "default", pod))


def test_a_pod_runs_the_image_unprivileged_on_a_read_only_root(
    node: NodeCluster, emulator: dict[str, Any]
) -> None:
    pid = node.container_pid("default", "emulator", "engine")
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    status = dict(line.split(":", 1) for line in lines if ":" in line)
    assert status["Uid"].split() == ["65532"] * 4
    root = [
        line.split()
        for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines()
        if line.split()[4] == "/"
    ]
    assert root and "ro" in root[-1][5].split(","), root


def test_a_pod_is_reachable_at_its_address_and_routes_only_the_range(
    node: NodeCluster, emulator: dict[str, Any]
) -> None:
    ip = emulator["status"]["podIP"]
    assert ipaddress.ip_address(ip) in ipaddress.ip_network(POD_SUBNET)
    with urllib.request.urlopen(f"http://{ip}:8000/v1/models", timeout=10) as resp:
        models = json.loads(resp.read())
    assert models["data"][0]["id"] == "Qwen/Qwen2.5-3B"
    pid = node.container_pid("default", "emulator", "engine")
    routes = ip_routes(pid)
    assert route_problems(routes, pod=True) == []
    assert {r["dst"] for r in routes} == {POD_SUBNET, CONFINED}


def test_a_pod_reaches_the_api_server_through_its_service(
    node: NodeCluster, emulator: dict[str, Any]
) -> None:
    """What the operator pod does: the in-cluster address (kube-proxy's rules on this node)."""
    cluster_ip = node.get("service", "kubernetes", "-n", "default")["spec"]["clusterIP"]
    pid = node.container_pid("default", "emulator", "engine")
    probe = (
        "import json, ssl, urllib.request as u; c = ssl._create_unverified_context(); "
        f"r = u.Request('https://{cluster_ip}/version', "
        f"headers={{'Authorization': 'Bearer {TOKEN}'}}); "
        "print(json.loads(u.urlopen(r, context=c, timeout=10).read())['gitVersion'])"
    )
    out = subprocess.run(
        ["nsenter", "-t", str(pid), "-n", sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.stdout.strip() == "v1.20.2", out.stderr
