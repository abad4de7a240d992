"""Pure rendering of a pool's workloads: (pool, spec) -> the Kubernetes objects it consists of.

vLLM Deployments (one per role and variant) and their headless Services, the router (ConfigMap
with the sidecar's config, Deployment, Service), and, from `access`, the ServiceAccounts/Roles of
the router and the probe and, with `networkPolicy.enabled`, the pool's NetworkPolicies; in gateway
mode (`router.mode`) also `gateway`'s InferencePool and pd-proxy containers. No I/O,
no clock, no randomness: the same inputs give byte-identical output, which is what the
golden-file tests in tests/operator check and what makes reconciliation idempotent. Every object
is `names.stamp`ed: owned by the pool (deleting the pool garbage-collects it) and annotated with
the hash of its body. Called by `reconcile`; the probe Job is `calibration_plan`'s.

Pod security: the router's and the probe's pods pass the Pod Security Standard `restricted`
(non-root, RuntimeDefault seccomp, no privilege escalation, every capability dropped, read-only
root filesystem); the vLLM pods pass `baseline` (RuntimeDefault seccomp, no privilege
escalation) and, with ``engine.podSecurity: restricted``, `restricted` too (non-root, with a
writable HOME and /tmp); a decode pod's pd-proxy container is `restricted` on its own at either
level (`proxy_security_context`). Only the router's and the probe's pods mount a service-account
token.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Sequence
from typing import Any

import yaml

from disaggpool.labels import (
    COMPONENT_LABEL,
    COMPONENT_ROUTER,
    CONFIG_HASH_ANNOTATION,
    GPU_TYPE_ANNOTATION,
    POOL_LABEL,
    PROFILE_LABELS,
    ROLE_LABEL,
    VARIANT_LABEL,
    format_selector,
    of_pool,
)
from disaggpool.operator.access import (
    network_policies,
    probe_rules,
    rbac,
    router_rules,
    watches_drift,
)
from disaggpool.operator.gateway import (
    inference_pool,
    pd_proxy_container,
    router_gateway_config,
    router_ports,
)
from disaggpool.operator.names import (
    KV_EVENTS_PORT,
    ROUTER_GRPC_PORT,
    ROUTER_HTTP_PORT,
    PoolRef,
    pool_labels,
    role_service_name,
    router_lease_name,
    router_name,
    stamp,
    workload_name,
)
from disaggpool.operator.spec import PoolSpec, RoleSpec, SharedBooksSpec, VariantSpec

__all__ = [
    "API_KEY_DIR",
    "API_KEY_ENV",
    "CONFIG_DIR",
    "ENGINE_HOME",
    "GRPC_TOKEN_DIR",
    "NON_ROOT_UID",
    "ROUTER_CONFIG_KEY",
    "container_security_context",
    "engine_security_contexts",
    "pod_security_context",
    "proxy_security_context",
    "render_pool",
    "render_router_config",
]

CONFIG_DIR = "/etc/disaggpool"
ROUTER_CONFIG_KEY = "sidecar.yaml"
#: Where the router finds the pool's API key and its gRPC token (whole Secret volumes, not
#: subPath mounts, so that the kubelet updates them and the router picks a rotation up).
API_KEY_DIR = "/var/run/disaggpool/api-key"
GRPC_TOKEN_DIR = "/var/run/disaggpool/grpc-token"
API_KEY_FILE, GRPC_TOKEN_FILE = "api-key", "token"
#: The shared-books bus's token or NATS credentials file (`router.sharedBooks`).
NATS_AUTH_DIR = "/var/run/disaggpool/nats"
NATS_TOKEN_FILE, NATS_CREDENTIALS_FILE = "token", "nats.creds"
#: What the probe reads its API key from (`disaggpool calibrate`).
API_KEY_ENV = "DISAGGPOOL_API_KEY"
#: The user the router, the probe and restricted vLLM pods run as ("nonroot" by convention).
NON_ROOT_UID = 65532
#: A restricted vLLM pod's writable home: Hugging Face, vLLM, Triton and torch caches live here.
ENGINE_HOME = "/home/vllm"
_RUNTIME_DEFAULT = {"type": "RuntimeDefault"}


def pod_security_context() -> dict[str, Any]:
    """The pod-level hardening of the router and the probe: Pod Security `restricted`."""
    return {
        "runAsNonRoot": True,
        "runAsUser": NON_ROOT_UID,
        "runAsGroup": NON_ROOT_UID,
        "seccompProfile": dict(_RUNTIME_DEFAULT),
    }


def container_security_context() -> dict[str, Any]:
    """The container-level hardening of the router and the probe: `restricted` plus a read-only
    root filesystem."""
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def proxy_security_context() -> dict[str, Any]:
    """A container of our own image in a vLLM pod (the pd-proxy): `restricted` by itself, since
    the pod's level (`engine_security_contexts`) may be `baseline`."""
    return {**pod_security_context(), **container_security_context()}


def engine_security_contexts(level: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(pod, container) security contexts of a vLLM pod at Pod Security `level`.

    `baseline` (the default) changes nothing a vLLM image relies on: the runtime's default
    seccomp profile and no privilege escalation (no setuid binaries). `restricted` also runs it
    as a non-root user with every capability dropped and a read-only root filesystem; the pod
    then gets a writable HOME and /tmp (`_vllm_deployment`)."""
    if level == "restricted":
        return pod_security_context(), container_security_context()
    return {"seccompProfile": dict(_RUNTIME_DEFAULT)}, {"allowPrivilegeEscalation": False}


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


def _secret_env(name: str, secret: str, key: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}


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
    if spec.auth.api_key is not None:
        # vLLM's --api-key defaults to $VLLM_API_KEY: every /v1 request must then carry it.
        env.append(_secret_env("VLLM_API_KEY", spec.auth.api_key.name, spec.auth.api_key.key))
    if e.pod_security == "restricted":
        # The image's user has no passwd entry: torch names its caches after $USER.
        env += [{"name": "HOME", "value": ENGINE_HOME}, {"name": "USER", "value": "vllm"}]
    env += [dict(x) for x in e.env]
    resources: dict[str, Any] = json.loads(json.dumps(dict(e.resources)))
    if variant.gpus:  # a CPU engine asks for no GPU; engine.resources says what it needs
        for kind in ("limits", "requests"):
            resources.setdefault(kind, {})[variant.gpu_resource] = variant.gpus
    pod_sc, container_sc = engine_security_contexts(e.pod_security)
    volumes: list[dict[str, Any]] = [
        # NCCL/NIXL and PyTorch use /dev/shm well beyond the container runtime's 64 MiB default.
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": e.shared_memory}}
    ]
    mounts: list[dict[str, Any]] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    if e.pod_security == "restricted":  # a read-only root: the caches and temp files go here
        volumes += [{"name": "home", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}}]
        mounts += [
            {"name": "home", "mountPath": ENGINE_HOME},
            {"name": "tmp", "mountPath": "/tmp"},
        ]
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
        "securityContext": container_sc,
    }
    containers = [container]
    if spec.router.gateway and role.role == "decode":
        key = spec.auth.api_key
        if key is not None:  # the key as a file, as the router reads it (rotations reach it)
            volumes.append(_secret_volume("api-key", key.name, key.key, API_KEY_FILE))
        containers.append(
            pd_proxy_container(
                spec,
                key_file=f"{API_KEY_DIR}/{API_KEY_FILE}" if key else None,
                key_mount=(
                    {"name": "api-key", "mountPath": API_KEY_DIR, "readOnly": True} if key else None
                ),
                security_context=proxy_security_context(),
            )
        )
    pod_spec: dict[str, Any] = {
        # vLLM calls no Kubernetes API: no service-account token in its pods.
        "automountServiceAccountToken": False,
        "securityContext": pod_sc,
        "containers": containers,
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
    # gRPC is opened beyond the pod's loopback only with a token every call must carry, or
    # with none where the spec says so behind the pool's NetworkPolicy (`grpc_open`).
    grpc_host = "0.0.0.0" if r.grpc_exposed else "127.0.0.1"
    drift = {"pool": _pool_ref(pool), "max_error": spec.calibration.max_prediction_error}
    listen = {"grpc": f"{grpc_host}:{ROUTER_GRPC_PORT}", "http": f"0.0.0.0:{ROUTER_HTTP_PORT}"}
    gateway: dict[str, Any] = {}
    if r.gateway:
        extra, gateway = router_gateway_config()
        listen |= extra
    doc = {
        "policy": r.policy,
        "model": spec.model.served_model_name,
        "listen": listen,
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
        **({"auth": _auth_config()} if spec.auth.api_key else {}),
        **({"grpc": {"token_file": f"{GRPC_TOKEN_DIR}/{GRPC_TOKEN_FILE}"}} if r.grpc_token else {}),
        # No token: open by the spec's choice, behind the pool's NetworkPolicy (spec.py checks).
        **({"grpc": {"allow_unauthenticated": True}} if r.grpc_open and not r.grpc_token else {}),
        **({"kv_events": {"port": KV_EVENTS_PORT}} if r.kv_events else {}),
        **({"shared_books": _shared_books_config(r.shared_books)} if r.shared_books else {}),
        # One picker routes, the others stand by (RouterSpec.active_passive); each replica is
        # named by its pod's name; the timings are `router.leaderElection`'s or the sidecar's.
        **({"leader_election": _leader_election(pool, spec)} if r.active_passive else {}),
        **({"gateway": gateway} if gateway else {}),
        **({"autoscaling": _autoscaling_config(pool, spec)} if spec.autoscaling.enabled else {}),
        **({"drift": drift} if watches_drift(spec) else {}),
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
                # Only ConfigMaps owned by this pool count: the operator's and the probe's.
                "owner": pool.name,
            }
        },
    }
    return yaml.safe_dump(doc, sort_keys=False, default_flow_style=False)


def _auth_config() -> dict[str, str]:
    """The pool's one key: what the router requires of its clients and sends to the pods."""
    key = f"{API_KEY_DIR}/{API_KEY_FILE}"
    return {"api_keys_file": key, "upstream_api_key_file": key}


def _shared_books_config(books: SharedBooksSpec) -> dict[str, str]:
    """The bus's URL and the file its Secret is mounted as; each replica names itself by its
    pod's name (the sidecar's default), so nothing per replica is rendered."""
    if books.token is not None:
        return {"nats_url": books.nats_url, "token_file": f"{NATS_AUTH_DIR}/{NATS_TOKEN_FILE}"}
    return {
        "nats_url": books.nats_url,
        "credentials_file": f"{NATS_AUTH_DIR}/{NATS_CREDENTIALS_FILE}",
    }


def _leader_election(pool: PoolRef, spec: PoolSpec) -> dict[str, Any]:
    """The pool's Lease, `router.leaderElection`'s timings where given (else the sidecar's
    defaults apply), and the router Service's Endpoints, which the leader writes."""
    lease: dict[str, Any] = {"namespace": pool.namespace, "name": router_lease_name(pool)}
    if spec.router.lease_timings is not None:
        lease.update(dataclasses.asdict(spec.router.lease_timings))
    # The Service's Endpoints, by its port names: the leader points them at itself ($POD_IP).
    ports, service_ports = _router_ports(spec)
    number = {p["name"]: p["containerPort"] for p in ports}
    lease["endpoints"] = {
        "name": router_name(pool),
        "ports": {p["name"]: number[p["targetPort"]] for p in service_ports},
    }
    return lease


def _pool_ref(pool: PoolRef) -> dict[str, str]:
    return {"namespace": pool.namespace, "name": pool.name}


def _autoscaling_config(pool: PoolRef, spec: PoolSpec) -> dict[str, Any]:
    """The router's autoscalers: decode's bounds, prefill's when prefill is autoscaled
    (`prefill.maxReplicas` set), their timing and headroom, and the pool they write to."""
    a = spec.autoscaling
    p = spec.prefill
    prefill = {"min_replicas": p.min_replicas or 0, "max_replicas": p.max_replicas}
    return {
        "pool": _pool_ref(pool),
        "min_replicas": spec.decode.min_replicas or 0,
        "max_replicas": spec.decode.max_replicas,
        "startup_s": a.startup_s,
        "stabilization_s": a.stabilization_window_s,
        "burst_window_s": a.burst_window_s,
        "target_goodput": a.target_goodput,
        "min_headroom": a.min_headroom,
        **({"prefill": prefill} if p.max_replicas is not None else {}),
    }


def _secret_volume(name: str, secret: str, key: str, path: str) -> dict[str, Any]:
    """One key of a Secret as a file (the whole volume: the kubelet updates it on rotation)."""
    return {"name": name, "secret": {"secretName": secret, "items": [{"key": key, "path": path}]}}


def _router_objects(pool: PoolRef, spec: PoolSpec) -> list[dict[str, Any]]:
    name = router_name(pool)
    config = render_router_config(pool, spec)
    selector = {POOL_LABEL: pool.name, COMPONENT_LABEL: COMPONENT_ROUTER}
    labels = pool_labels(pool, COMPONENT_ROUTER, **{COMPONENT_LABEL: COMPONENT_ROUTER})
    resources = json.loads(json.dumps(dict(spec.router.resources))) or {
        "requests": {"cpu": "500m", "memory": "256Mi"},
        "limits": {"memory": "1Gi"},
    }
    grpc = spec.router.grpc_token
    volumes: list[dict[str, Any]] = [{"name": "config", "configMap": {"name": name}}]
    mounts: list[dict[str, Any]] = [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}]
    if spec.auth.api_key is not None:
        k = spec.auth.api_key
        volumes.append(_secret_volume("api-key", k.name, k.key, API_KEY_FILE))
        mounts.append({"name": "api-key", "mountPath": API_KEY_DIR, "readOnly": True})
    if grpc is not None:
        volumes.append(_secret_volume("grpc-token", grpc.name, grpc.key, GRPC_TOKEN_FILE))
        mounts.append({"name": "grpc-token", "mountPath": GRPC_TOKEN_DIR, "readOnly": True})
    books = spec.router.shared_books
    for ref, file in (
        (books and books.token, NATS_TOKEN_FILE),
        (books and books.credentials, NATS_CREDENTIALS_FILE),
    ):
        if ref:  # one of the two (spec.py)
            volumes.append(_secret_volume("nats-auth", ref.name, ref.key, file))
            mounts.append({"name": "nats-auth", "mountPath": NATS_AUTH_DIR, "readOnly": True})
    ports, service_ports = _router_ports(spec)
    # Active/passive: every healthy replica is Ready (a Deployment counts only Ready pods, so
    # standbys that never are would stall each rollout); the leader steers the traffic by
    # pointing the selector-less Service's Endpoints at its own address (sidecar.leader).
    ready_path = "/readyz?exclude=leader" if spec.router.active_passive else "/readyz"
    env = [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
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
                            "ports": ports,
                            # /livez: the process and its loops are alive (never the pool's
                            # state, so a router waiting minutes for engines to load is not
                            # restarted); /readyz: the pool is usable and it is not draining.
                            # The startup probe gives the process a minute to come up.
                            "startupProbe": _probe("/livez", "http", 2, 30),
                            "livenessProbe": _probe("/livez", "http", 10, 3),
                            "readinessProbe": _probe(ready_path, "http", 5, 3),
                            **({"env": env} if spec.router.active_passive else {}),
                            "resources": resources,
                            "securityContext": container_security_context(),
                            "volumeMounts": mounts,
                        }
                    ],
                    "volumes": volumes,
                },
            },
        },
    }
    service: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "labels": labels},
        "spec": {"selector": selector, "ports": service_ports},
    }
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "labels": labels},
        "data": {ROUTER_CONFIG_KEY: config},
    }
    if not spec.router.active_passive:
        return [config_map, deployment, service]
    del service["spec"]["selector"]  # the leader writes its Endpoints instead
    # Created empty and owned by the pool (so it goes with it); the leader fills in its address.
    endpoints = {
        "apiVersion": "v1",
        "kind": "Endpoints",
        "metadata": {"name": name, "labels": labels},
    }
    return [config_map, deployment, service, endpoints]


def _router_ports(spec: PoolSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The router container's ports and its Service's (each Service port targets the container
    port of its own name)."""
    ports: list[dict[str, Any]] = [{"name": "http", "containerPort": ROUTER_HTTP_PORT}]
    service_ports = [{"name": "http", "port": ROUTER_HTTP_PORT, "targetPort": "http"}]
    if spec.router.grpc_exposed:  # else gRPC listens on the pod's loopback: nothing to expose
        ports.insert(0, {"name": "grpc", "containerPort": ROUTER_GRPC_PORT})
        service_ports.insert(0, {"name": "grpc", "port": ROUTER_GRPC_PORT, "targetPort": "grpc"})
    if spec.router.gateway:  # the endpoint picker's port, which the InferencePool names
        container_port, service_port = router_ports()
        ports.append(container_port)
        service_ports.append(service_port)
    return ports, service_ports


def render_pool(
    pool: PoolRef, spec: PoolSpec, engine_pods: Sequence[str] = ()
) -> list[dict[str, Any]]:
    """Every object a pool consists of, in apply order (RBAC before the pods that use it).

    `engine_pods`: the names of the pool's current engine pods, whose profile ConfigMaps the
    probe's Role may patch."""
    objs: list[dict[str, Any]] = []
    objs += rbac(pool, "router", router_rules(pool, spec))
    if spec.calibration.enabled:
        objs += rbac(pool, "probe", probe_rules(pool, engine_pods))
    if spec.network_policy.enabled:
        objs += network_policies(pool, spec)
    for role in (spec.prefill, spec.decode):
        objs.append(_headless_service(pool, spec, role.role))
        objs += [_vllm_deployment(pool, spec, role, v) for v in role.variants]
    objs += _router_objects(pool, spec)
    if spec.router.gateway:
        objs.append(inference_pool(pool, spec))
    return [stamp(o, pool) for o in objs]
