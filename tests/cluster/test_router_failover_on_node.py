"""Active/passive routers on the node: a gateway-mode pool with two router replicas, as the
operator renders it (leader election on the pool's Lease, the router's Role on that Lease), whose
pods the kubelet runs. One replica is Ready and holds the Lease, the other stands by; the leader's
process is killed (SIGKILL: no release) and the standby takes over once the lease runs out; the
new leader's pod is deleted (SIGTERM: it releases) and the restarted first replica takes over at
its next try. Each failover is timed on the node and printed; the bounds are correctness bounds
derived from the lease timings (the sidecar's defaults: lease 15 s, renew deadline 10 s, retry
2 s) and the readiness probe's period (5 s), not speed targets. docs/high-availability.md has
the figures and the command.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from node_cluster import NodeCluster
from operator_node_kit import CPU_POOL

from disaggpool.core.lease import LeaseTimings
from disaggpool.kubeclient.paths import pod_ready

REPO = Path(__file__).resolve().parents[2]
INFERENCE_POOL_CRD = REPO / "tests" / "operator" / "fixtures" / "inferencepool-crd.yaml"
POOL = "ha"
LEASE = f"{POOL}-router-leader"
TIMINGS = LeaseTimings()  # what the operator renders: the sidecar's defaults
READINESS_PERIOD_S = 5.0  # the router's readinessProbe (operator/render.py)
SLACK_S = 3.0  # polling with kubectl, the kubelet's probe jitter, two busy cores


def _pool() -> dict[str, Any]:
    doc = json.loads(json.dumps(CPU_POOL))
    doc["metadata"]["name"] = POOL
    spec = doc["spec"]
    spec["decode"]["replicas"] = 1
    spec["calibration"] = {"enabled": False}  # readiness needs healthy engines, not profiles
    spec["router"] = {
        "policy": "least_loaded",
        "mode": "gateway",
        "replicas": 2,
        "grpc": {"tokenSecret": {"name": "ha-grpc"}},
    }
    return doc


def _routers(node: NodeCluster) -> dict[str, dict[str, Any]]:
    pods = node.get("pods", "-n", "default", "-l", f"disaggpool.io/pool={POOL}")["items"]
    return {
        p["metadata"]["name"]: p
        for p in pods
        if p["metadata"]["labels"].get("disaggpool.io/component") == "router"
        and not p["metadata"].get("deletionTimestamp")
    }


def _holder(node: NodeCluster) -> str:
    try:
        lease = node.get("lease", "-n", "default", LEASE)
    except AssertionError:  # not created yet
        return ""
    return str(lease["spec"].get("holderIdentity") or "")


def _pod_of(holder: str) -> str:
    """The pod a holder identity names (`<pod name>_<8 hex digits>`, sidecar.leader)."""
    return holder.rpartition("_")[0]


def _one_leader(node: NodeCluster) -> tuple[str, str] | None:
    """(the leader's pod, the standby's) once exactly one router is Ready and holds the Lease."""
    routers = _routers(node)
    ready = [name for name, p in routers.items() if pod_ready(p)]
    running = [n for n, p in routers.items() if p["status"].get("phase") == "Running"]
    holder = _pod_of(_holder(node))
    if len(routers) != 2 or len(running) != 2 or ready != [holder]:
        return None
    (standby,) = [n for n in routers if n != holder]
    return holder, standby


def _time_failover(node: NodeCluster, to: str, act: Any) -> tuple[float, float]:
    """Seconds from `act()` until the Lease names pod `to`, and until `to` is Ready."""
    start = time.monotonic()
    act()
    took_lease = took_ready = 0.0
    deadline = start + TIMINGS.lease_duration_s + 60
    while time.monotonic() < deadline and not (took_lease and took_ready):
        now = time.monotonic() - start
        if not took_lease and _pod_of(_holder(node)) == to:
            took_lease = now
        if took_lease and not took_ready and pod_ready(node.get("pod", "-n", "default", to)):
            took_ready = time.monotonic() - start
        time.sleep(0.2)
    assert took_lease and took_ready, f"{to} did not take over: holder {_holder(node)!r}"
    return took_lease, took_ready


@pytest.fixture(scope="module")
def ha_pool(node: NodeCluster, operator: dict[str, Any]) -> tuple[str, str]:
    node.kubectl("apply", "-f", str(INFERENCE_POOL_CRD))
    node.kubectl(
        "wait", "--for=condition=Established", "--timeout=60s", "-f", str(INFERENCE_POOL_CRD)
    )
    token = base64.b64encode(b"ha-grpc-token").decode()
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "ha-grpc", "namespace": "default"},
        "data": {"token": token},
    }
    node.kubectl("apply", "-f", "-", stdin=json.dumps(secret))
    node.kubectl("apply", "-f", "-", stdin=json.dumps(_pool()))
    return tuple(node.wait_for("one Ready router holding the Lease", lambda: _one_leader(node),
                               timeout=600, every=2))  # fmt: skip


def test_a_killed_leader_is_replaced_once_its_lease_runs_out(
    node: NodeCluster, ha_pool: tuple[str, str]
) -> None:
    leader, standby = ha_pool
    role = node.get("role", "-n", "default", f"{POOL}-router")
    assert {"resourceNames": [LEASE], "verbs": ["get", "update"]}.items() <= next(
        r for r in role["rules"] if r.get("resourceNames") == [LEASE]
    ).items()
    before = node.get("lease", "-n", "default", LEASE)["spec"]
    # The standby must have seen the leader's latest renewal: let it try a few times.
    time.sleep(2 * TIMINGS.retry_period_s)
    pid = node.container_pid("default", leader, "router")
    took_lease, took_ready = _time_failover(node, standby, lambda: os.kill(pid, signal.SIGKILL))
    print(
        f"\n[cluster] leader {leader} killed (SIGKILL): {standby} holds the Lease after "
        f"{took_lease:.1f} s, Ready after {took_ready:.1f} s "
        f"(lease {TIMINGS.lease_duration_s:g} s, retry {TIMINGS.retry_period_s:g} s, "
        f"readiness period {READINESS_PERIOD_S:g} s)"
    )
    # Never before the lease can have run out (the last renewal was at most a retry period
    # before the kill), and no later than a lease, a retry period and slack after the kill.
    assert took_lease >= TIMINGS.lease_duration_s - TIMINGS.retry_period_s - 1.0
    assert took_lease <= TIMINGS.lease_duration_s + TIMINGS.retry_period_s + SLACK_S
    assert took_ready <= took_lease + READINESS_PERIOD_S + SLACK_S
    after = node.get("lease", "-n", "default", LEASE)["spec"]
    assert after["leaseTransitions"] == before["leaseTransitions"] + 1
    # The killed container is restarted in its pod as a new candidate: it stands by.
    node.wait_for(
        f"{leader} restarted and standing by",
        lambda: (
            (p := _routers(node).get(leader))
            and p["status"].get("phase") == "Running"
            and any(s.get("restartCount", 0) >= 1 for s in p["status"].get("containerStatuses", []))
            and not pod_ready(p)
        ),
        timeout=120,
    )


def test_a_deleted_leader_releases_and_the_standby_takes_over_at_once(
    node: NodeCluster, ha_pool: tuple[str, str]
) -> None:
    first, leader = ha_pool  # after the kill above, the second pod leads
    assert _pod_of(_holder(node)) == leader
    # Let the restarted first replica's elector see the current record and start trying.
    time.sleep(3 * TIMINGS.retry_period_s)
    took_lease, took_ready = _time_failover(
        node, first, lambda: node.kubectl("delete", "pod", "-n", "default", leader, "--wait=false")
    )
    print(
        f"\n[cluster] leader {leader} deleted (SIGTERM, lease released): {first} holds the "
        f"Lease after {took_lease:.1f} s, Ready after {took_ready:.1f} s"
    )
    # Released: no expiry waited for, only the standby's next try.
    assert took_lease <= TIMINGS.retry_period_s + SLACK_S
    assert took_ready <= took_lease + READINESS_PERIOD_S + SLACK_S
