"""Active/passive routers on the node: a gateway-mode pool with two router replicas, as the
operator renders it (leader election on the pool's Lease with the timings of
`router.leaderElection`, the router's Role on that Lease and on its Service's Endpoints), whose
pods the kubelet runs. Both replicas are Ready; the one holding the Lease points the Service's
Endpoints at itself, so the traffic goes there. The leader's process is killed (SIGKILL: no
release) and the standby takes over once the lease runs out; the new leader's pod is deleted
(SIGTERM: it releases) and the restarted first replica takes over at its next try; a config
change rolls both replicas to completion with no request lost. Each failover is timed on the
node and printed; the bounds are correctness bounds derived from the lease timings, not speed
targets. docs/high-availability.md has the figures and the command.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from completions import complete
from node_cluster import NodeCluster
from operator_node_kit import CPU_POOL

from disaggpool.core.lease import LeaseTimings
from disaggpool.kubeclient.paths import pod_ready

REPO = Path(__file__).resolve().parents[2]
INFERENCE_POOL_CRD = REPO / "tests" / "operator" / "fixtures" / "inferencepool-crd.yaml"
POOL = "ha"
LEASE = f"{POOL}-router-leader"
#: `router.leaderElection`, not the sidecar's defaults (lease 15 s): a failover that took the
#: default lease would fail the bounds below, so they show the field reaches the replicas.
TIMINGS = LeaseTimings(lease_duration_s=8, renew_deadline_s=5.0, retry_period_s=1.0)
SLACK_S = 3.0  # polling with kubectl, the endpoints' mirroring, two busy cores


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
        "leaderElection": {
            "leaseDurationSeconds": TIMINGS.lease_duration_s,
            "renewDeadlineSeconds": TIMINGS.renew_deadline_s,
            "retryPeriodSeconds": TIMINGS.retry_period_s,
        },
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


def _pointed_at(node: NodeCluster) -> list[str]:
    """The addresses the router Service's Endpoints hold (the leader writes its own)."""
    ep = node.get("endpoints", "-n", "default", f"{POOL}-router")
    return [a["ip"] for sub in ep.get("subsets") or [] for a in sub.get("addresses") or []]


def _one_leader(node: NodeCluster) -> tuple[str, str] | None:
    """(the leader's pod, the standby's) once both routers are Ready, one holds the Lease and
    the Service's Endpoints name it alone."""
    routers = _routers(node)
    holder = _pod_of(_holder(node))
    if len(routers) != 2 or not all(pod_ready(p) for p in routers.values()):
        return None
    if holder not in routers or _pointed_at(node) != [routers[holder]["status"]["podIP"]]:
        return None
    (standby,) = [n for n in routers if n != holder]
    return holder, standby


def _time_failover(node: NodeCluster, to: str, act: Any) -> tuple[float, float]:
    """Seconds from `act()` until the Lease names pod `to`, and until the Service's Endpoints
    hold its address alone."""
    ip = node.get("pod", "-n", "default", to)["status"]["podIP"]
    start = time.monotonic()
    act()
    took_lease = took_endpoints = 0.0
    deadline = start + TIMINGS.lease_duration_s + 60
    while time.monotonic() < deadline and not (took_lease and took_endpoints):
        now = time.monotonic() - start
        if not took_lease and _pod_of(_holder(node)) == to:
            took_lease = now
        if took_lease and not took_endpoints and _pointed_at(node) == [ip]:
            took_endpoints = time.monotonic() - start
        time.sleep(0.2)
    assert took_lease and took_endpoints, f"{to} did not take over: holder {_holder(node)!r}"
    return took_lease, took_endpoints


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
    assert before["leaseDurationSeconds"] == TIMINGS.lease_duration_s  # the pool's, not 15 s
    # The standby must have seen the leader's latest renewal: let it try a few times.
    time.sleep(2 * TIMINGS.retry_period_s)
    pid = node.container_pid("default", leader, "router")
    took_lease, took_endpoints = _time_failover(node, standby, lambda: os.kill(pid, signal.SIGKILL))
    print(
        f"\n[cluster] leader {leader} killed (SIGKILL): {standby} holds the Lease after "
        f"{took_lease:.1f} s, the Service's Endpoints after {took_endpoints:.1f} s "
        f"(lease {TIMINGS.lease_duration_s:g} s, retry {TIMINGS.retry_period_s:g} s)"
    )
    # Never before the lease can have run out (the last renewal was at most a retry period
    # before the kill), and no later than a lease, a retry period and slack after the kill.
    assert took_lease >= TIMINGS.lease_duration_s - TIMINGS.retry_period_s - 1.0
    assert took_lease <= TIMINGS.lease_duration_s + TIMINGS.retry_period_s + SLACK_S
    assert took_endpoints <= took_lease + SLACK_S  # written in the same step
    after = node.get("lease", "-n", "default", LEASE)["spec"]
    assert after["leaseTransitions"] == before["leaseTransitions"] + 1
    # The killed container is restarted in its pod as a new candidate: a Ready standby.
    node.wait_for(
        f"{leader} restarted and Ready as a standby",
        lambda: (
            (p := _routers(node).get(leader))
            and any(s.get("restartCount", 0) >= 1 for s in p["status"].get("containerStatuses", []))
            and pod_ready(p)
            and _pod_of(_holder(node)) == standby
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
    took_lease, took_endpoints = _time_failover(
        node, first, lambda: node.kubectl("delete", "pod", "-n", "default", leader, "--wait=false")
    )
    print(
        f"\n[cluster] leader {leader} deleted (SIGTERM, lease released): {first} holds the "
        f"Lease after {took_lease:.1f} s, the Service's Endpoints after {took_endpoints:.1f} s"
    )
    # Released: no expiry waited for, only the standby's next try.
    assert took_lease <= TIMINGS.retry_period_s + SLACK_S
    assert took_endpoints <= took_lease + SLACK_S


def test_a_config_change_rolls_both_replicas_and_loses_no_request(
    node: NodeCluster, ha_pool: tuple[str, str]
) -> None:
    """Every healthy replica is Ready, so the Deployment's rolling update proceeds (a standby
    that is never Ready would leave it waiting for ever on the old leader), and the leader's
    hand-over on SIGTERM keeps the Service answering throughout."""
    node.wait_for("a leader and a Ready standby", lambda: _one_leader(node), timeout=180)
    old = set(_routers(node))
    ip = node.get("service", "-n", "default", f"{POOL}-router")["spec"]["clusterIP"]
    outcomes: list[str] = []
    stop = threading.Event()

    def client() -> None:  # a request every 0.3 s through the Service, as a client sends them
        while not stop.is_set():
            try:
                out = complete(ip, "qwen", "hello " * 20, 4)
                outcomes.append("ok" if out["usage"]["completion_tokens"] == 4 else repr(out))
            except Exception as exc:  # every failure is the finding: kept, then asserted on
                outcomes.append(f"{type(exc).__name__}: {exc}")
            time.sleep(0.3)

    runner = threading.Thread(target=client, daemon=True)
    runner.start()
    try:
        time.sleep(2)
        start = time.monotonic()
        patch = {"spec": {"router": {"scrapeIntervalSeconds": 0.5}}}  # a new router config
        node.kubectl("patch", "dpool", "-n", "default", POOL, "--type=merge", "-p",
                     json.dumps(patch))  # fmt: skip
        node.kubectl("rollout", "status", f"deployment/{POOL}-router", "-n", "default",
                     "--timeout=240s")  # fmt: skip
        rolled = time.monotonic() - start
        new = node.wait_for("a new leader and standby", lambda: _one_leader(node), timeout=60)
        time.sleep(2)
    finally:
        stop.set()
        runner.join(timeout=30)
    failed = [o for o in outcomes if o != "ok"]
    print(
        f"\n[cluster] config change rolled both routers in {rolled:.1f} s; {len(outcomes)} "
        f"requests through the Service meanwhile, {len(failed)} failed; leader now {new[0]}"
    )
    assert not set(new) & old, (new, old)  # both replicas replaced, one of them leads
    assert len(outcomes) >= 10 and not failed, failed
