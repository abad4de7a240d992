"""The operator as users install it: `helm install` of the chart, the operator running as a pod
from the locally built image (non-root, read-only root filesystem, its own service account),
then pools: the sample a user applies first, and a CPU pool whose every pod runs here (engines,
calibration Jobs, router), with a request served through the router pod."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from completions import complete
from images import PROJECT
from node_cluster import OPERATOR_NAMESPACE as NS
from node_cluster import POD_SUBNET, NodeCluster
from operator_node_kit import (
    API_KEY,
    CPU_POOL,
    ROUTER_LIVENESS_WINDOW_S,
    SLOW_POOL,
    bursty_trace,
    complete_through,
    decode_profiles,
    decode_replicas,
    delete_pool,
    engine_pods,
    http_status,
    loadgen_summary,
    patch_rolling_the_router,
    pool_deployments,
    proc_status,
    role_of,
    router_pod_ip,
    router_service_ip,
    start_loadgen,
    steady_trace,
    succeeded_jobs,
    wait_calibrated_and_routed_to,
    wait_for_applied,
    wait_for_decode_pods,
)

from disaggpool.core.autoscaling import tpot_batch
from disaggpool.core.contracts import SLOClass
from disaggpool.formats.trace_request import TraceRequest
from disaggpool.kubeclient.paths import pod_ready
from disaggpool.loadgen import LoadReport, replay

REPO = Path(__file__).resolve().parents[2]


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
        lambda: d if len(d := pool_deployments(node, "small")) >= 3 else {},
        timeout=120,
    )
    assert sorted(role_of(d) for d in found.values()) == ["decode", "prefill", "router"]

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
    delete_pool(node, "small")


def test_a_slow_secured_pool_keeps_its_router_alive_and_serves_with_its_key(
    node: NodeCluster, operator: dict[str, Any]
) -> None:
    """The router's liveness is its own (/livez), not the pool's (/readyz): while the engines
    take longer than three liveness periods to open their ports the router is alive and not
    Ready, and it is never restarted. Then: restricted engine and router processes as the
    kernel runs them, a probe that calibrates with the pool's API key, and a router that wants
    the key from its clients and passes it on to the engines."""
    for name, key, value in (("slow-key", "api-key", API_KEY), ("slow-grpc", "token", "g" * 24)):
        node.kubectl(
            "create", "secret", "generic", name, "-n", "default", f"--from-literal={key}={value}"
        )
    node.kubectl("apply", "-f", "-", stdin=json.dumps(SLOW_POOL))
    selector = "disaggpool.io/pool=slow"

    def pods() -> list[dict[str, Any]]:
        return list(node.get("pods", "-n", "default", "-l", selector)["items"])

    def router() -> dict[str, Any]:
        found = [
            p for p in pods() if p["metadata"]["labels"].get("disaggpool.io/component") == "router"
        ]
        return found[0] if found else {}

    def running_router() -> dict[str, Any]:
        r = router()
        started = [c for c in r.get("status", {}).get("containerStatuses", []) if c["started"]]
        return r if started and r["status"].get("podIP") else {}

    r = node.wait_for("the router container to start", running_router, timeout=180)
    ip = r["status"]["podIP"]
    started_at = dt.datetime.fromisoformat(
        r["status"]["containerStatuses"][0]["state"]["running"]["startedAt"].replace("Z", "+00:00")
    )
    # While the engines load: alive, not ready, not restarted. Watched until both engines are
    # Ready, however long they take.
    seen_waiting = False

    def engines_ready() -> bool:
        nonlocal seen_waiting
        current = router()
        assert current["status"]["containerStatuses"][0]["restartCount"] == 0, current
        engines = [p for p in pods() if p["metadata"]["labels"].get("disaggpool.io/role")]
        ready = len(engines) == 2 and all(pod_ready(p) for p in engines)
        if not ready:
            assert http_status(f"http://{ip}:8000/livez") == 200
            if http_status(f"http://{ip}:8000/readyz") == 503:
                seen_waiting = True
                assert not pod_ready(current)
        return ready

    node.wait_for("both slow engines to be Ready", engines_ready, timeout=300, every=2)
    waited = (dt.datetime.now(dt.UTC) - started_at).total_seconds()
    assert seen_waiting and waited > ROUTER_LIVENESS_WINDOW_S, waited

    def router_ready() -> dict[str, Any]:
        current = router()
        return current if pod_ready(current) else {}

    current = node.wait_for("the router to turn Ready", router_ready, timeout=120)
    assert current["status"]["containerStatuses"][0]["restartCount"] == 0

    # Restricted, as the kernel applies it: non-root, no capabilities, a seccomp filter, no new
    # privileges; for the router and for a vLLM pod rendered with engine.podSecurity.
    engine = next(p for p in pods() if p["metadata"]["labels"].get("disaggpool.io/role"))
    for pod, container in ((current, "router"), (engine, "vllm")):
        st = proc_status(node, pod["metadata"]["name"], container)
        assert st["Uid"].split()[0] == "65532", (container, st["Uid"])
        assert st["CapEff"] == "0000000000000000", (container, st["CapEff"])
        assert st["Seccomp"] == "2" and st["NoNewPrivs"] == "1", (container, st)
    assert engine["spec"]["automountServiceAccountToken"] is False

    # The probe calibrates both engines, which require the key; the router needs it too.
    def calibrated() -> dict[str, Any]:
        status = node.get("dpool", "-n", "default", "slow").get("status") or {}
        return status if status.get("calibratedPods") == 2 else {}

    node.wait_for("both slow engines calibrated", calibrated, timeout=300, every=2)
    with pytest.raises(urllib.error.HTTPError) as refused:
        complete(ip, "qwen", "hello " * 20, 4)
    assert refused.value.code == 401
    out = complete(ip, "qwen", "hello " * 20, 4, api_key=API_KEY)
    assert out["usage"]["completion_tokens"] == 4
    engine_ip = engine["status"]["podIP"]
    with pytest.raises(urllib.error.HTTPError) as direct:
        complete(engine_ip, "qwen", "hello", 2)  # the engine itself wants the key
    assert direct.value.code == 401
    routers = f"{selector},disaggpool.io/component=router"
    (service,) = node.get("services", "-n", "default", "-l", routers)["items"]
    assert {p["name"] for p in service["spec"]["ports"]} == {"http", "grpc"}
    policies = node.get("networkpolicies", "-n", "default", "-l", selector)["items"]
    assert sorted(p["metadata"]["name"] for p in policies) == [
        "slow-engines", "slow-probe", "slow-router",
    ]  # fmt: skip
    assert router()["status"]["containerStatuses"][0]["restartCount"] == 0
    delete_pool(node, "slow")
    node.kubectl("delete", "secret", "-n", "default", "slow-key", "slow-grpc")


@pytest.fixture(scope="module")
def cpu_pool(node: NodeCluster, operator: dict[str, Any]) -> dict[str, Any]:
    node.kubectl("apply", "-f", "-", stdin=json.dumps(CPU_POOL))

    def calibrated() -> dict[str, Any]:
        status = node.get("dpool", "-n", "default", "cpu").get("status") or {}
        return status if status.get("calibratedPods") == 3 else {}

    return dict(node.wait_for("3 calibrated engine pods", calibrated, timeout=600, every=2))


def test_a_cpu_pool_runs_calibrates_and_serves_through_its_router(
    node: NodeCluster, cpu_pool: dict[str, Any]
) -> None:
    conds = {c["type"]: c["status"] for c in cpu_pool["conditions"]}
    assert conds.get("Ready") == "True", cpu_pool
    engines = engine_pods(node)
    assert sorted(p["metadata"]["labels"]["disaggpool.io/role"] for p in engines) == [
        "decode", "decode", "prefill",
    ]  # fmt: skip
    for p in engines:
        assert p["status"]["phase"] == "Running"
        assert p["spec"]["containers"][0]["command"] == ["vllm"]
        limits = p["spec"]["containers"][0].get("resources", {}).get("limits", {})
        assert "nvidia.com/gpu" not in limits
    # A probe writes its profile before it exits: the Job may still be finishing.
    jobs = node.wait_for(
        "every probe Job to succeed", lambda: succeeded_jobs(node, "disaggpool.io/pool=cpu")
    )
    probed = {j["metadata"]["labels"]["disaggpool.io/pod"] for j in jobs}
    assert probed == {p["metadata"]["name"] for p in engines}

    ip = router_pod_ip(node)
    assert ip.startswith(POD_SUBNET.rsplit(".", 2)[0])
    out = complete_through(ip)
    assert out["usage"]["completion_tokens"] == 8
    assert out["choices"][0]["finish_reason"] == "length"


def test_loadgen_replays_a_bursty_trace_through_the_router_pod(
    node: NodeCluster, cpu_pool: dict[str, Any], tmp_path: Path
) -> None:
    trace = bursty_trace(tmp_path / "bursts.csv", 40)
    summary = loadgen_summary(
        start_loadgen(router_pod_ip(node), trace, tmp_path / "run.json"), tmp_path / "run.json"
    )
    print(f"\n[cluster] loadgen through the router pod: {summary}")
    assert summary["requests"] == 40
    assert summary["errors"] == 0, summary["errors_by_status"]
    assert summary["completed"] == 40
    assert 0.0 <= summary["goodput"] <= 1.0


def test_a_decode_pod_deleted_mid_run_loses_no_request_and_is_replaced(
    node: NodeCluster, cpu_pool: dict[str, Any], tmp_path: Path
) -> None:
    before = {p["metadata"]["name"] for p in engine_pods(node)}
    victim = sorted(
        p["metadata"]["name"]
        for p in engine_pods(node)
        if p["metadata"]["labels"]["disaggpool.io/role"] == "decode"
    )[0]
    trace = bursty_trace(tmp_path / "bursts.csv", 60, every_s=1.5)
    run = start_loadgen(router_pod_ip(node), trace, tmp_path / "run.json")
    time.sleep(3)
    node.kubectl("delete", "pod", "-n", "default", victim, "--grace-period=0", "--force")
    summary = loadgen_summary(run, tmp_path / "run.json")
    print(f"\n[cluster] loadgen with {victim} deleted mid-run: {summary}")
    # Every request is accounted for: it completed (elsewhere, if need be) or got an HTTP error;
    # none was dropped without an answer.
    assert summary["requests"] == 60
    assert summary["completed"] + summary["errors"] == 60
    assert "no response" not in summary["errors_by_status"], summary["errors_by_status"]

    def replacement() -> str:
        now = {p["metadata"]["name"]: p for p in engine_pods(node)}
        new = [n for n, p in now.items() if n not in before and pod_ready(p)]
        return new[0] if len(now) == 3 and new else ""

    new_pod = node.wait_for("the replacement decode pod", replacement, timeout=180)
    wait_calibrated_and_routed_to(node, new_pod)


def test_a_killed_router_pod_is_replaced_and_traffic_resumes(
    node: NodeCluster, cpu_pool: dict[str, Any]
) -> None:
    old_ip = router_pod_ip(node)
    (old,) = [
        p["metadata"]["name"]
        for p in node.get("pods", "-n", "default", "-l", "disaggpool.io/component=router")["items"]
        if p["status"].get("podIP") == old_ip
    ]
    node.kubectl("delete", "pod", "-n", "default", old, "--grace-period=0", "--force")
    new_ip = node.wait_for(
        "a new Ready router pod",
        lambda: (ip := router_pod_ip(node)) != old_ip and ip,
        timeout=180,
    )
    assert complete_through(new_ip)["usage"]["completion_tokens"] == 8


def test_a_bad_update_degrades_the_pool_and_leaves_its_pods_alone(
    node: NodeCluster, cpu_pool: dict[str, Any]
) -> None:
    pods = {p["metadata"]["uid"] for p in node.get("pods", "-n", "default")["items"]}
    bad = {"spec": {"decode": {"minReplicas": 5, "maxReplicas": 2}}}
    node.kubectl("patch", "dpool", "-n", "default", "cpu", "--type=merge", "-p", json.dumps(bad))

    def degraded() -> dict[str, Any]:
        status = node.get("dpool", "-n", "default", "cpu").get("status") or {}
        conds = {c["type"]: c for c in status.get("conditions", [])}
        return status if conds.get("Degraded", {}).get("status") == "True" else {}

    status = node.wait_for("the pool to be Degraded", degraded, timeout=60)
    assert status["phase"] == "Degraded"
    time.sleep(10)  # two resyncs: nothing the operator does may touch the running pods
    now = {p["metadata"]["uid"] for p in node.get("pods", "-n", "default")["items"]}
    assert now == pods
    fix = {"spec": {"decode": {"minReplicas": None, "maxReplicas": None}}}
    node.kubectl("patch", "dpool", "-n", "default", "cpu", "--type=merge", "-p", json.dumps(fix))
    node.wait_for("the pool to recover", lambda: not degraded(), timeout=60)


def test_the_routers_recommendation_scales_decode_up_and_the_bounds_scale_it_down(
    node: NodeCluster, cpu_pool: dict[str, Any], tmp_path: Path
) -> None:
    """The closed loop on a node: the router pod's autoscaler reads the traffic it routes and
    writes its recommendation on the pool; the operator pod scales the decode Deployment; the
    new pod starts, is probed, and the router sends it work. Then a lower bound scales decode
    down while requests run, and none is lost.

    The `interactive` class's TPOT target (12 ms) is below one decode step of the emulated A40
    (about 14 ms), so a decode pod holds one sequence at the target and 2 req/s of 100-token
    outputs need more than the two pods the pool runs."""
    assert decode_replicas(node) == 2
    loop = {
        "decode": {"minReplicas": 2, "maxReplicas": 3},
        "autoscaling": {"enabled": True, "startupSeconds": 30, "stabilizationWindowSeconds": 30},
        "router": {"sloClasses": [{"name": "interactive", "ttftSeconds": 5, "tpotSeconds": 0.012}]},
    }
    patch_rolling_the_router(node, loop, "the router pod with the autoscaler")
    ip = router_service_ip(node)  # from here on, as clients do: the router rolls again below
    before = {p["metadata"]["name"] for p in engine_pods(node)}
    trace = steady_trace(tmp_path / "steady.csv", 90, rps=2.0, output_tokens=100)
    run = start_loadgen(ip, trace, tmp_path / "up.json")
    status = wait_for_applied(
        node, 3, "the operator to apply the router's recommendation", timeout=150
    )
    assert status["source"] == "autoscaler" and status["recommendedReplicas"] >= 3, status
    assert decode_replicas(node) == 3
    summary = loadgen_summary(run, tmp_path / "up.json")
    print(f"\n[cluster] scale-up: {status}; loadgen {summary}")
    assert summary["completed"] + summary["errors"] == 90
    assert "no response" not in summary["errors_by_status"], summary["errors_by_status"]

    def third_decode_pod() -> str:
        new = [
            p["metadata"]["name"]
            for p in engine_pods(node)
            if p["metadata"]["name"] not in before and pod_ready(p)
        ]
        return new[0] if new else ""

    wait_calibrated_and_routed_to(node, node.wait_for("a third decode pod", third_decode_pod))

    # Down: the operator keeps the recommendation within the bounds. The new bound changes the
    # router's config too, so both roll while requests run: the old router drains (it fails its
    # readiness, then finishes what it holds) and the decode pod that goes is routed around.
    trace = steady_trace(tmp_path / "down.csv", 40, rps=2.0, output_tokens=32)
    router_before = router_pod_ip(node)
    run = start_loadgen(ip, trace, tmp_path / "down.json")
    time.sleep(3)
    node.kubectl(
        "patch", "dpool", "-n", "default", "cpu", "--type=merge", "-p",
        json.dumps({"spec": {"decode": {"maxReplicas": 2}}}),
    )  # fmt: skip
    status = wait_for_applied(node, 2, "the operator to scale decode down to the bound", timeout=60)
    assert "bounds 2..2" in status["reason"], status
    summary = loadgen_summary(run, tmp_path / "down.json")
    print(f"\n[cluster] scale-down: {status}; loadgen {summary}")
    assert summary["completed"] == 40 and summary["errors"] == 0, summary["errors_by_status"]
    node.wait_for("the router to roll", lambda: router_pod_ip(node) != router_before, timeout=120)
    wait_for_decode_pods(node, 2)


def test_the_routers_own_recommendation_scales_decode_down_when_traffic_falls(
    node: NodeCluster, cpu_pool: dict[str, Any], tmp_path: Path
) -> None:
    """The loop's other half: the router, not a bound, takes decode back down. It scales down
    only once it has seen a burst window of traffic, so the window is set to its least, two
    minutes: a burst of 2 req/s brings a third decode pod, then light traffic runs while the
    window fills, and the router's recommendation (2, inside the bounds 2..3) removes one pod
    with requests in flight. None is lost."""
    loop = {"decode": {"maxReplicas": 3}, "autoscaling": {"burstWindowSeconds": 120}}
    patch_rolling_the_router(node, loop, "the router pod with the burst window")
    ip = router_service_ip(node)
    trace = steady_trace(tmp_path / "burst.csv", 60, rps=2.0, output_tokens=100)
    run = start_loadgen(ip, trace, tmp_path / "burst.json")
    wait_for_applied(node, 3, "the router to ask for a third decode pod", timeout=150)
    summary = loadgen_summary(run, tmp_path / "burst.json")
    assert summary["completed"] + summary["errors"] == 60, summary
    assert "no response" not in summary["errors_by_status"], summary["errors_by_status"]

    light = steady_trace(tmp_path / "light.csv", 90, rps=0.5, output_tokens=16)
    run = start_loadgen(ip, light, tmp_path / "light.json")
    status = wait_for_applied(
        node, 2, "the router's own recommendation to scale decode down", timeout=240
    )
    print(f"\n[cluster] router-decided scale-down: {status}")
    assert status["source"] == "autoscaler" and status["recommendedReplicas"] == 2, status
    assert "bounds" not in status["reason"], status  # the router's count, not a clamp
    summary = loadgen_summary(run, tmp_path / "light.json")
    print(f"[cluster] light traffic across it: {summary}")
    assert summary["completed"] == 90 and summary["errors"] == 0, summary["errors_by_status"]
    wait_for_decode_pods(node, 2)


def test_longer_outputs_at_a_constant_rate_raise_the_recommendation_before_tpot_is_missed(
    node: NodeCluster, cpu_pool: dict[str, Any]
) -> None:
    """Issue #39: at a constant 1.5 req/s of 3,000-token prompts, the outputs jump from 100 to
    1,000 tokens. Nothing at the door says so (same rate, class and prompt; the predictor learns
    only from finished requests, and the first long one finishes about 16 s after the jump), but
    the decode pods fill: the router follows their occupancy and asks for a third pod before any
    request has finished with a missed TPOT, within one cold start (`startupSeconds`) of the jump.

    The arithmetic (the emulated A40's decode step, 14.0 ms + 0.1 ms a sequence + 66 ns a token
    of context, about 0.3 ms a sequence at 3,000-3,500 tokens): at a 16 ms TPOT target a pod holds
    6 sequences (15.8 ms), the two pods 12 slots. Before the jump the pool holds 1.5 x 100 x
    14.3 ms = 2.2 sequences (14.3 ms a step: every request meets 16 ms), and the rate's wish,
    2.2 + 1.28 x sqrt(2.2) = 4.1 slots, is one pod: the recommendation stays at the minimum, 2.
    After it, 1.5 new sequences a second stay about 17 s each: the pool passes its 12 slots
    about 7 s after the jump and heads for 25 (some 17.5 ms a step), so the requests sent after
    the jump miss 16 ms on average. The occupancy's rise is significant from the first or second
    5 s tick after the jump, and projected 30 s ahead it needs more than 2 pods."""
    tpot_s, startup_s, rps, prompt = 0.016, 30, 1.5, 3000
    loop = {
        "decode": {"minReplicas": 2, "maxReplicas": 3},
        "autoscaling": {
            "enabled": True, "startupSeconds": startup_s, "stabilizationWindowSeconds": 30,
            "burstWindowSeconds": 120,
        },
    }  # fmt: skip
    slo = {"name": "interactive", "ttftSeconds": 5, "tpotSeconds": tpot_s}
    loop["router"] = {"sloClasses": [slo]}
    patch_rolling_the_router(node, loop, "the router pod sized for a 16 ms TPOT")
    wait_for_decode_pods(node, 2)
    assert decode_replicas(node) == 2
    # What the router plans with: the profiles the probe measured on this host (the arithmetic
    # above says 6 a pod; 5 to 8 were measured beside other work), printed for the record.
    batches = [tpot_batch(p, 3100, tpot_s) for p in decode_profiles(node)]
    print(f"\n[cluster] decode batches within {tpot_s * 1000:g} ms at 3,100 tokens: {batches}")
    n_short, n_long = 45, 24  # 30 s of 100-token outputs, then 16 s of 1,000-token ones
    trace = [
        TraceRequest(i / rps, prompt, 100 if i < n_short else 1000, "interactive")
        for i in range(n_short + n_long)
    ]
    done: dict[int, float] = {}  # wall-clock time each request finished, as the client saw it
    reports: list[LoadReport] = []
    ip = router_service_ip(node)

    def load() -> None:
        slo = [SLOClass("interactive", 5.0, tpot_s)]
        on_done = lambda r: done.__setitem__(r.index, time.time())  # noqa: E731
        reports.append(asyncio.run(replay(f"http://{ip}:8000", trace, slo, on_done=on_done)))

    started = time.time()
    runner = threading.Thread(target=load, daemon=True)
    runner.start()
    seen: list[tuple[float, Any]] = []
    rise: dict[str, Any] = {}  # the first recommendation above 2
    while runner.is_alive() and time.time() - started < 240:
        status = node.get("dpool", "-n", "default", "cpu").get("status") or {}
        rec = (status.get("router") or {}).get("decodeRecommendation") or {}
        if not seen or seen[-1][1] != rec.get("replicas"):
            seen.append((time.time(), rec.get("replicas")))
        if rec.get("replicas", 0) > 2 and not rise:
            rise = rec
        time.sleep(2)
    runner.join(timeout=5)
    (report,) = reports
    results = report.results
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    assert set(done) == set(range(len(trace)))
    jump = done[n_short] - results[n_short].latency_s  # when the first long request was sent
    misses = sorted(done[r.index] for r in results[n_short:] if r.tpot_s > tpot_s)
    tpots = [round(r.tpot_s * 1000, 1) for r in results]
    print(f"\n[cluster] recommendations {[(round(t - jump, 1), n) for t, n in seen]}")
    print(f"[cluster] TPOT ms before the jump {tpots[:n_short]}, after {tpots[n_short:]}")
    assert rise, ("no rise", seen)
    # `at` is stamped to the second, truncated: the rise happened within [at, at + 1).
    at = dt.datetime.fromisoformat(rise["at"].replace("Z", "+00:00")).timestamp()
    print(f"[cluster] rise {at - jump:+.1f} s after the jump: {rise['reason']}")
    print(f"[cluster] first TPOT miss seen {misses[0] - jump if misses else None} s after it")
    # The pool was fine before the jump (the 90% the scaler sizes for; 13.7-15.2 ms when this
    # test was written) and asked for nothing; after the jump, TPOT is missed.
    assert sum(r.tpot_s > tpot_s for r in results[:n_short]) <= n_short // 10, tpots[:n_short]
    assert at >= jump, (at - jump, rise)
    assert len(misses) >= n_long // 2, tpots[n_short:]
    # The work admitted raised it (not the rate, nor the finished mix), before any request was
    # seen to miss its TPOT and within one cold start of the jump.
    assert "held" in rise["reason"], rise
    assert at + 1 < misses[0], (at + 1 - jump, misses[0] - jump)
    assert at + 1 - jump <= startup_s, (at + 1 - jump, rise)


def test_deleting_the_pool_garbage_collects_its_objects(
    node: NodeCluster, cpu_pool: dict[str, Any]
) -> None:
    delete_pool(node, "cpu")
    for kind in ("jobs", "configmaps", "services"):
        left = node.get(kind, "-n", "default", "-l", "disaggpool.io/pool=cpu")["items"]
        assert not left, (kind, [o["metadata"]["name"] for o in left])


def test_helm_uninstall_removes_the_operator(node: NodeCluster, operator: dict[str, Any]) -> None:
    node.helm("uninstall", "dp", "--namespace", NS, "--wait")
    node.wait_for("the operator pod to go", lambda: not node.get("pods", "-n", NS)["items"])
