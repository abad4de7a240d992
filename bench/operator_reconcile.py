"""Reconcile time of a 16-pod pool (8 prefill + 8 decode) against a real kube-apiserver 1.20.2.

Starts etcd + kube-apiserver + kube-controller-manager from scripts/k8s_env.sh's cache (the same
harness as tests/operator/k8s_cluster.py), then times single `reconcile` passes (the operator's
unit of work, no Kopf in the way) at each stage of a pool's life:

1. create: render and create every object of a fresh pool;
2. jobs: all 16 pods just turned Ready -> 16 calibration Jobs created, status written;
3. profiles: 16 profile ConfigMaps arrived -> adopted and summarised into status;
4. steady: nothing changed -> reads only (median of several passes).

    .venv/bin/python bench/operator_reconcile.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime as dt
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "operator"))

from k8s_cluster import binaries_missing, running_cluster  # noqa: E402
from operator_testkit import CRD_PATH, load_sample, ready_pod_status  # noqa: E402

from benchutil import cpu_model  # noqa: E402
from disaggpool.calibration import sinks  # noqa: E402
from disaggpool.core.hardware import builtin_profile  # noqa: E402
from disaggpool.kubeclient import Kube  # noqa: E402
from disaggpool.operator.reconcile import reconcile  # noqa: E402


async def run(repeats: int) -> dict[str, float]:
    with running_cluster(Path(tempfile.mkdtemp(prefix="dp-bench-")), [CRD_PATH]) as c:
        cr = load_sample("small.yaml")
        cr["metadata"]["name"] = "bench"
        cr["spec"]["prefill"]["replicas"] = 8
        cr["spec"]["decode"].update({"replicas": 8, "minReplicas": 8, "maxReplicas": 16})
        cr["spec"]["router"]["replicas"] = 0
        c.kubectl("apply", "-f", "-", stdin=json.dumps(cr))
        kube = Kube.from_environment(str(c.kubeconfig))
        out: dict[str, float] = {}

        async def timed(stage: str) -> None:
            t0 = time.perf_counter()
            await reconcile(kube, "default", "bench", default_image="disaggpool:bench")
            out[stage] = time.perf_counter() - t0

        await timed("create")
        pods: list[dict[str, object]] = []
        deadline = time.monotonic() + 120
        while len(pods) < 16 and time.monotonic() < deadline:
            doc = json.loads(
                c.kubectl("get", "pods", "-l", "disaggpool.io/pool=bench", "-o", "json")
            )
            pods = doc["items"]
            await asyncio.sleep(0.5)
        assert len(pods) == 16, f"controller manager made {len(pods)} pods"
        for i, pod in enumerate(pods):
            name = pod["metadata"]["name"]  # type: ignore[index]
            c.kubectl(
                "patch", "pod", name, "--subresource=status", "--type=merge",
                "-p", json.dumps({"status": ready_pod_status(f"10.244.1.{i + 1}")}),
            )  # fmt: skip
        await timed("jobs")
        import os

        os.environ.update(
            KUBERNETES_API=c.server,
            KUBERNETES_TOKEN="disaggpool-test-token",
            KUBERNETES_INSECURE="1",
        )
        fitted = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        # Only profiles owned by their pool count (as the probe Job writes them).
        uid = json.loads(c.kubectl("get", "dpool", "bench", "-o", "json"))["metadata"]["uid"]
        owner = sinks.pool_owner(f"bench/{uid}")
        for pod in pods:
            name = pod["metadata"]["name"]  # type: ignore[index]
            profile = dataclasses.replace(
                builtin_profile("a40-llama3-8b"), name=name, quality="good", fitted_at=fitted
            )
            labels = {"disaggpool.io/pool": "bench", "disaggpool.io/pod": name}
            labels["disaggpool.io/profile"] = "true"
            await asyncio.to_thread(
                lambda p=profile, n=name, lb=labels: sinks.write_configmap(
                    p, f"default/bench-profile-{n}", {}, lb, owner=owner
                )
            )
        await timed("profiles")
        steady = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            result = await reconcile(kube, "default", "bench", default_image="disaggpool:bench")
            steady.append(time.perf_counter() - t0)
            assert not result.changed or _ == 0, result
        out["steady"] = statistics.median(steady)
        status = json.loads(c.kubectl("get", "dpool", "bench", "-o", "json"))["status"]
        assert status["calibratedPods"] == 16, status["calibratedPods"]
        await kube.close()
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    why = binaries_missing()
    if why:
        sys.exit(f"cannot run: {why}")
    out = asyncio.run(run(args.repeats))
    print(f"machine: {cpu_model()}")
    print("| stage | one reconcile pass (s) |\n|---|---|")
    for stage, seconds in out.items():
        print(f"| {stage} | {seconds:.3f} |")


if __name__ == "__main__":
    main()
