"""Time from `kubectl apply` of a pool to all its pods Ready and to all of them calibrated, on the
real test node (tests/cluster/node_cluster.py: kubelet, containerd, runc; docs/test-node.md).

The operator runs as a pod from `helm install`; the pools are CPU pools (`gpus: 0`) whose engine
pods run the emulator behind the image's `vllm` (tests/cluster/vllm_shim.py), each probed by a
calibration Job with a 10 s budget. For each size, in order: apply, poll every 0.5 s until every
engine pod and the router pod are Ready, then until the status counts every engine pod
calibrated; delete the pool and wait for its pods to go before the next size. Needs root and
`bash scripts/k8s_env.sh`.

    sudo .venv/bin/python bench/pool_startup.py [--sizes 1x2,2x6] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "cluster"))

from images import PROJECT  # noqa: E402
from node_cluster import NodeCluster, running_node, unavailable  # noqa: E402
from operator_node_kit import CPU_POOL  # noqa: E402

from benchutil import cpu_model  # noqa: E402
from disaggpool.kubeclient.paths import pod_ready  # noqa: E402


def _time_pool(
    node: NodeCluster, prefill: int, decode: int
) -> tuple[dict[str, float], dict[str, str]]:
    name = f"p{prefill}x{decode}"
    pool = json.loads(json.dumps(CPU_POOL))
    pool["metadata"]["name"] = name
    pool["spec"]["prefill"]["replicas"] = prefill
    pool["spec"]["decode"]["replicas"] = decode
    t0 = time.monotonic()
    node.kubectl("apply", "-f", "-", stdin=json.dumps(pool))
    out: dict[str, float] = {}
    while "calibrated_s" not in out:
        if time.monotonic() - t0 > 1200:
            raise RuntimeError(f"{name}: not calibrated after 20 min")
        pods = node.get("pods", "-n", "default", "-l", f"disaggpool.io/pool={name}")["items"]
        engines = [p for p in pods if p["metadata"]["labels"].get("disaggpool.io/role")]
        routers = [
            p for p in pods if p["metadata"]["labels"].get("disaggpool.io/component") == "router"
        ]
        serving = engines + routers
        if (
            "ready_s" not in out
            and len(engines) == prefill + decode
            and routers
            and all(map(pod_ready, serving))
        ):
            out["ready_s"] = time.monotonic() - t0
        status = node.get("dpool", "-n", "default", name).get("status") or {}
        if status.get("calibratedPods") == prefill + decode:
            out["calibrated_s"] = time.monotonic() - t0
        time.sleep(0.5)
    out["ready_s"] = out.get("ready_s", out["calibrated_s"])
    # What a user sees at that moment (docs/install.md).
    shown = {
        "kubectl get dpool": node.kubectl("get", "dpool", "-n", "default", name),
        "kubectl get pods": node.kubectl(
            "get", "pods", "-n", "default", "-l", f"disaggpool.io/pool={name}", "-o", "wide"
        ),
    }
    node.kubectl("delete", "dpool", "-n", "default", name, "--wait=true", "--timeout=300s")
    node.wait_for(
        f"{name}'s pods to go",
        lambda: not node.get("pods", "-n", "default", "-l", f"disaggpool.io/pool={name}")["items"],
        timeout=300,
    )
    return out, shown


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1x2,2x6", help="PxD pool sizes, comma-separated")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    why = unavailable()
    if why:
        print(f"skipped: {why}")
        return 0
    sizes = [tuple(int(x) for x in s.split("x")) for s in args.sizes.split(",")]
    results: list[dict[str, Any]] = []
    with running_node(Path(tempfile.mkdtemp(prefix="dp-node-"))) as node:
        node.helm(
            "install", "dp", str(REPO / "helm" / "disaggpool"), "-n", "disaggpool-system",
            "--create-namespace", "--set", f"image.repository={PROJECT[0]}",
            "--set", f"image.tag={PROJECT[1]}", "--set", "image.pullPolicy=Never",
            "--set", "operator.resyncSeconds=5",
        )  # fmt: skip
        (op,) = node.get("deployments", "-n", "disaggpool-system")["items"]
        node.kubectl(
            "rollout", "status", "-n", "disaggpool-system",
            f"deployment/{op['metadata']['name']}", "--timeout=300s",
        )  # fmt: skip
        for prefill, decode in sizes:
            timing, shown = _time_pool(node, prefill, decode)
            rounded = {k: round(v, 1) for k, v in timing.items()}
            row = {"prefill": prefill, "decode": decode, **rounded, "shown": shown}
            print({k: v for k, v in row.items() if k != "shown"}, flush=True)
            for command, text in shown.items():
                print(f"$ {command}\n{text}")
            results.append(row)
    doc = {"machine": cpu_model(), "pools": results}
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
