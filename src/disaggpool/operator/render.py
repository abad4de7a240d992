"""Pure rendering: (pool, spec) -> Kubernetes objects; observed objects -> calibration plan, status.

No I/O, no clock (callers pass `now`), no randomness: the same inputs give byte-identical output,
which is what the golden-file tests in tests/operator check and what makes reconciliation
idempotent. Every
object carries an owner reference to the pool (deleting the pool garbage-collects it) and an
annotation with the hash of its rendered body, so `reconcile` can tell "unchanged" from "needs a
patch" without diffing against server-side defaults.

Naming (the sidecar's contract): vLLM pods carry ``disaggpool.io/pool`` and ``disaggpool.io/role``;
the router is Deployment/Service/ConfigMap ``<pool>-router`` (config key ``sidecar.yaml``); a pod's
profile is ConfigMap ``<pool>-profile-<pod>`` labelled ``disaggpool.io/profile=true``.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import yaml

from disaggpool.core.profile import CalibrationProfile, profile_from_dict
from disaggpool.errors import InputError
from disaggpool.formats.profiles import load_yaml
from disaggpool.operator.spec import PoolSpec, RoleSpec, SpecIssue, VariantSpec

__all__ = [
    "API_VERSION",
    "GROUP",
    "HASH_ANNOTATION",
    "KIND",
    "CalibrationPlan",
    "PodView",
    "PoolRef",
    "ProfileView",
    "compute_status",
    "object_hash",
    "plan_calibration",
    "pod_view",
    "profile_configmap_name",
    "profile_view",
    "render_calibration_job",
    "render_pool",
    "render_router_config",
]

GROUP = "disaggpool.io"
API_VERSION = f"{GROUP}/v1alpha1"
KIND = "DisaggPool"
HASH_ANNOTATION = f"{GROUP}/spec-hash"
CONFIG_HASH_ANNOTATION = f"{GROUP}/config-hash"
OBSERVED_ERROR_ANNOTATION = f"{GROUP}/observed-error"
L_POOL, L_ROLE, L_POD = f"{GROUP}/pool", f"{GROUP}/role", f"{GROUP}/pod"
L_PROFILE, L_COMPONENT, L_VARIANT = f"{GROUP}/profile", f"{GROUP}/component", f"{GROUP}/variant"
L_ATTEMPT = f"{GROUP}/attempt"
ROUTER_GRPC_PORT, ROUTER_HTTP_PORT = 50051, 8000
CONFIG_DIR = "/etc/disaggpool"
# Jobs kept per pod: the trailing failures (they count attempts) plus this many older ones.
KEEP_OLD_JOBS = 1


@dataclasses.dataclass(frozen=True, slots=True)
class PoolRef:
    """The identity of a DisaggPool object (what owner references and labels need)."""

    name: str
    namespace: str
    uid: str
    generation: int = 1


def _owner(pool: PoolRef) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": pool.name,
        "uid": pool.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _labels(pool: PoolRef, component: str, **extra: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "disaggpool",
        "app.kubernetes.io/instance": pool.name,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/managed-by": "disaggpool-operator",
        L_POOL: pool.name,
        **extra,
    }


def object_hash(obj: Mapping[str, Any]) -> str:
    """sha256 (16 hex) of an object's canonical JSON, without the hash annotation itself."""
    body = json.loads(json.dumps(obj, sort_keys=True))
    body.get("metadata", {}).get("annotations", {}).pop(HASH_ANNOTATION, None)
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


def _finish(obj: dict[str, Any], pool: PoolRef) -> dict[str, Any]:
    md = obj["metadata"]
    md["namespace"] = pool.namespace
    md["ownerReferences"] = [_owner(pool)]
    md.setdefault("annotations", {})[HASH_ANNOTATION] = object_hash(obj)
    return obj


# ------------------------------------------------------------------------------- vLLM workloads


def workload_name(pool: PoolRef, role: str, variant: VariantSpec) -> str:
    return f"{pool.name}-{role}" + (f"-{variant.name}" if variant.name else "")


def _kv_transfer_config(spec: PoolSpec, role: str) -> str:
    cfg = {
        "kv_connector": spec.kv_transfer.connector,
        # P produces KV, D consumes it (vllm-pd-protocol.md 1.1; kv_both is deprecated with Nixl).
        "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
        "kv_load_failure_policy": spec.kv_transfer.load_failure_policy,
        "kv_connector_extra_config": {"backends": list(spec.kv_transfer.backends)},
    }
    return json.dumps(cfg, sort_keys=True, separators=(",", ":"))


def _probe(path: str, port: str, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


def _vllm_deployment(
    pool: PoolRef, spec: PoolSpec, role: RoleSpec, variant: VariantSpec
) -> dict[str, Any]:
    name = workload_name(pool, role.role, variant)
    selector = {L_POOL: pool.name, L_ROLE: role.role}
    if variant.name:
        selector[L_VARIANT] = variant.name
    labels = _labels(pool, "vllm", **selector)
    m, e, kv = spec.model, spec.engine, spec.kv_transfer
    args = [
        "serve",
        m.model_arg,
        "--served-model-name",
        m.served_model_name,
        "--port",
        str(e.port),
        "--tensor-parallel-size",
        str(variant.gpus),
        "--kv-transfer-config",
        _kv_transfer_config(spec, role.role),
    ]
    if m.max_model_len:
        args += ["--max-model-len", str(m.max_model_len)]
    args += [*e.extra_args, *variant.extra_args]
    env: list[dict[str, Any]] = [
        # P copies this host verbatim into kv_transfer_params.remote_host; D dials it, so it must be
        # the pod IP, not the default "localhost" (vllm-pd-protocol.md 1.2).
        {
            "name": "VLLM_NIXL_SIDE_CHANNEL_HOST",
            "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
        },
        {"name": "VLLM_NIXL_SIDE_CHANNEL_PORT", "value": str(kv.side_channel_port)},
        # The engine may take long to build; keep vLLM's own deadline inside the startup probe's.
        {"name": "VLLM_ENGINE_READY_TIMEOUT_S", "value": str(max(60, e.startup_timeout_s - 60))},
    ]
    if m.hub_token_secret:
        env.append(
            {
                "name": "HF_TOKEN",
                "valueFrom": {"secretKeyRef": {"name": m.hub_token_secret, "key": m.hub_token_key}},
            }
        )
    env += [dict(x) for x in e.env]
    resources: dict[str, Any] = json.loads(json.dumps(dict(e.resources)))
    for kind in ("limits", "requests"):
        resources.setdefault(kind, {})[variant.gpu_resource] = variant.gpus
    volumes: list[dict[str, Any]] = [
        # NCCL/NIXL and PyTorch use /dev/shm well beyond the container runtime's 64 MiB default.
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": e.shared_memory}}
    ]
    mounts: list[dict[str, Any]] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    if m.pvc_claim:
        volumes.append(
            {"name": "model", "persistentVolumeClaim": {"claimName": m.pvc_claim, "readOnly": True}}
        )
        mounts.append({"name": "model", "mountPath": m.mount_path, "readOnly": True})
    container: dict[str, Any] = {
        "name": "vllm",
        "image": e.image,
        "imagePullPolicy": e.image_pull_policy,
        "command": ["vllm"],
        "args": args,
        "env": env,
        "ports": [
            {"name": "http", "containerPort": e.port, "protocol": "TCP"},
            {"name": "nixl", "containerPort": kv.side_channel_port, "protocol": "TCP"},
        ],
        "resources": resources,
        "volumeMounts": mounts,
        # vLLM's HTTP socket refuses connections until weights are loaded and the engine is built
        # (minutes); the startup probe owns that window so liveness cannot kill a loading pod.
        "startupProbe": _probe("/health", "http", 10, math.ceil(e.startup_timeout_s / 10)),
        "readinessProbe": _probe("/health", "http", 5, 3),
        "livenessProbe": _probe("/health", "http", 15, 4),
    }
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": volumes,
        "terminationGracePeriodSeconds": 60,
    }
    if variant.node_selector:
        pod_spec["nodeSelector"] = dict(variant.node_selector)
    if variant.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in variant.tolerations]
    if variant.affinity:
        pod_spec["affinity"] = dict(variant.affinity)
    pod_labels = dict(labels)
    annotations = {f"{GROUP}/gpu-type": variant.gpu_type} if variant.gpu_type else {}
    template_md: dict[str, Any] = {"labels": pod_labels}
    if annotations:
        template_md["annotations"] = annotations
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "replicas": variant.replicas,
            "selector": {"matchLabels": selector},
            # Never take a serving pod away before its replacement is ready: GPUs are scarce and a
            # vLLM start takes minutes.
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
            },
            "template": {"metadata": template_md, "spec": pod_spec},
        },
    }


def _headless_service(pool: PoolRef, spec: PoolSpec, role: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": f"{pool.name}-{role}",
            "labels": _labels(pool, "vllm", **{L_ROLE: role}),
        },
        "spec": {
            "clusterIP": "None",
            # Calibration and the router address pods by IP before they are Ready-gated elsewhere.
            "publishNotReadyAddresses": True,
            "selector": {L_POOL: pool.name, L_ROLE: role},
            "ports": [
                {"name": "http", "port": spec.engine.port, "targetPort": "http"},
                {
                    "name": "nixl",
                    "port": spec.kv_transfer.side_channel_port,
                    "targetPort": "nixl",
                },
            ],
        },
    }


# ------------------------------------------------------------------------------------- router


def render_router_config(pool: PoolRef, spec: PoolSpec) -> str:
    """The sidecar's YAML config (the contract in docs/operator.md)."""
    r = spec.router
    doc = {
        "policy": r.policy,
        "model": spec.model.served_model_name,
        "listen": {"grpc": f"0.0.0.0:{ROUTER_GRPC_PORT}", "http": f"0.0.0.0:{ROUTER_HTTP_PORT}"},
        "slo_classes": [
            {"name": c.name, "ttft_s": c.ttft_s, "tpot_s": c.tpot_s} for c in r.slo_classes
        ],
        "default_slo_class": r.default_slo_class,
        "predictor": r.predictor,
        "scrape_interval_s": r.scrape_interval_s,
        "max_inflight": r.max_inflight,
        "pool": {
            "kubernetes": {
                "namespace": pool.namespace,
                "selector": f"{L_POOL}={pool.name}",
                "port": spec.engine.port,
            }
        },
        "profiles": {
            "kubernetes": {
                "namespace": pool.namespace,
                "selector": f"{L_POOL}={pool.name},{L_PROFILE}=true",
            }
        },
    }
    return yaml.safe_dump(doc, sort_keys=False, default_flow_style=False)


def _router_objects(pool: PoolRef, spec: PoolSpec) -> list[dict[str, Any]]:
    name = f"{pool.name}-router"
    config = render_router_config(pool, spec)
    selector = {L_POOL: pool.name, L_COMPONENT: "router"}
    labels = _labels(pool, "router", **{L_COMPONENT: "router"})
    resources = json.loads(json.dumps(dict(spec.router.resources))) or {
        "requests": {"cpu": "500m", "memory": "256Mi"},
        "limits": {"memory": "1Gi"},
    }
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "replicas": spec.router.replicas,
            "selector": {"matchLabels": selector},
            "template": {
                "metadata": {
                    "labels": labels,
                    # A config change must restart the router (it reads the file at start).
                    "annotations": {
                        CONFIG_HASH_ANNOTATION: hashlib.sha256(config.encode()).hexdigest()[:16]
                    },
                },
                "spec": {
                    "serviceAccountName": name,
                    "securityContext": {"runAsNonRoot": True, "runAsUser": 65532},
                    "containers": [
                        {
                            "name": "router",
                            "image": spec.router.image,
                            "command": ["disaggpool", "sidecar"],
                            "args": ["--config", f"{CONFIG_DIR}/sidecar.yaml"],
                            "ports": [
                                {"name": "grpc", "containerPort": ROUTER_GRPC_PORT},
                                {"name": "http", "containerPort": ROUTER_HTTP_PORT},
                            ],
                            "readinessProbe": _probe("/health", "http", 5, 3),
                            "livenessProbe": _probe("/health", "http", 10, 6),
                            "resources": resources,
                            "securityContext": {
                                "allowPrivilegeEscalation": False,
                                "readOnlyRootFilesystem": True,
                                "capabilities": {"drop": ["ALL"]},
                            },
                            "volumeMounts": [
                                {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}
                            ],
                        }
                    ],
                    "volumes": [{"name": "config", "configMap": {"name": name}}],
                },
            },
        },
    }
    return [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": name, "labels": labels},
            "data": {"sidecar.yaml": config},
        },
        deployment,
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": name, "labels": labels},
            "spec": {
                "selector": selector,
                "ports": [
                    {"name": "grpc", "port": ROUTER_GRPC_PORT, "targetPort": "grpc"},
                    {"name": "http", "port": ROUTER_HTTP_PORT, "targetPort": "http"},
                ],
            },
        },
    ]


def _rbac(pool: PoolRef, who: str, rules: list[dict[str, Any]]) -> list[dict[str, Any]]:
    name = f"{pool.name}-{who}"
    labels = _labels(pool, who)
    return [
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": name, "labels": labels},
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": {"name": name, "labels": labels},
            "rules": rules,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"name": name, "labels": labels},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": pool.namespace}],
        },
    ]


# The router discovers pods and profiles and nothing else; the probe only writes its ConfigMap
# (create, or get + merge-patch on a re-probe: calibration/sinks.py).
ROUTER_RULES: list[dict[str, Any]] = [
    {"apiGroups": [""], "resources": ["pods", "configmaps"], "verbs": ["get", "list", "watch"]}
]
PROBE_RULES: list[dict[str, Any]] = [
    {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["create", "get", "patch"]}
]


def render_pool(pool: PoolRef, spec: PoolSpec) -> list[dict[str, Any]]:
    """Every object a pool consists of, in apply order (RBAC before the pods that use it)."""
    objs: list[dict[str, Any]] = []
    objs += _rbac(pool, "router", ROUTER_RULES)
    if spec.calibration.enabled:
        objs += _rbac(pool, "probe", PROBE_RULES)
    for role in (spec.prefill, spec.decode):
        objs.append(_headless_service(pool, spec, role.role))
        objs += [_vllm_deployment(pool, spec, role, v) for v in role.variants]
    objs += _router_objects(pool, spec)
    return [_finish(o, pool) for o in objs]


# --------------------------------------------------------------------------------- calibration


@dataclasses.dataclass(frozen=True, slots=True)
class PodView:
    """What the operator needs from a vLLM pod."""

    name: str
    role: str
    ip: str
    ready: bool
    variant: str = ""
    gpu_type: str = ""
    deleting: bool = False


def pod_view(pod: Mapping[str, Any]) -> PodView | None:
    """A pool's vLLM pod, or None for anything else (router pods, foreign pods)."""
    md = pod.get("metadata") or {}
    labels = md.get("labels") or {}
    role = labels.get(L_ROLE)
    if role not in ("prefill", "decode"):
        return None
    status = pod.get("status") or {}
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )
    return PodView(
        name=str(md.get("name", "")),
        role=str(role),
        ip=str(status.get("podIP") or ""),
        ready=ready,
        variant=str(labels.get(L_VARIANT, "")),
        gpu_type=str((md.get("annotations") or {}).get(f"{GROUP}/gpu-type", "")),
        deleting=bool(md.get("deletionTimestamp")),
    )


@dataclasses.dataclass(frozen=True, slots=True)
class ProfileView:
    """A profile ConfigMap as read back: the parsed profile or why it could not be parsed."""

    configmap: str
    pod: str
    profile: CalibrationProfile | None
    error: str = ""
    observed_error: float | None = None
    owned: bool = True


def profile_configmap_name(pool: PoolRef | str, pod: str) -> str:
    return f"{pool if isinstance(pool, str) else pool.name}-profile-{pod}"


def profile_view(cm: Mapping[str, Any]) -> ProfileView:
    md = cm.get("metadata") or {}
    name = str(md.get("name", ""))
    pod = str((md.get("labels") or {}).get(L_POD, ""))
    owned = bool(md.get("ownerReferences"))
    observed: float | None = None
    raw_obs = (md.get("annotations") or {}).get(OBSERVED_ERROR_ANNOTATION)
    if raw_obs is not None:
        try:
            observed = float(raw_obs)
        except ValueError:
            observed = None
    text = (cm.get("data") or {}).get("profile.yaml")
    if not text:
        return ProfileView(name, pod, None, "no profile.yaml yet", observed, owned)
    try:
        profile = profile_from_dict(load_yaml(text), source=f"ConfigMap {name}")
    except (InputError, yaml.YAMLError) as exc:
        return ProfileView(name, pod, None, str(exc), observed, owned)
    return ProfileView(name, pod, profile, "", observed, owned)


def _parse_time(text: str) -> dt.datetime | None:
    try:
        t = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return t if t.tzinfo else t.replace(tzinfo=dt.UTC)


@dataclasses.dataclass(frozen=True, slots=True)
class JobView:
    name: str
    pod: str
    attempt: int
    state: str  # active | succeeded | failed


def job_view(job: Mapping[str, Any]) -> JobView | None:
    md = job.get("metadata") or {}
    labels = md.get("labels") or {}
    if L_POD not in labels:
        return None
    status = job.get("status") or {}
    conds = {c.get("type"): c.get("status") for c in status.get("conditions") or []}
    if conds.get("Complete") == "True" or (status.get("succeeded") or 0) > 0:
        state = "succeeded"
    elif conds.get("Failed") == "True":
        state = "failed"
    else:
        state = "active"
    try:
        attempt = int(labels.get(L_ATTEMPT, "0"))
    except ValueError:
        attempt = 0
    return JobView(str(md.get("name", "")), str(labels[L_POD]), attempt, state)


def _job_name(pool: PoolRef, pod: str, attempt: int) -> str:
    # Pod names run up to 63 characters; a hash keeps the Job name (and its pods' job-name label)
    # within 63 while staying stable for the same pod and attempt.
    return f"{pool.name}-cal-{hashlib.sha256(pod.encode()).hexdigest()[:10]}-{attempt}"


def render_calibration_job(
    pool: PoolRef, spec: PoolSpec, pod: PodView, peer_ip: str | None, attempt: int
) -> dict[str, Any]:
    """The probe as a Job owned by the pool: `disaggpool calibrate` in the operator's image."""
    c = spec.calibration
    cm = profile_configmap_name(pool, pod.name)
    labels = _labels(
        pool, "calibration", **{L_POD: pod.name, L_ROLE: pod.role, L_ATTEMPT: str(attempt)}
    )
    args = [
        "calibrate",
        "--endpoint",
        f"http://{pod.ip}:{spec.engine.port}",
        "--role",
        pod.role,
        "--name",
        pod.name,
        "--configmap",
        f"{pool.namespace}/{cm}",
        "--configmap-labels",
        f"{L_POOL}={pool.name},{L_POD}={pod.name},{L_PROFILE}=true",
        "--out",
        "-",
        "--budget-seconds",
        f"{c.budget_s:g}",
    ]
    if pod.role == "decode" and peer_ip:
        args += ["--peer", f"http://{peer_ip}:{spec.engine.port}"]
    if pod.gpu_type:
        args += ["--gpu", pod.gpu_type]
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": _job_name(pool, pod.name, attempt), "labels": labels},
        "spec": {
            "backoffLimit": c.backoff_limit,
            # The probe's budget plus warm-up and the fit; a stuck probe must not block re-probes.
            "activeDeadlineSeconds": int(c.budget_s * 3) + 300,
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "restartPolicy": "Never",
                    "serviceAccountName": f"{pool.name}-probe",
                    "securityContext": {"runAsNonRoot": True, "runAsUser": 65532},
                    "containers": [
                        {
                            "name": "probe",
                            "image": c.image,
                            "command": ["disaggpool"],
                            "args": args,
                            "resources": {
                                "requests": {"cpu": "500m", "memory": "256Mi"},
                                "limits": {"memory": "1Gi"},
                            },
                            "securityContext": {
                                "allowPrivilegeEscalation": False,
                                "readOnlyRootFilesystem": True,
                                "capabilities": {"drop": ["ALL"]},
                            },
                        }
                    ],
                },
            },
        },
    }
    return _finish(job, pool)


@dataclasses.dataclass(frozen=True, slots=True)
class PodCalibration:
    pod: PodView
    state: str  # pending | probing | calibrated | poor | failed | stale | disabled
    reason: str
    profile: ProfileView | None
    job: str = ""


@dataclasses.dataclass(slots=True)
class CalibrationPlan:
    """What one reconcile pass should do about calibration, and what it found."""

    create_jobs: list[dict[str, Any]]
    delete_jobs: list[str]
    delete_configmaps: list[str]
    adopt_configmaps: list[str]
    pods: list[PodCalibration]


def _needs_probe(spec: PoolSpec, view: ProfileView | None, now: dt.datetime) -> str:
    """Why a pod's profile must be (re)measured, or "" when it is good to use."""
    if view is None or view.profile is None:
        return "missing" if view is None else f"unreadable: {view.error}"
    p, c = view.profile, spec.calibration
    if p.quality == "poor":
        return "poor" if c.reprobe_on_poor else ""
    if c.max_age_s > 0 and p.fitted_at:  # no fitted_at: a hand-written profile, not aged
        fitted = _parse_time(p.fitted_at)
        if fitted is None or (now - fitted).total_seconds() > c.max_age_s:
            return "stale"
    if c.max_prediction_error > 0 and (view.observed_error or 0.0) > c.max_prediction_error:
        return "drift"
    return ""


def plan_calibration(
    pool: PoolRef,
    spec: PoolSpec,
    pods: Iterable[PodView],
    profiles: Iterable[ProfileView],
    jobs: Iterable[JobView],
    now: dt.datetime,
) -> CalibrationPlan:
    """Decide per pod: keep its profile, wait for its probe, start a probe, or give up."""
    pods = sorted(pods, key=lambda p: p.name)
    by_pod_profile = {v.pod: v for v in profiles if v.pod}
    jobs_by_pod: dict[str, list[JobView]] = {}
    for j in jobs:
        jobs_by_pod.setdefault(j.pod, []).append(j)
    for js in jobs_by_pod.values():
        js.sort(key=lambda j: j.attempt)
    live = {p.name for p in pods}
    plan = CalibrationPlan([], [], [], [], [])
    # A deleted pod's profile and probes go away (the router must not score a ghost).
    for pod_name, pv in sorted(by_pod_profile.items()):
        if pod_name not in live:
            plan.delete_configmaps.append(pv.configmap)
        elif not pv.owned:
            plan.adopt_configmaps.append(pv.configmap)
    for pod_name, js in sorted(jobs_by_pod.items()):
        if pod_name not in live:
            plan.delete_jobs += [j.name for j in js]
    peer = next((p.ip for p in pods if p.role == "prefill" and p.ready and p.ip), None)
    for pod in pods:
        view = by_pod_profile.get(pod.name)
        js = jobs_by_pod.get(pod.name, [])
        # Failures since the last success are the attempts spent on the current measurement.
        trailing = 0
        for j in reversed(js):
            if j.state != "failed":
                break
            trailing += 1
        last_success = max((i for i, j in enumerate(js) if j.state == "succeeded"), default=-1)
        keep_from = max(0, min(len(js) - trailing, last_success) - KEEP_OLD_JOBS + 1)
        plan.delete_jobs += [j.name for j in js[:keep_from] if j.state != "active"]
        active = next((j for j in js if j.state == "active"), None)
        reason = _needs_probe(spec, view, now)
        if not spec.calibration.enabled:
            state = "calibrated" if view and view.profile and not reason else "disabled"
            plan.pods.append(PodCalibration(pod, state, "calibration disabled", view))
            continue
        if not reason:
            plan.pods.append(PodCalibration(pod, "calibrated", "", view, js[-1].name if js else ""))
            continue
        label = {"missing": "pending", "poor": "poor", "stale": "stale", "drift": "stale"}.get(
            reason, "pending"
        )
        if active is not None:
            plan.pods.append(PodCalibration(pod, "probing", reason, view, active.name))
        elif not pod.ready or not pod.ip or pod.deleting:
            plan.pods.append(PodCalibration(pod, label, f"{reason}; waiting for Ready", view))
        elif trailing >= spec.calibration.max_attempts:
            plan.pods.append(
                PodCalibration(
                    pod,
                    "failed",
                    f"{reason}; {trailing} probe attempts failed",
                    view,
                    js[-1].name,
                )
            )
        elif pod.role == "decode" and spec.prefill.replicas > 0 and peer is None:
            # The decode probe measures KV transfer from a prefill peer; wait for one.
            plan.pods.append(
                PodCalibration(pod, label, f"{reason}; waiting for a prefill peer", view)
            )
        else:
            attempt = (js[-1].attempt + 1) if js else 1
            job = render_calibration_job(pool, spec, pod, peer, attempt)
            plan.create_jobs.append(job)
            plan.pods.append(PodCalibration(pod, "probing", reason, view, job["metadata"]["name"]))
    return plan


# --------------------------------------------------------------------------------------- status


def _profile_summary(p: CalibrationProfile) -> dict[str, Any]:
    def num(x: float) -> float:
        return float(f"{x:.6g}")

    return {
        "prefill": {k: num(getattr(p.prefill, k)) for k in ("p0", "p1", "p2")},
        "decode": {k: num(getattr(p.decode, k)) for k in ("d0", "d1", "d2")},
        "kvTransfer": {
            "k0": num(p.kv_transfer.k0),
            "bytesPerToken": num(p.kv_transfer.bytes_per_token),
            "bandwidthBytesPerSecond": num(p.kv_transfer.bandwidth_bytes_per_s),
        },
        "kvCapacityTokens": p.kv_capacity_tokens,
    }


def _pod_status(c: PodCalibration) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": c.pod.name,
        "role": c.pod.role,
        "ready": c.pod.ready,
        "calibration": c.state,
    }
    if c.pod.variant:
        out["variant"] = c.pod.variant
    if c.pod.ip:
        out["ip"] = c.pod.ip
    if c.reason:
        out["reason"] = c.reason
    if c.job:
        out["job"] = c.job
    if c.profile is not None:
        out["profileRef"] = c.profile.configmap
        p = c.profile.profile
        if p is not None:
            out["quality"] = p.quality
            if p.fitted_at:
                out["fittedAt"] = p.fitted_at
            if p.ttft_mape is not None:
                out["ttftError"] = float(f"{p.ttft_mape:.4g}")
            if p.tpot_mape is not None:
                out["tpotError"] = float(f"{p.tpot_mape:.4g}")
            out["constants"] = _profile_summary(p)
    return out


def _condition(
    previous: Sequence[Mapping[str, Any]],
    kind: str,
    status: bool,
    reason: str,
    message: str,
    generation: int,
    now: dt.datetime,
) -> dict[str, Any]:
    old = next((c for c in previous if c.get("type") == kind), None)
    value = "True" if status else "False"
    # lastTransitionTime moves only on a transition: an unchanged pool keeps an identical status.
    when = (
        old["lastTransitionTime"]
        if old and old.get("status") == value and old.get("lastTransitionTime")
        else now.strftime("%Y-%m-%dT%H:%M:%SZ")
    )
    return {
        "type": kind,
        "status": value,
        "reason": reason,
        "message": message,
        "lastTransitionTime": when,
        "observedGeneration": generation,
    }


def compute_status(
    pool: PoolRef,
    spec: PoolSpec | None,
    issues: Sequence[SpecIssue],
    applied_generation: int | None,
    pods: Sequence[PodView],
    plan: CalibrationPlan | None,
    router_ready: int,
    previous: Mapping[str, Any],
    now: dt.datetime,
) -> dict[str, Any]:
    """The CR's status.

    `spec` is the spec in force: the current one, or, while the current one is invalid (`issues`),
    the last one applied (None if there never was one). `applied_generation` is the generation whose
    spec was last rendered.
    """
    prev_conds: list[Mapping[str, Any]] = list(previous.get("conditions") or [])
    gen = pool.generation
    status: dict[str, Any] = {"observedGeneration": gen}
    desired = {
        "prefill": spec.prefill.replicas if spec else None,
        "decode": spec.decode.replicas if spec else None,
    }
    for role in ("prefill", "decode"):
        ready = sum(1 for p in pods if p.role == role and p.ready and not p.deleting)
        want = desired[role]
        if want is None:  # invalid spec: report what runs against what was last asked for
            want = int((previous.get(role) or {}).get("desired", 0))
        status[role] = {"ready": ready, "desired": want}
        status[f"{role}Replicas"] = f"{ready}/{want}"
    pod_states = [_pod_status(c) for c in plan.pods] if plan else []
    calibrated = sum(1 for c in plan.pods if c.state == "calibrated") if plan else 0
    failed = [c for c in plan.pods if c.state == "failed"] if plan else []
    status["calibratedPods"] = calibrated
    status["pods"] = pod_states
    if spec is not None:
        status["policy"] = spec.router.policy
    else:
        status["policy"] = previous.get("policy", "")
    status["routerEndpoint"] = {
        "http": f"http://{pool.name}-router.{pool.namespace}.svc:{ROUTER_HTTP_PORT}",
        "grpc": f"{pool.name}-router.{pool.namespace}.svc:{ROUTER_GRPC_PORT}",
    }
    if applied_generation is not None:
        status["appliedGeneration"] = applied_generation

    all_ready = (
        spec is not None
        and status["prefill"]["ready"] >= status["prefill"]["desired"]
        and status["decode"]["ready"] >= status["decode"]["desired"]
        and router_ready >= min(1, spec.router.replicas)
    )
    ready_pods = [c for c in (plan.pods if plan else []) if c.pod.ready]
    all_calibrated = bool(ready_pods) and all(c.state == "calibrated" for c in ready_pods)
    conds = []
    if issues:
        msg = "; ".join(str(i) for i in issues)
        keeps = " (the pool keeps running as last applied)" if spec is not None else ""
        conds.append(_condition(prev_conds, "Degraded", True, "InvalidSpec", msg + keeps, gen, now))
    elif failed:
        names = ", ".join(c.pod.name for c in failed)
        conds.append(
            _condition(
                prev_conds, "Degraded", True, "CalibrationFailed", f"gave up on {names}", gen, now
            )
        )
    else:
        conds.append(
            _condition(prev_conds, "Degraded", False, "AsExpected", "no problems", gen, now)
        )
    if spec is None:
        conds.append(
            _condition(prev_conds, "Ready", False, "InvalidSpec", "spec is invalid", gen, now)
        )
    elif all_ready and not issues:
        conds.append(
            _condition(prev_conds, "Ready", True, "AllReplicasReady", "all pods ready", gen, now)
        )
    else:
        waiting = (
            f"prefill {status['prefillReplicas']}, decode {status['decodeReplicas']}, "
            f"router {router_ready}/{spec.router.replicas} ready"
        )
        conds.append(_condition(prev_conds, "Ready", False, "WaitingForPods", waiting, gen, now))
    if spec is not None and not spec.calibration.enabled:
        conds.append(
            _condition(
                prev_conds, "Calibrated", False, "Disabled", "calibration disabled", gen, now
            )
        )
    elif all_calibrated:
        conds.append(
            _condition(
                prev_conds,
                "Calibrated",
                True,
                "ProfilesCurrent",
                f"{calibrated} pods calibrated",
                gen,
                now,
            )
        )
    else:
        pending = [c.pod.name for c in ready_pods if c.state != "calibrated"]
        msg = f"waiting for {', '.join(pending)}" if pending else "no ready pods yet"
        conds.append(_condition(prev_conds, "Calibrated", False, "Calibrating", msg, gen, now))
    status["conditions"] = conds

    if issues:
        phase = "Degraded" if spec is not None else "Invalid"
    elif spec is None:
        phase = "Invalid"
    elif failed:
        phase = "Degraded"
    elif not all_ready:
        phase = "Progressing"
    elif spec.calibration.enabled and not all_calibrated:
        phase = "Calibrating"
    else:
        phase = "Ready"
    status["phase"] = phase
    return status
