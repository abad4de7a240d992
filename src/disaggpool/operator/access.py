"""Who may do what, and who may reach whom: a pool's RBAC and NetworkPolicies (pure).

The router's and the probe's ServiceAccount, Role and RoleBinding (`rbac` with `router_rules`
or `probe_rules`), and, with `networkPolicy.enabled`, the pool's NetworkPolicies
(`network_policies`). `render.render_pool` puts them before the workloads that use them.

Least privilege (docs/operator.md, "RBAC"): the router lists and watches pods and ConfigMaps (its
watches select its pool's by label; RBAC cannot narrow list or watch by label) and patches only
its own pool's ``status`` (``status.router``), and only when it writes there (`writes_status`);
the probe patches only the profile ConfigMaps of the pool's current engine pods, by name, which
the operator creates before it starts their probes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from disaggpool.labels import (
    COMPONENT_CALIBRATION,
    COMPONENT_LABEL,
    COMPONENT_ROUTER,
    GROUP,
    K8S_COMPONENT_LABEL,
    PLURAL,
    POOL_LABEL,
)
from disaggpool.operator.names import (
    EPP_PORT,
    KV_EVENTS_PORT,
    PD_PROXY_PORT,
    ROUTER_GRPC_PORT,
    ROUTER_HTTP_PORT,
    PoolRef,
    decode_selector,
    pool_labels,
    profile_configmap_name,
    router_lease_name,
    router_name,
    service_account_name,
)
from disaggpool.operator.spec import PoolSpec

__all__ = [
    "ROUTER_RULES",
    "network_policies",
    "probe_rules",
    "rbac",
    "router_rules",
    "watches_drift",
    "writes_status",
]


def watches_drift(spec: PoolSpec) -> bool:
    """The router reports per-pod prediction errors for the operator's drift re-probes."""
    return spec.calibration.enabled and spec.calibration.max_prediction_error > 0


def writes_status(spec: PoolSpec) -> bool:
    """Whether the router writes ``status.router`` of its pool (a recommendation, drift)."""
    return spec.autoscaling.enabled or watches_drift(spec)


def rbac(pool: PoolRef, who: str, rules: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`who`'s ServiceAccount, a Role with `rules` and the binding of the two."""
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


# The router watches the pool's pods (membership) and profile ConfigMaps: list then watch, each
# by label selector. RBAC cannot narrow list or watch by label, so these rules reach every pod
# and ConfigMap of the namespace; the selector is in the watch (docs/operator.md, "RBAC").
ROUTER_RULES: list[dict[str, Any]] = [
    {"apiGroups": [""], "resources": ["pods", "configmaps"], "verbs": ["list", "watch"]}
]


def router_rules(pool: PoolRef, spec: PoolSpec) -> list[dict[str, Any]]:
    """The router's Role: `ROUTER_RULES`; with `router.active_passive`, its leader Lease and a
    merge-patch of its Service's Endpoints; and,
    when it reports to the operator (a decode recommendation, drift errors: sidecar.pool_writer),
    a merge-patch of its own pool's status subresource and nothing else: no verb on the pool
    itself, whose spec the operator deploys."""
    rules = list(ROUTER_RULES)
    if spec.router.active_passive:  # its leader Lease: read and renew that one by name...
        lease = {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"]}
        rules.append(
            {**lease, "resourceNames": [router_lease_name(pool)], "verbs": ["get", "update"]}
        )
        # ...and create it, the first replica up: Kubernetes cannot narrow `create` by name, so
        # this lets the router create other Leases in its namespace (never read or change them).
        rules.append({**lease, "verbs": ["create"]})
        # The leader points its Service's Endpoints (which the operator creates) at itself.
        rules.append(
            {
                "apiGroups": [""],
                "resources": ["endpoints"],
                "resourceNames": [router_name(pool)],
                "verbs": ["patch"],
            }
        )
    if writes_status(spec):
        rules.append(
            {
                "apiGroups": [GROUP],
                "resources": [f"{PLURAL}/status"],
                "resourceNames": [pool.name],
                "verbs": ["patch"],
            }
        )
    return rules


def probe_rules(pool: PoolRef, engine_pods: Sequence[str]) -> list[dict[str, Any]]:
    """The probe's Role: merge-patch the profile ConfigMaps of the pool's current engine pods,
    by name, and nothing else. The operator creates each one before it starts the pod's probe
    (`create` cannot be narrowed by name); the names follow the pods (a new pod, a deleted one).
    No pods, no rule: an empty resourceNames would grant every ConfigMap."""
    names = sorted({profile_configmap_name(pool, p) for p in engine_pods})
    if not names:
        return []
    return [
        {"apiGroups": [""], "resources": ["configmaps"], "resourceNames": names, "verbs": ["patch"]}
    ]


# ------------------------------------------------------------------------------ network policy


def _peer(**labels: str) -> dict[str, Any]:
    return {"podSelector": {"matchLabels": dict(labels)}}


def network_policies(pool: PoolRef, spec: PoolSpec) -> list[dict[str, Any]]:
    """With `networkPolicy.enabled`: an engine pod is reached only by the pool's router and probes
    (its HTTP port, and the KV-event port for the router) and by the pool's other engine pods (any
    port: NIXL's side channel and the KV transfer itself, whose transport ports are not fixed);
    the router only by the configured clients; the probe by nothing. Egress is left open (engines
    download weights, every pod reaches the API server or DNS as the cluster has it).

    Gateway mode: the gateway is one of the clients (its Envoy pods must be among them). It
    reaches the router's ext_proc port and the decode pods' pd-proxy port (a policy of its own,
    selecting the InferencePool's pods); a pd-proxy reaches the prefill pods as an engine pod of
    the pool (the engines' peer rule)."""
    n = spec.network_policy
    engines = {POOL_LABEL: pool.name, K8S_COMPONENT_LABEL: "vllm"}
    router = {POOL_LABEL: pool.name, COMPONENT_LABEL: COMPONENT_ROUTER}
    probe = {POOL_LABEL: pool.name, COMPONENT_LABEL: COMPONENT_CALIBRATION}
    http = {"protocol": "TCP", "port": spec.engine.port}
    router_ports = [http] + (
        [{"protocol": "TCP", "port": KV_EVENTS_PORT}] if spec.router.kv_events else []
    )
    clients = [dict(c) for c in n.clients] or [{"podSelector": {}}]  # none: its own namespace
    front = [{"protocol": "TCP", "port": ROUTER_HTTP_PORT}]
    if spec.router.grpc_exposed:
        front.append({"protocol": "TCP", "port": ROUTER_GRPC_PORT})
    if spec.router.gateway:
        front.append({"protocol": "TCP", "port": EPP_PORT})

    def policy(suffix: str, selector: dict[str, str], ingress: list[Any]) -> dict[str, Any]:
        return {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {
                "name": f"{pool.name}-{suffix}",
                "labels": pool_labels(pool, "network-policy"),
            },
            "spec": {
                "podSelector": {"matchLabels": selector},
                "policyTypes": ["Ingress"],
                "ingress": ingress,
            },
        }

    gateway = [
        policy(
            "gateway",
            decode_selector(pool),
            [{"from": clients, "ports": [{"protocol": "TCP", "port": PD_PROXY_PORT}]}],
        )
    ]
    return [
        policy(
            "engines",
            engines,
            [
                {"from": [_peer(**router)], "ports": router_ports},
                {"from": [_peer(**probe)], "ports": [http]},
                {"from": [_peer(**engines)]},
            ],
        ),
        policy("router", router, [{"from": clients, "ports": front}]),
        policy("probe", probe, []),
        *(gateway if spec.router.gateway else []),
    ]
