"""The label and annotation contract between the operator, the router sidecar and the probe.

The operator (`disaggpool.operator`) stamps these keys on what it renders; the sidecar
(`sidecar.collectors`) selects pods and profile ConfigMaps by them and reads a pod's role and a
profile's pod from them; the probe (`calibration.sinks`) stores its profile under `PROFILE_KEY`.
Every key is spelled here and only here, so the three sides cannot drift apart.

The contract, in short: a vLLM pod carries ``disaggpool.io/pool=<pool>`` and
``disaggpool.io/role=prefill|decode``; a pod's calibration profile is a ConfigMap labelled
``disaggpool.io/pool=<pool>``, ``disaggpool.io/pod=<pod>`` and ``disaggpool.io/profile=true``,
holding the profile YAML in key ``profile.yaml``.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

__all__ = [
    "API_VERSION",
    "APPLIED_SPEC_ANNOTATION",
    "ATTEMPT_LABEL",
    "COMPONENT_CALIBRATION",
    "COMPONENT_LABEL",
    "COMPONENT_ROUTER",
    "CONFIG_HASH_ANNOTATION",
    "DECODE_RECOMMENDATION_KEY",
    "GPU_TYPE_ANNOTATION",
    "GROUP",
    "K8S_COMPONENT_LABEL",
    "K8S_INSTANCE_LABEL",
    "K8S_NAME_LABEL",
    "KIND",
    "MANAGED_BY",
    "MANAGED_BY_LABEL",
    "OBSERVED_ERRORS_KEY",
    "PLURAL",
    "POD_LABEL",
    "POOL_LABEL",
    "PREFILL_RECOMMENDATION_KEY",
    "PROBE_JOB_LABELS",
    "PROFILE_KEY",
    "PROFILE_LABEL",
    "PROFILE_LABELS",
    "PROFILE_LABEL_VALUE",
    "REPORT_KEY",
    "ROLES",
    "ROLE_DECODE",
    "ROLE_LABEL",
    "ROLE_PREFILL",
    "ROUTER_STATUS_KEY",
    "SPEC_HASH_ANNOTATION",
    "VARIANT_LABEL",
    "VERSION",
    "format_selector",
    "of_pool",
]

# The custom resource.
GROUP = "disaggpool.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "DisaggPool"
PLURAL = "disaggpools"

# Labels the sidecar reads (and the operator writes).
POOL_LABEL = f"{GROUP}/pool"
ROLE_LABEL = f"{GROUP}/role"
POD_LABEL = f"{GROUP}/pod"
PROFILE_LABEL = f"{GROUP}/profile"
PROFILE_LABEL_VALUE = "true"
ROLE_PREFILL, ROLE_DECODE = "prefill", "decode"
ROLES = (ROLE_PREFILL, ROLE_DECODE)

# Labels only the operator reads: which component an object is, which variant, which probe try.
COMPONENT_LABEL = f"{GROUP}/component"
COMPONENT_ROUTER = "router"
COMPONENT_CALIBRATION = "calibration"
VARIANT_LABEL = f"{GROUP}/variant"
ATTEMPT_LABEL = f"{GROUP}/attempt"
K8S_NAME_LABEL = "app.kubernetes.io/name"
K8S_INSTANCE_LABEL = "app.kubernetes.io/instance"
K8S_COMPONENT_LABEL = "app.kubernetes.io/component"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "disaggpool-operator"

# What marks an object as a probe Job or a profile ConfigMap, in any pool. What is rendered and
# what is selected (a pool's list, the operator's watch filters) are both built from these, so
# they cannot drift apart: they once did, and the operator never saw its own probe Jobs.
PROBE_JOB_LABELS = MappingProxyType({COMPONENT_LABEL: COMPONENT_CALIBRATION})
PROFILE_LABELS = MappingProxyType({PROFILE_LABEL: PROFILE_LABEL_VALUE})

# Annotations (the operator's; the applied spec is remembered on the pool itself).
APPLIED_SPEC_ANNOTATION = f"{GROUP}/applied-spec"
SPEC_HASH_ANNOTATION = f"{GROUP}/spec-hash"
CONFIG_HASH_ANNOTATION = f"{GROUP}/config-hash"
GPU_TYPE_ANNOTATION = f"{GROUP}/gpu-type"

# What the router reports on its pool, through the status subresource (it may not write the
# pool's spec or metadata): ``status.router.<key>``, one object per key. The operator keeps that
# part of the status as the router wrote it.
ROUTER_STATUS_KEY = "router"
# The router's decode and prefill autoscalers' recommendations; the operator applies each within
# its role's bounds.
DECODE_RECOMMENDATION_KEY = "decodeRecommendation"
PREFILL_RECOMMENDATION_KEY = "prefillRecommendation"
# The router's per-pod prediction errors; the operator re-probes drifting pods.
OBSERVED_ERRORS_KEY = "observedErrors"

# Keys of a profile ConfigMap's data (what the probe writes, what the operator and sidecar read).
PROFILE_KEY = "profile.yaml"
REPORT_KEY = "report.json"


def of_pool(pool: str, kind: Mapping[str, str], **extra: str) -> dict[str, str]:
    """The labels (or the equality selector) of one kind of object in one pool, plus `extra`."""
    return {POOL_LABEL: pool, **kind, **extra}


def format_selector(terms: Mapping[str, str]) -> str:
    """{a: b, c: d} -> ``a=b,c=d`` (equality terms, in the given order)."""
    return ",".join(f"{k}={v}" for k, v in terms.items())
