"""Names and identity metadata of every object the operator renders for a pool (pure).

One place derives the object names (``<pool>-router``, ``<pool>-profile-<pod>``, probe Job names),
the common labels, the owner reference to the pool and the spec-hash annotation that lets
`reconcile` tell "unchanged" from "needs a patch" without diffing against server-side defaults.
Used by `render`, `calibration_plan`, `status` and `reconcile`; the label keys themselves are
`disaggpool.labels`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from typing import Any

from disaggpool.labels import (
    API_VERSION,
    K8S_COMPONENT_LABEL,
    K8S_INSTANCE_LABEL,
    K8S_NAME_LABEL,
    KIND,
    MANAGED_BY,
    MANAGED_BY_LABEL,
    POOL_LABEL,
    ROLE_LABEL,
    SPEC_HASH_ANNOTATION,
)

__all__ = [
    "EPP_PORT",
    "PD_PROXY_PORT",
    "ROUTER_GRPC_PORT",
    "ROUTER_HTTP_PORT",
    "PoolRef",
    "decode_selector",
    "job_name",
    "object_hash",
    "owner_reference",
    "pool_labels",
    "profile_configmap_name",
    "role_service_name",
    "router_endpoint",
    "router_lease_name",
    "router_name",
    "service_account_name",
    "stamp",
    "workload_name",
]

ROUTER_GRPC_PORT, ROUTER_HTTP_PORT = 50051, 8000
KV_EVENTS_PORT = 5557  # where prefill pods publish their KV events (vLLM's default endpoint)
# Gateway mode (docs/gateway-kubernetes.md): the router's ext_proc port (the endpoint picker a
# gateway calls; 9002 is the port GIE's examples give an EPP) and the decode pods' pd-proxy port,
# the InferencePool's target port.
EPP_PORT, PD_PROXY_PORT = 9002, 8001


@dataclasses.dataclass(frozen=True, slots=True)
class PoolRef:
    """The identity of a DisaggPool object (what owner references and labels need)."""

    name: str
    namespace: str
    uid: str
    generation: int = 1


def owner_reference(pool: PoolRef) -> dict[str, Any]:
    """The controller owner reference: deleting the pool garbage-collects the object."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": pool.name,
        "uid": pool.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def pool_labels(pool: PoolRef, component: str, **extra: str) -> dict[str, str]:
    """The labels every object of `pool` carries, plus `extra`."""
    return {
        K8S_NAME_LABEL: "disaggpool",
        K8S_INSTANCE_LABEL: pool.name,
        K8S_COMPONENT_LABEL: component,
        MANAGED_BY_LABEL: MANAGED_BY,
        POOL_LABEL: pool.name,
        **extra,
    }


def object_hash(obj: Mapping[str, Any]) -> str:
    """sha256 (16 hex) of an object's canonical JSON, without the hash annotation itself."""
    body = json.loads(json.dumps(obj, sort_keys=True))
    body.get("metadata", {}).get("annotations", {}).pop(SPEC_HASH_ANNOTATION, None)
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


def stamp(obj: dict[str, Any], pool: PoolRef) -> dict[str, Any]:
    """Put a rendered object into the pool's namespace, owned by it, with its hash annotation."""
    md = obj["metadata"]
    md["namespace"] = pool.namespace
    md["ownerReferences"] = [owner_reference(pool)]
    md.setdefault("annotations", {})[SPEC_HASH_ANNOTATION] = object_hash(obj)
    return obj


def workload_name(pool: PoolRef, role: str, variant: str) -> str:
    """The Deployment of one role's variant (`variant` "" for a role without variants)."""
    return f"{pool.name}-{role}" + (f"-{variant}" if variant else "")


def role_service_name(pool: PoolRef, role: str) -> str:
    """The headless Service of one role."""
    return f"{pool.name}-{role}"


def decode_selector(pool: PoolRef) -> dict[str, str]:
    """Labels that select exactly the pool's decode engine pods (every variant), nothing else of
    the pool: the InferencePool's selector and the gateway NetworkPolicy's."""
    return {POOL_LABEL: pool.name, ROLE_LABEL: "decode", K8S_COMPONENT_LABEL: "vllm"}


def router_name(pool: PoolRef) -> str:
    """The router's Deployment, Service, ConfigMap and ServiceAccount."""
    return f"{pool.name}-router"


def router_lease_name(pool: PoolRef) -> str:
    """The Lease its replicas elect a leader on (active/passive: `leader_election`)."""
    return f"{pool.name}-router-leader"


def service_account_name(pool: PoolRef, who: str) -> str:
    """The ServiceAccount (and Role, RoleBinding) of the router or the probe."""
    return f"{pool.name}-{who}"


def profile_configmap_name(pool: PoolRef | str, pod: str) -> str:
    """The ConfigMap a pod's probe writes its profile to."""
    return f"{pool if isinstance(pool, str) else pool.name}-profile-{pod}"


def job_name(pool: PoolRef, pod: str, attempt: int) -> str:
    """The probe Job of one attempt at one pod."""
    # Pod names run up to 63 characters; a hash keeps the Job name (and its pods' job-name label)
    # within 63 while staying stable for the same pod and attempt.
    return f"{pool.name}-cal-{hashlib.sha256(pod.encode()).hexdigest()[:10]}-{attempt}"


def router_endpoint(pool: PoolRef, grpc: bool = True) -> dict[str, str]:
    """Where clients reach the pool's router (the status's ``routerEndpoint``); `grpc` False:
    the router's gRPC port listens on its loopback only and the Service does not expose it."""
    host = f"{router_name(pool)}.{pool.namespace}.svc"
    out = {"http": f"http://{host}:{ROUTER_HTTP_PORT}"}
    if grpc:
        out["grpc"] = f"{host}:{ROUTER_GRPC_PORT}"
    return out
