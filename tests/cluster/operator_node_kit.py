"""What test_operator_on_node applies and reads back: the pools (`CPU_POOL`, the slow secured
`SLOW_POOL`), the pool's objects and pods as the node's API server lists them, the router pod's
address, the traces and `disaggpool loadgen` runs that load it, and the waits on the operator's
calibration and autoscaling status. bench/pool_startup.py applies `CPU_POOL` too."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml
from completions import complete
from images import EMULATED_ENGINE
from node_cluster import NodeCluster

from disaggpool.core.profile import CalibrationProfile, profile_from_dict
from disaggpool.kubeclient.paths import pod_ready
from disaggpool.labels import PROFILE_KEY
from disaggpool.operator.names import profile_configmap_name

#: 1 prefill + 2 decode on CPUs (`gpus: 0`). The engine image's `vllm` runs the emulator with
#: the command line the operator renders (vllm_shim.py), so the probe measures a real HTTP engine.
CPU_POOL = {
    "apiVersion": "disaggpool.io/v1alpha1",
    "kind": "DisaggPool",
    "metadata": {"name": "cpu", "namespace": "default"},
    "spec": {
        "model": {"name": "Qwen/Qwen2.5-3B", "servedModelName": "qwen", "maxModelLen": 4096},
        "engine": {
            "image": f"{EMULATED_ENGINE[0]}:{EMULATED_ENGINE[1]}",
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


def pool_deployments(node: NodeCluster, pool: str) -> dict[str, dict[str, Any]]:
    items = node.get("deployments", "-n", "default", "-l", f"disaggpool.io/pool={pool}")["items"]
    return {d["metadata"]["name"]: d for d in items}


def role_of(obj: dict[str, Any]) -> str:
    return str(obj["spec"]["template"]["metadata"]["labels"].get("disaggpool.io/role", "router"))


def delete_pool(node: NodeCluster, pool: str) -> None:
    node.kubectl("delete", "dpool", "-n", "default", pool, "--wait=true", "--timeout=120s")
    node.wait_for(
        f"pool {pool}'s objects to be garbage-collected",
        lambda: (
            not pool_deployments(node, pool)
            and not node.get("pods", "-n", "default", "-l", f"disaggpool.io/pool={pool}")["items"]
        ),
        timeout=180,
    )


#: Engines that take longer to open their port than three of the router's liveness periods
#: (10 s each): a router whose liveness followed the pool's state would be restarted meanwhile.
SLOW_START_S = 45
ROUTER_LIVENESS_WINDOW_S = 30
API_KEY = "node-test-key-0123456789"

#: 1 prefill + 1 decode, slow to start, with every security option: restricted vLLM pods, the
#: pool's API key (engines, router, probe), a gRPC token, NetworkPolicies (the bridge CNI here
#: does not enforce them: their objects are what the real API server accepts).
SLOW_POOL = {
    "apiVersion": "disaggpool.io/v1alpha1",
    "kind": "DisaggPool",
    "metadata": {"name": "slow", "namespace": "default"},
    "spec": {
        "model": {"name": "Qwen/Qwen2.5-3B", "servedModelName": "qwen", "maxModelLen": 4096},
        "engine": {
            "image": f"{EMULATED_ENGINE[0]}:{EMULATED_ENGINE[1]}",
            "imagePullPolicy": "Never",
            "podSecurity": "restricted",
            "env": [
                {"name": "DISAGGPOOL_EMULATOR_PROFILE", "value": "a40-qwen2.5-3b"},
                {"name": "DISAGGPOOL_EMULATOR_STARTUP_DELAY", "value": str(SLOW_START_S)},
            ],
            "sharedMemory": "64Mi",
        },
        "prefill": {"replicas": 1, "gpus": 0},
        "decode": {"replicas": 1, "gpus": 0},
        "calibration": {"budgetSeconds": 10},
        "router": {"policy": "calibrated", "grpc": {"tokenSecret": {"name": "slow-grpc"}}},
        "auth": {"apiKeySecret": {"name": "slow-key"}},
        "networkPolicy": {"enabled": True},
    },
}


def proc_status(node: NodeCluster, pod: str, container: str) -> dict[str, str]:
    """/proc/PID/status of a running container's first process, as the kernel sees it."""
    pid = node.container_pid("default", pod, container)
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: v.strip() for k, _, v in (line.partition(":") for line in lines)}


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def engine_pods(node: NodeCluster) -> list[dict[str, Any]]:
    pods = node.get("pods", "-n", "default", "-l", "disaggpool.io/pool=cpu")["items"]
    return [p for p in pods if p["metadata"]["labels"].get("disaggpool.io/role")]


def decode_profiles(node: NodeCluster) -> list[CalibrationProfile]:
    """The profiles the probe wrote for the cpu pool's decode pods (the ones the router plans
    with: they are measured on this host, whose load slows the emulated steps)."""
    names = [
        p["metadata"]["name"]
        for p in engine_pods(node)
        if p["metadata"]["labels"]["disaggpool.io/role"] == "decode"
    ]
    maps = [node.get("configmap", "-n", "default", profile_configmap_name("cpu", n)) for n in names]
    return [
        profile_from_dict(yaml.safe_load(m["data"][PROFILE_KEY]), m["metadata"]["name"])
        for m in maps
    ]


def succeeded_jobs(node: NodeCluster, selector: str) -> list[dict[str, Any]]:
    """The probe Jobs matching `selector`, once every pod they probe has a succeeded one (a
    failed attempt, retried by the operator, may stay beside it)."""
    jobs = node.get("jobs", "-n", "default", "-l", selector)["items"]
    pods = {j["metadata"]["labels"]["disaggpool.io/pod"] for j in jobs}
    done = {
        j["metadata"]["labels"]["disaggpool.io/pod"]
        for j in jobs
        if j["status"].get("succeeded") == 1
    }
    return list(jobs) if jobs and done == pods else []


def router_pod_ip(node: NodeCluster) -> str:
    def ready_routers() -> list[dict[str, Any]]:
        pods = node.get("pods", "-n", "default", "-l", "disaggpool.io/component=router")["items"]
        return [
            p
            for p in pods
            if p["metadata"]["labels"].get("disaggpool.io/pool") == "cpu"
            and pod_ready(p)
            and not p["metadata"].get("deletionTimestamp")
        ]

    return str(
        node.wait_for("a Ready router pod", ready_routers, timeout=180)[0]["status"]["podIP"]
    )


def router_service_ip(node: NodeCluster) -> str:
    """The router Service's cluster IP: what clients use (kube-proxy's rules on this node)."""
    selector = "disaggpool.io/component=router,disaggpool.io/pool=cpu"
    (service,) = node.get("services", "-n", "default", "-l", selector)["items"]
    return str(service["spec"]["clusterIP"])


def complete_through(ip: str, tokens: int = 8) -> dict[str, Any]:
    return complete(ip, "qwen", "hello " * 50, tokens)


def bursty_trace(path: Path, n: int, burst: int = 10, every_s: float = 2.0) -> Path:
    """`n` requests of the router's default SLO class (`interactive`), in bursts of `burst`
    (within 0.5 s) every `every_s` seconds."""
    rows = ["arrival_s,prompt_tokens,output_tokens,slo_class"]
    for i in range(n):
        t = (i // burst) * every_s + (i % burst) * 0.05
        rows.append(f"{t:.3f},{200 + (i * 137) % 1300},{16 + (i * 29) % 48},interactive")
    path.write_text("\n".join(rows) + "\n")
    return path


def start_loadgen(ip: str, trace: Path, out: Path) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "disaggpool", "loadgen", "--target", f"http://{ip}:8000"]
    cmd += ["--trace", str(trace), "--slo", "interactive:5:0.5", "--json", str(out)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def loadgen_summary(proc: subprocess.Popen[str], out: Path) -> dict[str, Any]:
    log, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, log
    return dict(json.loads(out.read_text())["summary"])


def wait_calibrated_and_routed_to(node: NodeCluster, pod: str) -> None:
    """`pod` gets a calibrated profile from a succeeded probe Job, and the router sends it work."""

    def probed() -> bool:
        status = node.get("dpool", "-n", "default", "cpu").get("status") or {}
        states = {p["name"]: p["calibration"] for p in status.get("pods", [])}
        return states.get(pod) == "calibrated"

    node.wait_for(f"{pod} to be calibrated", probed, timeout=300, every=2)
    node.wait_for(
        f"{pod}'s probe Job to succeed",
        lambda: succeeded_jobs(node, f"disaggpool.io/pod={pod}"),
    )
    ip = router_pod_ip(node)
    pod_ip = node.get("pod", "-n", "default", pod)["status"]["podIP"]

    def served_by_pod() -> bool:
        complete_through(ip, tokens=4)
        with urllib.request.urlopen(f"http://{pod_ip}:8000/metrics", timeout=10) as resp:
            text = resp.read().decode()
        return any(
            line.startswith("vllm:request_success_total") and float(line.split()[-1]) > 0
            for line in text.splitlines()
        )

    node.wait_for(f"the router to route to {pod}", served_by_pod, timeout=120)


def decode_replicas(node: NodeCluster) -> int:
    (decode,) = [d for d in pool_deployments(node, "cpu").values() if role_of(d) == "decode"]
    return int(decode["spec"]["replicas"])


def autoscaling_status(node: NodeCluster) -> dict[str, Any]:
    return dict(
        (node.get("dpool", "-n", "default", "cpu").get("status") or {}).get("autoscaling") or {}
    )


def steady_trace(path: Path, n: int, rps: float, output_tokens: int) -> Path:
    rows = ["arrival_s,prompt_tokens,output_tokens,slo_class"]
    rows += [
        f"{i / rps:.3f},{200 + (i * 137) % 1300},{output_tokens},interactive" for i in range(n)
    ]
    path.write_text("\n".join(rows) + "\n")
    return path


def patch_rolling_the_router(node: NodeCluster, spec: dict[str, Any], what: str) -> None:
    """Merge `spec` into the pool's. It changes the router's config, so the router's Deployment
    rolls and the new pod starts a fresh traffic window: wait for that pod."""
    old = router_pod_ip(node)
    node.kubectl(
        "patch", "dpool", "-n", "default", "cpu", "--type=merge", "-p", json.dumps({"spec": spec})
    )  # fmt: skip
    node.wait_for(what, lambda: (new := router_pod_ip(node)) != old and new, timeout=180)


def wait_for_applied(node: NodeCluster, n: int, what: str, timeout: float) -> dict[str, Any]:
    """`status.autoscaling` once the operator has applied `n` decode replicas."""
    return dict(
        node.wait_for(
            what,
            lambda: s if (s := autoscaling_status(node)).get("replicas") == n else {},
            timeout=timeout,
            every=2,
        )
    )


def wait_for_decode_pods(node: NodeCluster, n: int) -> None:
    node.wait_for(
        f"{n} decode pods",
        lambda: (
            sum(
                p["metadata"]["labels"]["disaggpool.io/role"] == "decode" for p in engine_pods(node)
            )
            == n
        ),
        timeout=120,
    )
