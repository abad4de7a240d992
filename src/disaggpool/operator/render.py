"""Pure rendering of a pool's workloads: (pool, spec) -> the Kubernetes objects it consists of.

vLLM Deployments (one per role and variant) and their headless Services, the router (ConfigMap
with the sidecar's config, Deployment, Service) and the ServiceAccounts/Roles of the router and
the probe. No I/O, no clock, no randomness: the same inputs give byte-identical output, which is
what the golden-file tests in tests/operator check and what makes reconciliation idempotent.
Every object is `names.stamp`ed: owned by the pool (deleting the pool garbage-collects it) and
annotated with the hash of its body. Called by `reconcile`; the probe Job is `calibration_plan`'s.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

import yaml

from disaggpool.labels import (
    COMPONENT_LABEL,
    COMPONENT_ROUTER,
    CONFIG_HASH_ANNOTATION,
    GPU_TYPE_ANNOTATION,
    GROUP,
    PLURAL,
    POOL_LABEL,
    PROFILE_LABELS,
    ROLE_LABEL,
    VARIANT_LABEL,
    format_selector,
    of_pool,
)
from disaggpool.operator.names import (
    KV_EVENTS_PORT,
    ROUTER_GRPC_PORT,
    ROUTER_HTTP_PORT,
    PoolRef,
    pool_labels,
    role_service_name,
    router_name,
    service_account_name,
    stamp,
    workload_name,
)
from disaggpool.operator.spec import PoolSpec, RoleSpec, VariantSpec

__all__ = [
    "CONFIG_DIR",
    "PROBE_RULES",
    "ROUTER_CONFIG_KEY",
    "ROUTER_RULES",
    "container_security_context",
    "pod_security_context",
    "render_pool",
    "render_router_config",
]

CONFIG_DIR = "/etc/disaggpool"
ROUTER_CONFIG_KEY = "sidecar.yaml"


def pod_security_context() -> dict[str, Any]:
    """The pod-level hardening of the router and the probe (non-root)."""
    return {"runAsNonRoot": True, "runAsUser": 65532}


def container_security_context() -> dict[str, Any]:
    """The container-level hardening of the router and the probe."""
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def _kv_transfer_config(spec: PoolSpec, role: str, cpu: bool) -> str:
    cfg: dict[str, Any] = {
        "kv_connector": spec.kv_transfer.connector,
        # P produces KV, D consumes it (docs/vllm-protocol.md §1.1; kv_both is deprecated with
        # Nixl).
        "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
        "kv_load_failure_policy": spec.kv_transfer.load_failure_policy,
        "kv_connector_extra_config": {"backends": list(spec.kv_transfer.backends)},
    }
    if cpu:  # a CPU engine has no device buffer: stage the KV in host memory (vLLM's CPU P/D)
        cfg["kv_buffer_device"] = "cpu"
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
    name = workload_name(pool, role.role, variant.name)
    selector = {POOL_LABEL: pool.name, ROLE_LABEL: role.role}
    if variant.name:
        selector[VARIANT_LABEL] = variant.name
    labels = pool_labels(pool, "vllm", **selector)
    m, e, kv = spec.model, spec.engine, spec.kv_transfer
    args = [
        "serve",
        m.model_arg,
        "--served-model-name",
        m.served_model_name,
        "--port",
        str(e.port),
        "--tensor-parallel-size",
        str(max(1, variant.gpus)),  # a CPU engine (gpus 0) runs one worker
        "--kv-transfer-config",
        _kv_transfer_config(spec, role.role, cpu=variant.gpus == 0),
    ]
    if m.max_model_len:
        args += ["--max-model-len", str(m.max_model_len)]
    if spec.router.kv_events and role.role == "prefill":
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{KV_EVENTS_PORT}",
        }
        args += ["--kv-events-config", json.dumps(events, separators=(",", ":"))]
    if spec.router.priority_scheduling:  # the router's priorities are refused under fcfs
        args += ["--scheduling-policy", "priority"]
    args += [*e.extra_args, *variant.extra_args]
    env: list[dict[str, Any]] = [
        # P copies this host verbatim into kv_transfer_params.remote_host; D dials it, so it must be
        # the pod IP, not the default "localhost" (docs/vllm-protocol.md §1.2).
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
    if variant.gpus:  # a CPU engine asks for no GPU; engine.resources says what it needs
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
    annotations = {GPU_TYPE_ANNOTATION: variant.gpu_type} if variant.gpu_type else {}
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
            "name": role_service_name(pool, role),
            "labels": pool_labels(pool, "vllm", **{ROLE_LABEL: role}),
        },
        "spec": {
            "clusterIP": "None",
            # Calibration and the router address pods by IP before they are Ready-gated elsewhere.
            "publishNotReadyAddresses": True,
            "selector": {POOL_LABEL: pool.name, ROLE_LABEL: role},
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


# A router pod's SIGTERM: it serves on, failing its readiness, for the delay, then finishes what
# it holds; the grace period covers both with 5 s to spare (sidecar/CONFIG.md, "Shutdown").
ROUTER_TERMINATION_GRACE_S = 60
ROUTER_SHUTDOWN_DELAY_S = 5


def render_router_config(pool: PoolRef, spec: PoolSpec) -> str:
    """The sidecar's YAML config (the contract in docs/operator.md)."""
    r = spec.router
    doc = {
        "policy": r.policy,
        "model": spec.model.served_model_name,
        "listen": {"grpc": f"0.0.0.0:{ROUTER_GRPC_PORT}", "http": f"0.0.0.0:{ROUTER_HTTP_PORT}"},
        "slo_classes": [
            {"name": c.name, "ttft_s": c.ttft_s, "tpot_s": c.tpot_s}
            | ({"sheddable": True} if c.sheddable else {})
            for c in r.slo_classes
        ],
        "default_slo_class": r.default_slo_class,
        "predictor": r.predictor,
        "scrape_interval_s": r.scrape_interval_s,
        "max_inflight": r.max_inflight,
        "decode_binding": r.decode_binding,
        "pd_decider": r.pd_decider,
        "local_prefill_below": r.local_prefill_below,
        "priority_scheduling": r.priority_scheduling,
        "prefix_index": r.prefix_index,
        # Long enough for the endpoints controller and kube-proxy to drop a terminating router.
        "shutdown_delay_s": ROUTER_SHUTDOWN_DELAY_S,
        "shutdown_timeout_s": ROUTER_TERMINATION_GRACE_S - ROUTER_SHUTDOWN_DELAY_S - 5,
        **({"kv_events": {"port": KV_EVENTS_PORT}} if r.kv_events else {}),
        **({"autoscaling": _autoscaling_config(pool, spec)} if spec.autoscaling.enabled else {}),
        **({"drift": {"pool": _pool_ref(pool)}} if _watches_drift(spec) else {}),
        "pool": {
            "kubernetes": {
                "namespace": pool.namespace,
                "selector": format_selector({POOL_LABEL: pool.name}),
                "port": spec.engine.port,
            }
        },
        "profiles": {
            "kubernetes": {
                "namespace": pool.namespace,
                "selector": format_selector(of_pool(pool.name, PROFILE_LABELS)),
            }
        },
    }
    return yaml.safe_dump(doc, sort_keys=False, default_flow_style=False)


def _pool_ref(pool: PoolRef) -> dict[str, str]:
    return {"namespace": pool.namespace, "name": pool.name}


def _watches_drift(spec: PoolSpec) -> bool:
    """The router reports per-pod prediction errors for the operator's drift re-probes."""
    return spec.calibration.enabled and spec.calibration.max_prediction_error > 0


def _autoscaling_config(pool: PoolRef, spec: PoolSpec) -> dict[str, Any]:
    """The router's decode autoscaler: its bounds, timing, and the pool it writes to."""
    a = spec.autoscaling
    return {
        "pool": _pool_ref(pool),
        "min_replicas": spec.decode.min_replicas or 0,
        "max_replicas": spec.decode.max_replicas,
        "startup_s": a.startup_s,
        "stabilization_s": a.stabilization_window_s,
        "burst_window_s": a.burst_window_s,
        "target_goodput": a.target_goodput,
    }


def _router_objects(pool: PoolRef, spec: PoolSpec) -> list[dict[str, Any]]:
    name = router_name(pool)
    config = render_router_config(pool, spec)
    selector = {POOL_LABEL: pool.name, COMPONENT_LABEL: COMPONENT_ROUTER}
    labels = pool_labels(pool, COMPONENT_ROUTER, **{COMPONENT_LABEL: COMPONENT_ROUTER})
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
                    # SIGTERM: the sidecar serves on failing its readiness, then finishes what
                    # is in flight (shutdown_delay_s, shutdown_timeout_s in its config).
                    "terminationGracePeriodSeconds": ROUTER_TERMINATION_GRACE_S,
                    "securityContext": pod_security_context(),
                    "containers": [
                        {
                            "name": "router",
                            "image": spec.router.image,
                            "command": ["disaggpool", "sidecar"],
                            "args": ["--config", f"{CONFIG_DIR}/{ROUTER_CONFIG_KEY}"],
                            "ports": [
                                {"name": "grpc", "containerPort": ROUTER_GRPC_PORT},
                                {"name": "http", "containerPort": ROUTER_HTTP_PORT},
                            ],
                            "readinessProbe": _probe("/health", "http", 5, 3),
                            "livenessProbe": _probe("/health", "http", 10, 6),
                            "resources": resources,
                            "securityContext": container_security_context(),
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
            "data": {ROUTER_CONFIG_KEY: config},
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
    name = service_account_name(pool, who)
    labels = pool_labels(pool, who)
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
# (create, or merge-patch on a re-probe: calibration/sinks.py).
ROUTER_RULES: list[dict[str, Any]] = [
    {"apiGroups": [""], "resources": ["pods", "configmaps"], "verbs": ["get", "list", "watch"]}
]
PROBE_RULES: list[dict[str, Any]] = [
    {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["create", "get", "patch"]}
]


def render_pool(pool: PoolRef, spec: PoolSpec) -> list[dict[str, Any]]:
    """Every object a pool consists of, in apply order (RBAC before the pods that use it)."""
    objs: list[dict[str, Any]] = []
    rules = ROUTER_RULES
    if spec.autoscaling.enabled or _watches_drift(spec):
        # The router writes its recommendation and its pods' prediction errors on its own pool
        # and on nothing else (sidecar.pool_writer).
        rules = [
            *rules,
            {
                "apiGroups": [GROUP],
                "resources": [PLURAL],
                "resourceNames": [pool.name],
                "verbs": ["get", "patch"],
            },
        ]
    objs += _rbac(pool, "router", rules)
    if spec.calibration.enabled:
        objs += _rbac(pool, "probe", PROBE_RULES)
    for role in (spec.prefill, spec.decode):
        objs.append(_headless_service(pool, spec, role.role))
        objs += [_vllm_deployment(pool, spec, role, v) for v in role.variants]
    objs += _router_objects(pool, spec)
    return [stamp(o, pool) for o in objs]
