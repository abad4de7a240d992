"""The plain-manifest install (`kubectl apply -f manifests/`, no Helm) on the real node: the
manifests run unchanged, the locally built image tagged as the reference they name, as a user
without a registry would load it."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from images import PROJECT
from node_cluster import NodeCluster

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = REPO / "manifests"


def _operator_image() -> str:
    doc = next(d for d in yaml.safe_load_all((MANIFESTS / "03-operator.yaml").read_text()) if d)
    return str(doc["spec"]["template"]["spec"]["containers"][0]["image"])


def test_kubectl_apply_of_the_manifests_runs_the_operator(node: NodeCluster) -> None:
    image = _operator_image()
    node.ctr("images", "tag", "--force", f"{PROJECT[0]}:{PROJECT[1]}", image)
    node.kubectl("apply", "-f", str(MANIFESTS))
    node.kubectl(
        "rollout", "status", "-n", "disaggpool-system", "deployment/disaggpool-operator",
        "--timeout=240s",
    )  # fmt: skip
    (pod,) = node.get("pods", "-n", "disaggpool-system")["items"]
    assert pod["spec"]["containers"][0]["image"] == image
    assert pod["status"]["phase"] == "Running"

    node.kubectl("apply", "-f", str(MANIFESTS / "samples" / "small.yaml"))

    def rendered() -> dict[str, str]:
        items = node.get("deployments", "-n", "default", "-l", "disaggpool.io/pool=small")["items"]
        return {d["metadata"]["name"]: json.dumps(d) for d in items} if len(items) >= 3 else {}

    assert len(node.wait_for("the operator to render the sample pool", rendered, timeout=120)) == 3
    node.kubectl("delete", "dpool", "-n", "default", "small", "--wait=true", "--timeout=120s")
    node.wait_for(
        "the sample pool's objects to go",
        lambda: (
            not node.get("deployments", "-n", "default", "-l", "disaggpool.io/pool=small")["items"]
        ),
        timeout=120,
    )
    # The operator and its RBAC go; the CRD and the namespace stay, as after `helm uninstall`.
    for name in ("03-operator.yaml", "02-rbac.yaml"):
        node.kubectl("delete", "-f", str(MANIFESTS / name), "--wait=true", "--timeout=120s")
    node.wait_for(
        "the operator pod to go", lambda: not node.get("pods", "-n", "disaggpool-system")["items"]
    )
