"""What the operator reads back from the cluster, as small frozen views (pure).

`reconcile` lists a pool's pods, profile ConfigMaps and probe Jobs and turns each into a view
here; `calibration_plan` decides on the views and `status` reports them. A profile ConfigMap that
does not parse becomes a view carrying the error (the pod is then re-probed and the operator
leaves a `ProfileRejected` Event), never an exception. A profile counts only when the ConfigMap
is owned by this very pool (an owner reference with its uid: the operator creates it, the probe
writes it): one carrying the labels without that is not this pool's and is ignored.

What the router tells the operator is on the pool's ``status.router`` (`router_report`), written
by the router through the status subresource (`sidecar.pool_writer`): ``decodeRecommendation``
(`operator.scaling`) and ``observedErrors`` (`observed_errors`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import yaml

from disaggpool.core.profile import CalibrationProfile, profile_from_dict
from disaggpool.errors import InputError
from disaggpool.formats.profiles import load_yaml
from disaggpool.kubeclient import pod_ready
from disaggpool.labels import (
    ATTEMPT_LABEL,
    GPU_TYPE_ANNOTATION,
    KIND,
    OBSERVED_ERRORS_KEY,
    POD_LABEL,
    PROFILE_KEY,
    ROLE_LABEL,
    ROLES,
    ROUTER_STATUS_KEY,
    VARIANT_LABEL,
)

__all__ = [
    "JobView",
    "PodView",
    "ProfileView",
    "job_view",
    "observed_errors",
    "owned_by",
    "pod_view",
    "profile_view",
    "router_report",
]


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
    role = labels.get(ROLE_LABEL)
    if role not in ROLES:
        return None
    status = pod.get("status") or {}
    return PodView(
        name=str(md.get("name", "")),
        role=str(role),
        ip=str(status.get("podIP") or ""),
        ready=pod_ready(pod),
        variant=str(labels.get(VARIANT_LABEL, "")),
        gpu_type=str((md.get("annotations") or {}).get(GPU_TYPE_ANNOTATION, "")),
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
    owned: bool = True  # owned by this pool: only then does it count


def router_report(pool: Mapping[str, Any]) -> Mapping[str, Any]:
    """The router's ``status.router`` on a pool object ({} when it has written none)."""
    report = (pool.get("status") or {}).get(ROUTER_STATUS_KEY)
    return report if isinstance(report, Mapping) else {}


def owned_by(obj: Mapping[str, Any], pool_uid: str) -> bool:
    """Whether `obj` carries an owner reference to the DisaggPool with uid `pool_uid`."""
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return bool(pool_uid) and any(
        isinstance(r, Mapping) and r.get("kind") == KIND and r.get("uid") == pool_uid for r in refs
    )


def observed_errors(report: Mapping[str, Any]) -> dict[str, tuple[float, str]]:
    """The router's per-pod prediction errors (`router_report`'s ``observedErrors``:
    ``{"pods": [{"pod", "error", "profile"}], "at"}``): pod -> (error, fitted_at of the profile it
    is about). Whatever does not parse is skipped: a missing error re-probes nothing."""
    doc = report.get(OBSERVED_ERRORS_KEY)
    pods = doc.get("pods") if isinstance(doc, Mapping) else None
    out = {}
    for item in pods if isinstance(pods, list) else ():
        if not isinstance(item, Mapping) or not isinstance(item.get("pod"), str):
            continue
        pod, error = item["pod"], item.get("error")
        if (
            isinstance(error, int | float)
            and not isinstance(error, bool)
            and math.isfinite(error)
            and error >= 0
        ):
            out[str(pod)] = (float(error), str(item.get("profile", "")))
    return out


def profile_view(
    cm: Mapping[str, Any], pool_uid: str, errors: Mapping[str, tuple[float, str]] | None = None
) -> ProfileView:
    """A profile ConfigMap of the pool with uid `pool_uid`; `errors` (`observed_errors`) gives its
    pod's observed error when it is about this very profile (same fitted_at), never about one it
    replaced."""
    md = cm.get("metadata") or {}
    name = str(md.get("name", ""))
    pod = str((md.get("labels") or {}).get(POD_LABEL, ""))
    owned = owned_by(cm, pool_uid)
    text = (cm.get("data") or {}).get(PROFILE_KEY)
    if not text:
        return ProfileView(name, pod, None, f"no {PROFILE_KEY} yet", None, owned)
    try:
        profile = profile_from_dict(load_yaml(text), source=f"ConfigMap {name}")
    except (InputError, yaml.YAMLError) as exc:
        return ProfileView(name, pod, None, str(exc), None, owned)
    error, about = (errors or {}).get(pod, (None, ""))
    observed = error if about == profile.fitted_at else None
    return ProfileView(name, pod, profile, "", observed, owned)


@dataclasses.dataclass(frozen=True, slots=True)
class JobView:
    """A probe Job: which pod, which attempt, how it went."""

    name: str
    pod: str
    attempt: int
    state: str  # active | succeeded | failed


def job_view(job: Mapping[str, Any]) -> JobView | None:
    """A probe Job of the pool, or None for a Job without a pod label."""
    md = job.get("metadata") or {}
    labels = md.get("labels") or {}
    if POD_LABEL not in labels:
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
        attempt = int(labels.get(ATTEMPT_LABEL, "0"))
    except ValueError:
        attempt = 0
    return JobView(str(md.get("name", "")), str(labels[POD_LABEL]), attempt, state)
