"""Pool membership and calibration profiles from the Kubernetes API (kmock: a stateful,
protocol-faithful API emulator with real LIST/WATCH streams), through the sidecar's own watch."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest

from disaggpool.calibration import sinks
from disaggpool.core.hardware import builtin_profile
from disaggpool.kubeclient import parse_selector
from disaggpool.sidecar.app import RunningSidecar, start_sidecar
from disaggpool.sidecar.config import parse_config

NS = "serving"
POOL = "disaggpool.io/pool=demo"


def pod(
    name: str, role: str, ip: str | None, ready: bool = True, pool: str = "demo"
) -> dict[str, Any]:
    status: dict[str, Any] = {
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]
    }
    if ip:
        status["podIP"] = ip
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": NS,
            "labels": {"disaggpool.io/pool": pool, "disaggpool.io/role": role},
        },
        "spec": {"containers": [{"name": "vllm", "image": "vllm"}]},
        "status": status,
    }


async def until(check: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


def members(sc: RunningSidecar) -> dict[str, str]:
    return {i.name: i.member.url for i in sc.service.state.instances.values() if not i.removed}


@pytest.mark.asyncio
async def test_pods_and_profile_configmaps_are_watched(kmock, monkeypatch) -> None:
    kmock.resources.load_bundled()
    monkeypatch.setenv("KUBERNETES_API", str(kmock.url))
    monkeypatch.setenv("KUBERNETES_TOKEN", "t")
    config = parse_config(
        {
            "model": "m",
            "listen": {"http": "127.0.0.1:0", "grpc": "127.0.0.1:0"},
            "slo_classes": [{"name": "c", "ttft_s": 1, "tpot_s": 0.1}],
            "scrape_interval_s": 30,
            "pool": {"kubernetes": {"namespace": NS, "selector": POOL, "port": 8000}},
            "profiles": {
                "kubernetes": {"namespace": NS, "selector": f"{POOL},disaggpool.io/profile=true"}
            },
        }
    )
    base = f"{kmock.url}/api/v1/namespaces/{NS}"
    async with aiohttp.ClientSession() as http:

        async def create(kind: str, body: dict[str, Any]) -> None:
            async with http.post(f"{base}/{kind}", data=json.dumps(body)) as r:
                assert r.status in (200, 201), await r.text()

        await create("pods", pod("vllm-p-0", "prefill", "198.18.0.1"))
        await create("pods", pod("vllm-d-0", "decode", "198.18.0.2"))
        await create("pods", pod("vllm-d-1", "decode", None, ready=False))  # still starting
        await create("pods", pod("other-d-0", "decode", "198.18.0.9", pool="other"))
        sc = await start_sidecar(config)
        try:
            await until(lambda: len(members(sc)) == 2, "two ready pods")
            assert members(sc) == {
                "vllm-p-0": "http://198.18.0.1:8000",
                "vllm-d-0": "http://198.18.0.2:8000",
            }

            # The kubelet marks vllm-d-1 ready with an IP: it joins.
            async with http.patch(
                f"{base}/pods/vllm-d-1",
                data=json.dumps({"status": pod("vllm-d-1", "decode", "198.18.0.3")["status"]}),
                headers={"Content-Type": "application/merge-patch+json"},
            ) as r:
                assert r.status == 200, await r.text()
            await until(lambda: "vllm-d-1" in members(sc), "vllm-d-1 joining")

            # The calibration Job writes its profile ConfigMap: the router picks it up.
            labels = {
                "disaggpool.io/pool": "demo",
                "disaggpool.io/pod": "vllm-d-0",
                "disaggpool.io/profile": "true",
            }
            profile = builtin_profile("a40-llama3-8b")
            await asyncio.to_thread(
                sinks.write_configmap, profile, f"{NS}/demo-profile-vllm-d-0", {}, labels
            )
            state = sc.service.state
            await until(lambda: state.instances["vllm-d-0"].profile == profile, "the profile")

            # A profile that does not parse is refused, never half-used.
            await create(
                "configmaps",
                {
                    "metadata": {
                        "name": "demo-profile-vllm-d-1",
                        "namespace": NS,
                        "labels": {**labels, "disaggpool.io/pod": "vllm-d-1"},
                    },
                    "data": {"profile.yaml": "name: broken\nprefill: {}\n"},
                },
            )
            # Wait until the sidecar has read and refused it, then check nothing was installed.
            await until(lambda: "vllm-d-1" in sc.collectors.profile_errors, "the refusal")
            errors = sc.collectors.profile_errors
            assert "configmap/demo-profile-vllm-d-1" in errors["vllm-d-1"], errors
            assert state.instances["vllm-d-1"].profile is None

            # Not even YAML: refused too, and the watch goes on (a re-probe's write lands).
            p0 = {**labels, "disaggpool.io/pod": "vllm-p-0"}
            await create(
                "configmaps",
                {
                    "metadata": {"name": "demo-profile-vllm-p-0", "namespace": NS, "labels": p0},
                    "data": {"profile.yaml": "prefill: [unclosed\n"},
                },
            )
            await until(lambda: "vllm-p-0" in sc.collectors.profile_errors, "the YAML refusal")
            assert "not valid YAML" in sc.collectors.profile_errors["vllm-p-0"]
            await asyncio.to_thread(
                sinks.write_configmap, profile, f"{NS}/demo-profile-vllm-p-0", {}, p0
            )
            await until(lambda: state.instances["vllm-p-0"].profile == profile, "the re-probe")

            # The pod is deleted: it leaves the pool.
            async with http.delete(f"{base}/pods/vllm-d-0") as r:
                assert r.status == 200, await r.text()
            await until(lambda: "vllm-d-0" not in members(sc), "vllm-d-0 leaving")
        finally:
            await sc.close()


def test_selector_parsing() -> None:
    assert parse_selector("a=b, c==d") == {"a": "b", "c": "d"}
    for bad in ("a!=b", "a in (b)", "=x"):
        with pytest.raises(ValueError, match="key=value"):
            parse_selector(bad)


def test_credentials_sources_in_order(tmp_path, monkeypatch) -> None:
    """Explicit kubeconfig > KUBERNETES_API > in-cluster service account > $KUBECONFIG."""
    import ssl

    import yaml

    from disaggpool import kubeclient

    def kubeconfig(name: str, server: str, token: str) -> str:
        path = tmp_path / name
        cluster = {"server": server, "insecure-skip-tls-verify": True}
        path.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "c", "cluster": cluster}],
                    "users": [{"name": "u", "user": {"token": token}}],
                    "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                    "current-context": "x",
                }
            )
        )
        return str(path)

    sa = tmp_path / "sa"
    sa.mkdir()
    monkeypatch.setattr(kubeclient.credentials, "SA_DIR", sa)
    for var in ("KUBERNETES_SERVICE_HOST", "KUBERNETES_TOKEN", "KUBERNETES_INSECURE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("KUBECONFIG", kubeconfig("env", "https://198.18.0.9:6443", "from-env-file"))
    monkeypatch.setenv("KUBERNETES_API", "http://127.0.0.1:1/")
    monkeypatch.setenv("KUBERNETES_TOKEN", "tok")

    explicit = kubeclient.load_credentials(kubeconfig("arg", "https://198.18.0.8:6443", "arg-tok"))
    assert (explicit.base, explicit.authorization) == ("https://198.18.0.8:6443", "Bearer arg-tok")
    assert explicit.tls is not None and explicit.tls.verify_mode == ssl.CERT_NONE

    env = kubeclient.load_credentials()
    assert (env.base, env.authorization, env.tls) == ("http://127.0.0.1:1", "Bearer tok", None)
    monkeypatch.setenv("KUBERNETES_API", "https://api.example:6443")
    monkeypatch.setenv("KUBERNETES_INSECURE", "1")
    insecure = kubeclient.load_credentials().tls
    assert insecure is not None and insecure.verify_mode == ssl.CERT_NONE

    # In a pod without a token (none mounted, none given): the kubeconfig is the fallback.
    monkeypatch.delenv("KUBERNETES_API")
    monkeypatch.delenv("KUBERNETES_TOKEN")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "fd00::1")
    fallback = kubeclient.load_credentials()
    assert fallback.authorization == "Bearer from-env-file"
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "absent"))
    with pytest.raises(kubeclient.KubeUnavailable, match="no service-account token"):
        kubeclient.load_credentials()


def test_rest_paths() -> None:
    from disaggpool.kubeclient import path_for

    assert path_for("v1", "ConfigMap", "ns") == "/api/v1/namespaces/ns/configmaps"
    assert path_for("batch/v1", "Job", "ns", "j") == "/apis/batch/v1/namespaces/ns/jobs/j"
    assert path_for("disaggpool.io/v1alpha1", "DisaggPool", None) == (
        "/apis/disaggpool.io/v1alpha1/disaggpools"
    )
