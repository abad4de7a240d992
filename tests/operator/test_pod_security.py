"""Pod Security and least privilege of everything the operator, the manifests and the chart render.

Two checks, over the same objects:

* the Pod Security Standard `restricted` field by field (`restricted_violations`, written from
  the standard's table), asserted directly: the router's, the probe's and the operator's pods
  pass it always, the vLLM pods with ``engine.podSecurity: restricted``; the vLLM pods pass
  `baseline` out of the box. The API servers these tests start (Kubernetes 1.20) predate Pod
  Security admission, so nothing else would catch a regression (docs/kubernetes-testing.md);
* checkov's Kubernetes checks (a maintained policy checker, pinned, installed from PyPI into its
  own virtual environment under ``$DISAGGPOOL_PEER_ROOT``, default /var/cache/disaggpool/peers, on
  first use; where it cannot be installed the test skips saying why, unless
  ``DISAGGPOOL_REQUIRE_PEERS=1`` or ``CI=true``, where that is a failure). Every check runs;
  the few that do not apply are tolerated only on the objects named in `TOLERATED`, each with
  its reason (docs/kubernetes-testing.md lists them), and a tolerance nothing needs fails too.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from k8s_cluster import CACHE_BIN, require_k8s
from operator_testkit import CHART, MANIFESTS, load_sample

import peerkit
from disaggpool.operator.calibration_plan import render_calibration_job
from disaggpool.operator.names import PoolRef
from disaggpool.operator.observed import PodView
from disaggpool.operator.render import render_pool
from disaggpool.operator.spec import parse_spec

CHECKOV = "3.3.30"
NAMESPACE = "serving"  # rendered pools live here (checkov flags the `default` namespace)
IMAGE = "ghcr.io/disaggpool/disaggpool:0.1.0"

# ----------------------------------------------------------------------------- the standard

_BASELINE_CAPS = {
    "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
    "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT",
}  # fmt: skip
_RESTRICTED_VOLUMES = {
    "configMap", "downwardAPI", "emptyDir", "projected", "secret", "csi",
    "persistentVolumeClaim", "ephemeral",
}  # fmt: skip


def pod_spec(obj: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = obj["spec"]["template"]["spec"]
    return spec


def baseline_violations(pod: dict[str, Any]) -> list[str]:
    """Where a pod spec breaks the Pod Security Standard `baseline` (the checks that apply to
    what we render: host namespaces, privileged, capabilities, hostPath, host ports, seccomp,
    /proc mount, sysctls)."""
    out = []
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(key):
            out.append(key)
    if any("hostPath" in v for v in pod.get("volumes") or []):
        out.append("hostPath volume")
    if (pod.get("securityContext") or {}).get("sysctls"):
        out.append("sysctls")
    levels = [pod.get("securityContext") or {}]
    for c in pod.get("initContainers", []) + pod["containers"]:
        sc = c.get("securityContext") or {}
        levels.append(sc)
        if sc.get("privileged"):
            out.append(f"{c['name']}: privileged")
        added = set((sc.get("capabilities") or {}).get("add") or [])
        if added - _BASELINE_CAPS:
            out.append(f"{c['name']}: capabilities.add {sorted(added - _BASELINE_CAPS)}")
        if any(p.get("hostPort") for p in c.get("ports") or []):
            out.append(f"{c['name']}: hostPort")
        if sc.get("procMount") not in (None, "Default"):
            out.append(f"{c['name']}: procMount")
    for sc in levels:
        seccomp = (sc.get("seccompProfile") or {}).get("type")
        if seccomp not in (None, "RuntimeDefault", "Localhost"):
            out.append(f"seccompProfile {seccomp}")
    return out


def restricted_violations(pod: dict[str, Any]) -> list[str]:
    """Where a pod spec breaks `restricted` (which includes `baseline`), plus a read-only root
    filesystem, which this project asks of its own pods too."""
    out = baseline_violations(pod)
    psc = pod.get("securityContext") or {}
    for v in pod.get("volumes") or []:
        kinds = set(v) - {"name"}
        if not kinds <= _RESTRICTED_VOLUMES:
            out.append(f"volume {v['name']}: {sorted(kinds)}")
    for c in pod.get("initContainers", []) + pod["containers"]:
        sc = c.get("securityContext") or {}
        name = c["name"]
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{name}: allowPrivilegeEscalation must be false")
        if not (sc.get("runAsNonRoot") is True or psc.get("runAsNonRoot") is True):
            out.append(f"{name}: runAsNonRoot")
        if sc.get("runAsUser", psc.get("runAsUser")) == 0:
            out.append(f"{name}: runAsUser 0")
        seccomp = (sc.get("seccompProfile") or psc.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{name}: seccompProfile must be RuntimeDefault or Localhost")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"{name}: capabilities.drop must include ALL")
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            out.append(f"{name}: capabilities.add beyond NET_BIND_SERVICE")
        if sc.get("readOnlyRootFilesystem") is not True:
            out.append(f"{name}: readOnlyRootFilesystem")
    return out


# ----------------------------------------------------------------------------- what we render


def _pool(sample: str, **spec_patch: Any) -> tuple[PoolRef, Any]:
    doc = load_sample(sample)
    for key, value in spec_patch.items():
        doc["spec"].setdefault(key, {}).update(value)
    spec, issues = parse_spec(doc["spec"], IMAGE)
    assert spec is not None, issues
    return PoolRef(doc["metadata"]["name"], NAMESPACE, "0000-uid", 1), spec


#: Every optional feature that changes a rendered pod or adds an object.
FULL = {
    "engine": {"podSecurity": "restricted"},
    "auth": {"apiKeySecret": {"name": "pool-key"}},
    "router": {"grpc": {"tokenSecret": {"name": "grpc-token"}}},
    "networkPolicy": {"enabled": True, "clients": [{"namespaceSelector": {}}]},
    "calibration": {"maxPredictionError": 0.3},
    "autoscaling": {"enabled": True},
}
#: Gateway mode: a pd-proxy container in every decode pod (baseline engines, restricted proxy).
GATEWAY = {
    "router": {"mode": "gateway", "grpc": {"tokenSecret": {"name": "grpc-token"}}},
    "auth": {"apiKeySecret": {"name": "pool-key"}},
    "networkPolicy": {"enabled": True, "clients": [{"namespaceSelector": {}}]},
}
POOLS: dict[str, tuple[str, dict[str, Any]]] = {
    "small": ("small.yaml", {}),
    "hetero": ("heterogeneous.yaml", {}),
    "full": ("small.yaml", FULL),
    "gateway": ("heterogeneous.yaml", GATEWAY),
}


def rendered_pool(which: str) -> list[dict[str, Any]]:
    """A pool's objects, with a probe Job for one of its pods, as the operator renders them."""
    sample, patch = POOLS[which]
    pool, spec = _pool(sample, **patch)
    pod = PodView(f"{pool.name}-decode-0", "decode", "198.18.0.2", True)
    docs = render_pool(pool, spec, [pod.name, f"{pool.name}-prefill-0"])
    return [*docs, render_calibration_job(pool, spec, pod, "198.18.0.1", 1)]


def _is_engine(obj: dict[str, Any]) -> bool:
    return obj["kind"] == "Deployment" and "disaggpool.io/role" in obj["metadata"]["labels"]


def _workloads(docs: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    yield from (d for d in docs if d and d["kind"] in ("Deployment", "Job"))


@pytest.mark.parametrize("which", sorted(POOLS))
def test_router_probe_and_engine_pods_meet_their_pod_security_level(which: str) -> None:
    docs = rendered_pool(which)
    restricted_engines = POOLS[which][1] is FULL
    seen = set()
    for obj in _workloads(docs):
        spec = pod_spec(obj)
        if _is_engine(obj):
            seen.add("engine")
            assert baseline_violations(spec) == [], obj["metadata"]["name"]
            # vLLM calls no Kubernetes API: no token in its pods.
            assert spec["automountServiceAccountToken"] is False
            if restricted_engines:
                assert restricted_violations(spec) == [], obj["metadata"]["name"]
                env = {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}
                assert env["HOME"] == "/home/vllm"
                mounts = {m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
                assert {"/home/vllm", "/tmp", "/dev/shm"} <= mounts
            else:  # baseline: not restricted (it runs as the image's user)
                assert "runAsNonRoot" not in str(spec["containers"][0])
                assert "runAsNonRoot" not in str(spec["securityContext"])
            # Our own container in an engine pod (gateway mode) is restricted at any level.
            for c in spec["containers"][1:]:
                alone = {"securityContext": spec["securityContext"], "containers": [c]}
                assert c["name"] == "pd-proxy" and restricted_violations(alone) == []
        else:
            seen.add(obj["kind"])
            assert restricted_violations(spec) == [], obj["metadata"]["name"]
            # The router and the probe call the API: their ServiceAccount's token is mounted.
            assert "automountServiceAccountToken" not in spec
    assert seen == {"engine", "Deployment", "Job"}


def test_the_operator_deployment_is_restricted_in_the_manifests() -> None:
    (dep,) = [d for d in yaml.safe_load_all((MANIFESTS / "03-operator.yaml").read_text()) if d]
    assert restricted_violations(pod_spec(dep)) == []


def test_the_checks_themselves_catch_what_they_claim() -> None:
    """A checker that never fails proves nothing: each rule, broken once."""
    (router,) = [
        d for d in rendered_pool("small") if d["kind"] == "Deployment" and "router" in str(d)
    ][:1]
    good = pod_spec(router)
    assert restricted_violations(good) == []
    breakers: list[Callable[[dict[str, Any]], None]] = [
        lambda p: p["securityContext"].pop("seccompProfile"),
        lambda p: p["securityContext"].pop("runAsNonRoot"),
        lambda p: p["containers"][0]["securityContext"].pop("allowPrivilegeEscalation"),
        lambda p: p["containers"][0]["securityContext"]["capabilities"].update(drop=["NET_RAW"]),
        lambda p: p["containers"][0]["securityContext"].update(readOnlyRootFilesystem=False),
        lambda p: p.update(hostNetwork=True),
        lambda p: p["volumes"].append({"name": "h", "hostPath": {"path": "/"}}),
        lambda p: p["containers"][0]["securityContext"].update(privileged=True),
    ]
    for breaker in breakers:
        bad = json.loads(json.dumps(good))
        breaker(bad)
        assert restricted_violations(bad), breaker


# ----------------------------------------------------------------------------- checkov


@pytest.fixture(scope="module")
def checkov() -> Path:
    return peerkit.installed("checkov", CHECKOV)


def _needs_the_api(resource: str) -> bool:
    """Workloads that call the Kubernetes API (the router, the probe, the operator)."""
    return resource.startswith("Job.") or resource.endswith(("-router", "-operator"))


def _engine(resource: str) -> bool:
    return resource.startswith("Deployment.") and ("-prefill" in resource or "-decode" in resource)


def _baseline_engine(render: str, resource: str) -> bool:
    return _engine(resource) and render != "full"


#: check -> (where it does not apply: (render, resource) -> bool, why). Documented in
#: docs/kubernetes-testing.md ("Pod Security and policy checks").
TOLERATED: dict[str, tuple[Callable[[str, str], bool], str]] = {
    "CKV_K8S_11": (
        lambda r, res: True,
        "CPU limits: none on purpose; a CFS quota throttles latency-critical serving threads, "
        "and the requests reserve the CPUs",
    ),
    "CKV_K8S_15": (
        lambda r, res: True,
        "imagePullPolicy Always: images are pinned by tag and IfNotPresent is set; Always "
        "makes every start depend on a registry",
    ),
    "CKV_K8S_43": (
        lambda r, res: True,
        "image digests: the user names the images; a digest (image@sha256:...) is accepted "
        "wherever an image is",
    ),
    "CKV_K8S_38": (
        lambda r, res: _needs_the_api(res),
        "service-account token: the router, the probe and the operator call the API (every "
        "other pod has automountServiceAccountToken: false)",
    ),
    "CKV_K8S_35": (
        lambda r, res: _engine(res) or res.startswith("Job."),
        "secrets as environment variables: vLLM reads its API key and hub token from its "
        "environment only, and the probe its key (the router reads files)",
    ),
    "CKV2_K8S_6": (
        lambda r, res: r in ("small", "hetero"),
        "NetworkPolicy: optional (networkPolicy.enabled); the renders with it on must pass",
    ),
    **{
        check: (
            _baseline_engine,
            f"{what}: vLLM pods are `baseline` by default and `restricted` (which passes) with "
            "engine.podSecurity: restricted",
        )
        for check, what in (
            ("CKV_K8S_22", "read-only root filesystem"),
            ("CKV_K8S_23", "non-root"),
            ("CKV_K8S_28", "NET_RAW dropped"),
            ("CKV_K8S_37", "capabilities dropped"),
            ("CKV_K8S_40", "a high UID"),
        )
    },
}


def _run_checkov(exe: Path, renders: dict[str, list[dict[str, Any]]], tmp: Path) -> set[str]:
    """Run every check on each render; fail on what is not tolerated; the checks tolerated."""
    used: set[str] = set()
    failures: list[str] = []
    for render, docs in renders.items():
        path = tmp / f"{render}.yaml"
        path.write_text(yaml.safe_dump_all([d for d in docs if d]))
        proc = subprocess.run(
            [str(exe), "-f", str(path), "--framework", "kubernetes", "-o", "json", "--quiet"],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "BC_SKIP_MAPPING": "TRUE", "CHECKOV_NO_UPDATE_CHECK": "1"},
        )
        assert proc.stdout.strip(), proc.stderr[-3000:]
        reports = json.loads(proc.stdout)
        for report in reports if isinstance(reports, list) else [reports]:
            summary = report.get("summary", {})
            assert summary.get("parsing_errors", 0) == 0, summary
            assert summary.get("passed", 0) > 0, summary
            for failed in report.get("results", {}).get("failed_checks", []):
                check, resource = failed["check_id"], failed["resource"]
                where, _ = TOLERATED.get(check, (lambda r, res: False, ""))
                if where(render, resource):
                    used.add(check)
                else:
                    failures.append(f"{render}: {check} {resource}: {failed['check_name']}")
    assert not failures, "\n".join(failures)
    return used


def test_checkov_passes_every_object_the_operator_renders(checkov: Path, tmp_path: Path) -> None:
    renders = {which: rendered_pool(which) for which in POOLS}
    renders["manifests"] = [
        d for p in sorted(MANIFESTS.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text())
    ]
    used = _run_checkov(checkov, renders, tmp_path)
    # Each tolerance is needed somewhere (a stale one would hide a regression).
    assert used == set(TOLERATED), set(TOLERATED) - used


@pytest.mark.parametrize(
    ("render", "values"),
    [
        ("chart-defaults", None),
        ("chart-all-features", CHART / "ci" / "all-features-values.yaml"),
        ("chart-minimal", CHART / "ci" / "minimal-values.yaml"),
    ],
)
def test_checkov_passes_the_chart(
    checkov: Path, render: str, values: Path | None, tmp_path: Path
) -> None:
    require_k8s(("helm",))
    args = [str(CACHE_BIN / "helm"), "template", "dp", str(CHART), "-n", "disaggpool-system"]
    if values is not None:
        args += ["-f", str(values)]
    out = subprocess.run(args, capture_output=True, text=True, timeout=60, check=True).stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    assert restricted_violations(pod_spec(dep)) == []
    _run_checkov(checkov, {render: docs}, tmp_path)
