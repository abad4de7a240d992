"""What the e2e modules (test_operator_e2e.py, test_operator_e2e_feedback.py) read from and play
on the real apiserver (k8s_cluster.Cluster): `kubectl get -o json`, the pods a selector lists, and
the kubelet's part (there is no kubelet: a pod's status is patched to Ready with its IP)."""

from __future__ import annotations

import json
from typing import Any

from k8s_cluster import Cluster
from operator_testkit import ready_pod_status


def kubectl_json(cluster: Cluster, *args: str) -> Any:
    return json.loads(cluster.kubectl("get", *args, "-o", "json"))


def list_pods(cluster: Cluster, ns: str, selector: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = kubectl_json(cluster, "pods", "-n", ns, "-l", selector)["items"]
    return items


def play_kubelet(cluster: Cluster, ns: str, pod: str, ip: str) -> None:
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
