"""REST paths, label selectors and a pod accessor: pure helpers for the client and its callers.

Selectors are equality terms only (all that disaggpool uses) and are applied client-side too:
the kmock emulator used in the fast tests ignores ``labelSelector``, and filtering twice is
harmless on a real API server.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from disaggpool.labels import format_selector

__all__ = ["matches", "parse_selector", "path_for", "pod_ready", "selector_param"]

_PLURALS = {
    "ConfigMap": "configmaps",
    "Service": "services",
    "Endpoints": "endpoints",
    "ServiceAccount": "serviceaccounts",
    "Pod": "pods",
    "Event": "events",
    "Deployment": "deployments",
    "Job": "jobs",
    "Role": "roles",
    "RoleBinding": "rolebindings",
    "DisaggPool": "disaggpools",
    "NetworkPolicy": "networkpolicies",
    "InferencePool": "inferencepools",
    "Lease": "leases",
}


def path_for(api_version: str, kind: str, namespace: str | None, name: str | None = None) -> str:
    """The REST path of a collection or object; no `namespace`: the cluster-wide collection."""
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    if namespace:
        base += f"/namespaces/{namespace}"
    path = f"{base}/{_PLURALS[kind]}"
    return f"{path}/{name}" if name else path


def parse_selector(selector: str) -> dict[str, str]:
    """``a=b,c==d`` -> {a: b, c: d}; only equality terms (all that disaggpool's selectors use)."""
    terms: dict[str, str] = {}
    for term in filter(None, (t.strip() for t in selector.split(","))):
        key, sep, value = term.replace("==", "=").partition("=")
        if not sep or not key.strip() or "!" in key:
            raise ValueError(f"selector term {term!r}: only key=value terms are supported")
        terms[key.strip()] = value.strip()
    return terms


def matches(obj: Mapping[str, Any], selector: Mapping[str, str]) -> bool:
    """Whether an object's labels satisfy every term of `selector`."""
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return all(labels.get(k) == v for k, v in selector.items())


def pod_ready(pod: Mapping[str, Any]) -> bool:
    """Whether a pod object's ``Ready`` condition is True."""
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in (pod.get("status") or {}).get("conditions") or []
    )


def selector_param(selector: Mapping[str, str]) -> dict[str, str]:
    """The ``labelSelector`` query parameter for `selector` ({} for none)."""
    sel = format_selector(dict(sorted(selector.items())))
    return {"labelSelector": sel} if sel else {}
