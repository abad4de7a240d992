"""E2E layer, the operator's feedback loops against a real kube-apiserver 1.20.2: decode and prefill
autoscaling from the routers' recommendations, a drifting pod re-probed from the routers' errors,
a failed probe Job retried and then the pod marked failed, and a Job that holds a probe's name
without its labels reported.

Same set-up as test_operator_e2e.py (whose module docstring says more): this module starts its
own apiserver (the module-scoped `cluster`), with manifests/ applied, and plays the kubelet.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import functools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from k8s_cluster import Cluster, require_k8s, running_cluster
from operator_e2e_kit import kubectl_json, list_pods, play_kubelet
from operator_testkit import (
    CRD_PATH,
    MANIFESTS,
    eventually,
    load_sample,
    start_operator,
    stop_operator,
)

from disaggpool.calibration import sinks
from disaggpool.core.hardware import builtin_profile
from disaggpool.formats.profiles import dump_profile
from disaggpool.kubeclient import ApiError, Kube
from disaggpool.operator.reconcile import reconcile


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    require_k8s()
    with running_cluster(tmp_path_factory.mktemp("cluster"), [CRD_PATH]) as c:
        c.kubectl("apply", "-f", str(MANIFESTS))  # the documented install path
        yield c


@pytest.mark.asyncio
async def test_autoscaling_from_the_routers_recommendations(
    cluster: Cluster, tmp_path: Path
) -> None:
    """The loop's Kubernetes half on a real API server: the router's autoscalers (real code, the
    router's own service-account token, so its Role is exercised) write their recommendations
    on its pool; a reconcile pass scales the decode and prefill Deployments within their bounds,
    with Events and `status.autoscaling`; a bad autoscaling spec is flagged and leaves the pool
    as it runs."""
    from disaggpool.core.profile import CalibrationProfile
    from disaggpool.sidecar.autoscale import DecodeRecommender, PrefillRecommender
    from disaggpool.sidecar.config import Member, parse_config
    from disaggpool.sidecar.pool_writer import PoolWriter
    from disaggpool.sidecar.service import RoutingService
    from disaggpool.sidecar.state import Gauges

    cluster.kubectl("create", "namespace", "scale")
    cr = load_sample("small.yaml")
    cr["metadata"]["namespace"] = "scale"
    cr["spec"]["decode"] = {"replicas": 1, "minReplicas": 1, "maxReplicas": 3}
    cr["spec"]["prefill"] = {"replicas": 1, "minReplicas": 1, "maxReplicas": 2}
    cr["spec"]["autoscaling"] = {"enabled": True, "startupSeconds": 60}
    cluster.kubectl("apply", "-f", "-", stdin=json.dumps(cr))
    deployment = ("deployment", "small-decode", "-n", "scale")
    prefill_deployment = ("deployment", "small-prefill", "-n", "scale")
    kube = Kube.from_environment(str(cluster.kubeconfig))
    try:
        await reconcile(kube, "scale", "small", default_image="disaggpool:test")
        assert kubectl_json(cluster, *deployment)["spec"]["replicas"] == 1
        status = kubectl_json(cluster, "dpool", "small", "-n", "scale")["status"]
        assert status["autoscaling"]["source"] == "spec"
        assert status["decode"]["selector"] == "disaggpool.io/pool=small,disaggpool.io/role=decode"

        # The router, as the operator renders its config, with a decode pod it has profiled
        # and a busy minute of traffic behind it.
        rendered = kubectl_json(cluster, "configmap", "small-router", "-n", "scale")["data"]
        config = parse_config(yaml.safe_load(rendered["sidecar.yaml"]), "sidecar.yaml")
        assert config.autoscaling is not None and config.autoscaling.pool_name == "small"
        assert config.autoscaling.prefill is not None  # the pool's prefill bounds, rendered
        clock = [1000.0]
        service = RoutingService(
            dataclasses.replace(config, members_kubernetes=None, profiles_kubernetes=None),
            clock=lambda: clock[0],
        )
        service.state.set_members(
            [Member("small-decode-a", "decode", "http://127.0.0.1:1"),
             Member("small-prefill-a", "prefill", "http://127.0.0.1:2")]
        )  # fmt: skip
        profile: CalibrationProfile = dataclasses.replace(
            builtin_profile("a40-llama3-8b"), quality="good"
        )
        service.state.set_profile("small-decode-a", profile, clock[0])
        service.state.scraped("small-decode-a", Gauges(40, 12, 0.9, 190_000), clock[0])
        service.state.set_profile("small-prefill-a", profile, clock[0])
        service.state.scraped("small-prefill-a", Gauges(2, 6, 0.3, 190_000), clock[0])
        for i in range(3000):  # 50 req/s over the last minute, as the service records a route
            service.demand.arrived(940.0 + i / 50.0)
            service.demand.admitted(940.0 + i / 50.0, 1000, 200.0)
        for _ in range(100):
            service.demand.finished(990.0, 1000, 200, 0.5, 0.5)
        token = cluster.sa_token("scale", "small-router")
        router_cfg = cluster.kubeconfig_for(tmp_path / "router", token)
        recommenders = [
            DecodeRecommender(config.autoscaling, service),
            PrefillRecommender(config.autoscaling, service),
        ]
        task = PoolWriter(
            service, recommenders, namespace="scale", name="small", period_s=15.0, session=None,
            kube=lambda: Kube.from_environment(str(router_cfg)),
        )  # fmt: skip
        written = await task.step()
        decision = written["decodeRecommendation"]
        prefill_decision = written["prefillRecommendation"]
        # 50 prompts a second of 1000 tokens keep more than two prefill pods busy; the router's
        # prefill bounds (the pool's prefill.min/maxReplicas) cap it at 2.
        assert prefill_decision["replicas"] == 2, prefill_decision
        # 50 req/s needs 9 pods of this profile; the router's own bounds (rendered from the
        # pool's) cap its recommendation at 3.
        assert decision["replicas"] == 3 and "-> 9" in decision["reason"]
        assert await task.step() == {}  # unchanged: not written again
        pool = kubectl_json(cluster, "dpool", "small", "-n", "scale")
        # On the status subresource, as the router's report; never on the pool's metadata.
        assert pool["status"]["router"]["decodeRecommendation"] == decision
        assert pool["status"]["router"]["prefillRecommendation"] == prefill_decision
        assert "disaggpool.io/decode-recommendation" not in pool["metadata"].get("annotations", {})

        # Its Role lets it patch its own pool's status and nothing else: not its spec (what the
        # operator deploys), not another pool's status, not even a read.
        other = load_sample("small.yaml")
        other["metadata"].update(name="other", namespace="scale")
        cluster.kubectl("apply", "-f", "-", stdin=json.dumps(other))
        router_kube = Kube.from_environment(str(router_cfg))
        pools = "/apis/disaggpool.io/v1alpha1/namespaces/scale/disaggpools"
        try:
            for what, call in (
                ("its spec", router_kube.merge_patch(
                    f"{pools}/small", {"spec": {"engine": {"image": "evil"}}}
                )),
                ("its annotations", router_kube.merge_patch(
                    f"{pools}/small", {"metadata": {"annotations": {"x": "y"}}}
                )),
                ("another's status", router_kube.merge_patch(
                    f"{pools}/other/status", {"status": {"router": {}}}
                )),
                ("a read", router_kube.get(f"{pools}/small")),
            ):  # fmt: skip
                with pytest.raises(ApiError) as refused:
                    await call
                assert refused.value.status == 403, what
        finally:
            await router_kube.close()

        await reconcile(kube, "scale", "small", default_image="disaggpool:test")
        assert kubectl_json(cluster, *deployment)["spec"]["replicas"] == 3
        assert kubectl_json(cluster, *prefill_deployment)["spec"]["replicas"] == 2
        status = kubectl_json(cluster, "dpool", "small", "-n", "scale")["status"]
        assert status["autoscaling"]["replicas"] == 3
        assert status["autoscaling"]["recommendedReplicas"] == 3
        assert status["autoscaling"]["reason"] == decision["reason"]
        assert status["autoscaling"]["prefill"]["replicas"] == 2
        assert status["autoscaling"]["prefill"]["reason"] == prefill_decision["reason"]
        assert status["prefill"]["desired"] == 2
        events = kubectl_json(cluster, "events", "-n", "scale")["items"]
        scaled = [e["message"] for e in events if e["reason"] == "DecodeScaled"]
        assert any(m.startswith("decode 1 -> 3") for m in scaled), scaled
        scaled = [e["message"] for e in events if e["reason"] == "PrefillScaled"]
        assert any(m.startswith("prefill 1 -> 2") for m in scaled), scaled

        # A bad autoscaling spec: Degraded, naming the field; the pool keeps running as it is.
        cluster.kubectl(
            "patch", "dpool", "small", "-n", "scale", "--type=merge",
            "-p", json.dumps({"spec": {"decode": {"minReplicas": 4}}}),
        )  # fmt: skip
        result = await reconcile(kube, "scale", "small", default_image="disaggpool:test")
        assert any(i.field.endswith("minReplicas") for i in result.issues)
        status = kubectl_json(cluster, "dpool", "small", "-n", "scale")["status"]
        degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
        assert degraded["status"] == "True" and "minReplicas" in degraded["message"]
        assert kubectl_json(cluster, *deployment)["spec"]["replicas"] == 3

        # The other path: autoscaling off, an HPA (here `kubectl scale`) drives decode.replicas
        # through the scale subresource.
        cluster.kubectl(
            "patch", "dpool", "small", "-n", "scale", "--type=merge",
            "-p", json.dumps({"spec": {
                "decode": {"minReplicas": 1}, "autoscaling": None,
                # Prefill bounds need autoscaling: without it prefill takes replicas again.
                "prefill": {"minReplicas": None, "maxReplicas": None},
            }}),
        )  # fmt: skip
        cluster.kubectl("scale", "dpool", "small", "-n", "scale", "--replicas=2")
        await reconcile(kube, "scale", "small", default_image="disaggpool:test")
        assert kubectl_json(cluster, *deployment)["spec"]["replicas"] == 2
        assert kubectl_json(cluster, *prefill_deployment)["spec"]["replicas"] == 1
        scale = json.loads(
            cluster.kubectl(
                "get",
                "--raw",
                "/apis/disaggpool.io/v1alpha1/namespaces/scale/disaggpools/small/scale",
            )
        )
        assert scale["spec"]["replicas"] == 2
        assert scale["status"]["selector"] == "disaggpool.io/pool=small,disaggpool.io/role=decode"
        await task.stop()
    finally:
        await kube.close()
        cluster.kubectl("delete", "namespace", "scale", "--wait=false")


@pytest.mark.asyncio
async def test_a_drifting_pod_is_reprobed_from_the_routers_errors(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Drift on a real API server: the router (its own token) writes its pods' prediction errors
    on the pool; a pass re-probes the pod whose error about its current profile is over
    `calibration.maxPredictionError`, and only that one."""
    from disaggpool.sidecar.config import Member, parse_config
    from disaggpool.sidecar.pool_writer import DriftReport, PoolWriter
    from disaggpool.sidecar.service import RoutingService

    ns = "drift"
    cluster.kubectl("create", "namespace", ns)
    cr = load_sample("small.yaml")
    cr["metadata"]["namespace"] = ns
    cr["spec"]["calibration"] = {"maxPredictionError": 0.3}
    cluster.kubectl("apply", "-f", "-", stdin=json.dumps(cr))
    kube = Kube.from_environment(str(cluster.kubeconfig))
    monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig))  # the probe's sink, as admin here
    try:
        await reconcile(kube, ns, "small", default_image="disaggpool:test")
        uid = kubectl_json(cluster, "dpool", "small", "-n", ns)["metadata"]["uid"]

        async def both() -> list[dict[str, Any]] | None:
            pods = list_pods(cluster, ns, "disaggpool.io/pool=small,disaggpool.io/role")
            return pods if len(pods) == 2 else None

        pods = {
            p["metadata"]["labels"]["disaggpool.io/role"]: p
            for p in await eventually(both, "pods", 60, 0.5)
        }
        fitted = "2026-12-04T10:00:00+00:00"
        for k, (_, pod) in enumerate(sorted(pods.items())):  # decode .31, prefill .32
            name = pod["metadata"]["name"]
            play_kubelet(cluster, ns, name, f"198.18.0.{31 + k}")
            profile = dataclasses.replace(
                builtin_profile("a40-llama3-8b"), name=name, quality="good", fitted_at=fitted
            )
            labels = {"disaggpool.io/pool": "small", "disaggpool.io/pod": name,
                      "disaggpool.io/profile": "true"}  # fmt: skip
            owner = sinks.pool_owner(f"small/{uid}")
            await asyncio.to_thread(
                functools.partial(
                    sinks.write_configmap,
                    profile,
                    f"{ns}/small-profile-{name}",
                    {},
                    labels,
                    owner=owner,
                )
            )
        calm = await reconcile(kube, ns, "small", default_image="disaggpool:test")
        assert not calm.jobs_created, calm

        rendered = kubectl_json(cluster, "configmap", "small-router", "-n", ns)["data"][
            "sidecar.yaml"
        ]
        config = parse_config(yaml.safe_load(rendered), "sidecar.yaml")
        assert config.drift is not None and config.drift.pool_name == "small"
        service = RoutingService(
            dataclasses.replace(config, members_kubernetes=None, profiles_kubernetes=None)
        )
        decode = pods["decode"]["metadata"]["name"]
        prefill = pods["prefill"]["metadata"]["name"]
        service.state.set_members(
            [Member(decode, "decode", "http://198.18.0.31:8000"),
             Member(prefill, "prefill", "http://198.18.0.32:8000")]
        )  # fmt: skip
        for name in (decode, prefill):
            profile = dataclasses.replace(
                builtin_profile("a40-llama3-8b"), quality="good", fitted_at=fitted
            )
            service.install_profile(name, profile, 0.0)
        for _ in range(20):  # the decode pod now takes twice as long per token as predicted
            service.drift.observe(decode, "tpot", 0.02, 0.04)
            service.drift.observe(prefill, "ttft", 0.50, 0.52)
        router_cfg = cluster.kubeconfig_for(
            tmp_path / "router", cluster.sa_token(ns, "small-router")
        )
        writer = PoolWriter(
            service, [DriftReport(service)], namespace=ns, name="small", period_s=15.0,
            session=None, kube=lambda: Kube.from_environment(str(router_cfg)),
        )  # fmt: skip
        written = await writer.step()
        errors = {e["pod"]: e for e in written["observedErrors"]["pods"]}
        assert errors[decode] == {"pod": decode, "error": 0.5, "profile": fitted}
        await writer.stop()
        report = kubectl_json(cluster, "dpool", "small", "-n", ns)["status"]["router"]
        assert report["observedErrors"] == written["observedErrors"]

        drifted = await reconcile(kube, ns, "small", default_image="disaggpool:test")
        assert len(drifted.jobs_created) == 1, drifted
        job = kubectl_json(cluster, "job", drifted.jobs_created[0], "-n", ns)
        assert job["metadata"]["labels"]["disaggpool.io/pod"] == decode
        status = kubectl_json(cluster, "dpool", "small", "-n", ns)["status"]
        by_pod = {p["name"]: p for p in status["pods"]}
        assert by_pod[decode]["calibration"] == "probing"
        assert by_pod[prefill]["calibration"] == "calibrated"
        # The operator's status write left the router's report alone.
        assert status["router"]["observedErrors"] == written["observedErrors"]

        # A profile that does not parse or validate: a Warning Event naming the field, once
        # however many passes see it, and the pod is probed again.
        bad = yaml.safe_load(
            kubectl_json(cluster, "configmap", f"small-profile-{prefill}", "-n", ns)["data"][
                "profile.yaml"
            ]
        )
        bad["decode"]["d1"] = "fast"
        cluster.kubectl(
            "patch", "configmap", f"small-profile-{prefill}", "-n", ns, "--type=merge",
            "-p", json.dumps({"data": {"profile.yaml": yaml.safe_dump(bad)}}),
        )  # fmt: skip
        rejected = await reconcile(kube, ns, "small", default_image="disaggpool:test")
        await reconcile(kube, ns, "small", default_image="disaggpool:test")
        assert [
            j for j in rejected.jobs_created
            if kubectl_json(cluster, "job", j, "-n", ns)["metadata"]["labels"]["disaggpool.io/pod"]
            == prefill
        ]  # fmt: skip
        events = [
            e for e in kubectl_json(cluster, "events", "-n", ns)["items"]
            if e["reason"] == "ProfileRejected"
        ]  # fmt: skip
        assert len(events) == 1 and events[0]["type"] == "Warning", events
        assert "decode.d1" in events[0]["message"] and prefill in events[0]["message"]
        assert events[0]["count"] == 1

        # A profile not owned by this pool (labels alone) is ignored: the pod is probed, into
        # a ConfigMap the operator takes over.
        cluster.kubectl("delete", "configmap", f"small-profile-{decode}", "-n", ns)
        forged = {
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": f"small-profile-{decode}", "namespace": ns,
                         "labels": {"disaggpool.io/pool": "small", "disaggpool.io/pod": decode,
                                    "disaggpool.io/profile": "true"}},
            "data": {"profile.yaml": dump_profile(dataclasses.replace(
                builtin_profile("a40-llama3-8b"), quality="good", fitted_at=fitted))},
        }  # fmt: skip
        cluster.kubectl("apply", "-f", "-", stdin=json.dumps(forged))
        for job in kubectl_json(cluster, "jobs", "-n", ns, "-l", f"disaggpool.io/pod={decode}")[
            "items"
        ]:
            _play_failed_job(cluster, ns, job["metadata"]["name"])  # end the drift probe
        await reconcile(kube, ns, "small", default_image="disaggpool:test")
        taken = kubectl_json(cluster, "configmap", f"small-profile-{decode}", "-n", ns)
        assert taken["metadata"]["ownerReferences"][0]["uid"] == uid
        assert "disaggpool.io/profile" not in taken["metadata"]["labels"]
        assert not taken.get("data")
        status = kubectl_json(cluster, "dpool", "small", "-n", ns)["status"]
        by_pod = {p["name"]: p for p in status["pods"]}
        assert by_pod[decode]["calibration"] == "probing" and "profileRef" not in by_pod[decode]
    finally:
        await kube.close()
        cluster.kubectl("delete", "namespace", ns, "--wait=false")


def _play_failed_job(cluster: Cluster, ns: str, job: str) -> None:
    """What the Job controller writes once a probe's pods have failed `backoffLimit` times."""
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    failed = {"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded",
              "lastProbeTime": now, "lastTransitionTime": now}  # fmt: skip
    cluster.kubectl(
        "patch", "job", job, "-n", ns, "--subresource=status", "--type=merge",
        "-p", json.dumps({"status": {"conditions": [failed], "failed": 1}}),
    )  # fmt: skip


@pytest.mark.asyncio
async def test_a_failed_probe_is_retried_then_the_pod_is_marked_failed(
    cluster: Cluster, tmp_path: Path
) -> None:
    """The running operator sees its probe Jobs end (its Job watch and its Job list): a failed
    probe is run again as the next attempt, and after `calibration.maxAttempts` failures the
    pod is `failed`. Before the probe Jobs carried the labels the operator finds them by, the
    first failure left the pod `probing` for ever."""
    ns = "failing"
    cluster.kubectl("create", "namespace", ns)
    cr = load_sample("small.yaml")
    cr["metadata"]["namespace"] = ns
    cr["spec"]["calibration"] = {"maxAttempts": 2}
    token = cluster.sa_token("disaggpool-system", "disaggpool-operator")
    log = tmp_path / "operator.log"
    proc = await start_operator(cluster.kubeconfig_for(tmp_path / "operator", token), log)
    try:
        cluster.kubectl("apply", "-f", "-", stdin=json.dumps(cr))

        async def both() -> list[dict[str, Any]] | None:
            pods = list_pods(cluster, ns, "disaggpool.io/pool=small,disaggpool.io/role")
            return pods if len(pods) == 2 else None

        pods = {
            p["metadata"]["labels"]["disaggpool.io/role"]: p["metadata"]["name"]
            for p in await eventually(both, "pods", 60, 0.5, log)
        }
        play_kubelet(cluster, ns, pods["prefill"], "198.18.0.41")
        play_kubelet(cluster, ns, pods["decode"], "198.18.0.42")
        prefill = pods["prefill"]

        def attempt(n: int) -> Any:
            async def job() -> str | None:
                sel = f"disaggpool.io/pod={prefill},disaggpool.io/attempt={n}"
                items = kubectl_json(cluster, "jobs", "-n", ns, "-l", sel)["items"]
                return str(items[0]["metadata"]["name"]) if items else None

            return job

        first = await eventually(attempt(1), "the prefill pod's first probe", 60, 0.5, log)
        _play_failed_job(cluster, ns, first)
        # Only the Job's own event can start the next pass here: nothing else changes.
        second = await eventually(attempt(2), "a second probe after the first failed", 60, 0.5, log)
        _play_failed_job(cluster, ns, second)

        async def given_up() -> dict[str, Any] | None:
            st = kubectl_json(cluster, "dpool", "small", "-n", ns).get("status") or {}
            by_pod = {p["name"]: p for p in st.get("pods") or []}
            got = by_pod.get(prefill) or {}
            return got if got.get("calibration") == "failed" else None

        got = await eventually(given_up, "the prefill pod marked failed", 60, 0.5, log)
        assert "2 probe attempts failed" in str(got), got
        await asyncio.sleep(2)  # no third attempt follows
        assert await attempt(3)() is None
        assert proc.returncode is None
    finally:
        await stop_operator(proc)
        cluster.kubectl("delete", "namespace", ns, "--wait=false")


@pytest.mark.asyncio
async def test_a_job_holding_a_probes_name_without_its_labels_is_reported(
    cluster: Cluster,
) -> None:
    """A Job the operator cannot find by its labels but whose name a probe needs is a Warning
    event on the pool, not a silent skip (how a label drift once hid every probe Job); each
    later pass counts on that Event rather than adding one."""
    from disaggpool.operator.names import PoolRef, job_name

    ns = "squatted"
    cluster.kubectl("create", "namespace", ns)
    cr = load_sample("small.yaml")
    cr["metadata"]["namespace"] = ns
    cluster.kubectl("apply", "-f", "-", stdin=json.dumps(cr))
    kube = Kube.from_environment(str(cluster.kubeconfig))
    try:
        await reconcile(kube, ns, "small", default_image="disaggpool:test")

        async def prefill() -> str | None:
            pods = list_pods(cluster, ns, "disaggpool.io/pool=small,disaggpool.io/role=prefill")
            return str(pods[0]["metadata"]["name"]) if pods else None

        pod = await eventually(prefill, "the prefill pod", 60, 0.5)
        uid = kubectl_json(cluster, "dpool", "small", "-n", ns)["metadata"]["uid"]
        squatter = job_name(PoolRef("small", ns, uid), pod, 1)
        cluster.kubectl(
            "create", "job", squatter, "-n", ns, "--image=busybox", "--", "true"
        )  # fmt: skip
        play_kubelet(cluster, ns, pod, "198.18.0.51")
        result = await reconcile(kube, ns, "small", default_image="disaggpool:test")
        assert squatter not in result.jobs_created
        events = cluster.kubectl(
            "get", "events", "-n", ns, "--field-selector", "involvedObject.name=small"
        )
        line = next((x for x in events.splitlines() if "CalibrationBlocked" in x), "")
        assert "Warning" in line and squatter in line, events
        await reconcile(kube, ns, "small", default_image="disaggpool:test")
        blocked = [
            e for e in kubectl_json(cluster, "events", "-n", ns)["items"]
            if e["reason"] == "CalibrationBlocked"
        ]  # fmt: skip
        assert [e["count"] for e in blocked] == [2], blocked
    finally:
        await kube.close()
        cluster.kubectl("delete", "namespace", ns, "--wait=false")
