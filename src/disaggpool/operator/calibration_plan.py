"""Calibration planning (pure): which pods need a probe, the probe Job for one, and what to prune.

`plan_calibration` looks at the pool's pods, profile ConfigMaps and probe Jobs (`observed` views)
and decides per pod: keep its profile, wait for its running probe, start a probe (a Job running
`disaggpool calibrate` against the pod, writing ConfigMap `<pool>-profile-<pod>`), or give up after
`maxAttempts` failures. It also lists the profiles and Jobs of deleted pods to delete.
`reconcile` executes the plan; `status` reports it.

The probe may patch only its pod's ConfigMap, by name (`access.probe_rules`): it may not create
one. So before a pod's first probe the plan creates that ConfigMap empty, owned by the pool and
without the profile label (`render_profile_placeholder`): neither the router nor the operator
counts it as a profile until the probe has written one and labelled it. The probe's own write
carries the same owner reference (``--configmap-owner``).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Iterable
from typing import Any

from disaggpool.labels import (
    ATTEMPT_LABEL,
    COMPONENT_CALIBRATION,
    POD_LABEL,
    POOL_LABEL,
    PROBE_JOB_LABELS,
    PROFILE_LABELS,
    format_selector,
    of_pool,
)
from disaggpool.operator.names import (
    PoolRef,
    job_name,
    owner_reference,
    pool_labels,
    profile_configmap_name,
    service_account_name,
    stamp,
)
from disaggpool.operator.observed import JobView, PodView, ProfileView
from disaggpool.operator.render import (
    API_KEY_ENV,
    container_security_context,
    pod_security_context,
)
from disaggpool.operator.spec import PoolSpec

__all__ = [
    "KEEP_OLD_JOBS",
    "CalibrationPlan",
    "PodCalibration",
    "plan_calibration",
    "render_calibration_job",
    "render_profile_placeholder",
]

# Jobs kept per pod: the trailing failures (they count attempts) plus this many older ones.
KEEP_OLD_JOBS = 1


def _parse_time(text: str) -> dt.datetime | None:
    try:
        t = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return t if t.tzinfo else t.replace(tzinfo=dt.UTC)


def render_calibration_job(
    pool: PoolRef, spec: PoolSpec, pod: PodView, peer_ip: str | None, attempt: int
) -> dict[str, Any]:
    """The probe as a Job owned by the pool: `disaggpool calibrate` in the operator's image."""
    c = spec.calibration
    cm = profile_configmap_name(pool, pod.name)
    # No role label: `pool + role` selects a pool's engine pods (the operator, the router, the
    # scale subresource), and a running probe pod is none of them. Seen on a real node: probe
    # pods counted as engines got probes of their own, without end. `PROBE_JOB_LABELS` is what
    # the operator finds its Jobs by (`reconcile`, the Job handler): without it a failed probe
    # went unnoticed, its pod `probing` for ever (seen on a real node too).
    which = {POD_LABEL: pod.name, ATTEMPT_LABEL: str(attempt)}
    kind = of_pool(pool.name, PROBE_JOB_LABELS, **which)
    labels = pool_labels(pool, COMPONENT_CALIBRATION, **kind)
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
        format_selector(of_pool(pool.name, PROFILE_LABELS, **{POD_LABEL: pod.name})),
        # The ConfigMap's owner: the router counts only profiles owned by its pool.
        "--configmap-owner",
        f"{pool.name}/{pool.uid}",
        "--out",
        "-",
        "--budget-seconds",
        f"{c.budget_s:g}",
    ]
    if pod.role == "decode" and peer_ip:
        args += ["--peer", f"http://{peer_ip}:{spec.engine.port}"]
    if pod.gpu_type:
        args += ["--gpu", pod.gpu_type]
    if not c.reprobe_on_poor:
        # A poor fit is kept: the Job succeeds, so Kubernetes does not run the probe again (its
        # backoffLimit) and overwrite the profile with another measurement.
        args.append("--accept-poor")
    container: dict[str, Any] = {
        "name": "probe",
        "image": c.image,
        "command": ["disaggpool"],
        "args": args,
        "resources": {
            "requests": {"cpu": "500m", "memory": "256Mi"},
            "limits": {"memory": "1Gi"},
        },
        "securityContext": container_security_context(),
    }
    if spec.auth.api_key is not None:  # the pods require the key (VLLM_API_KEY)
        key = spec.auth.api_key
        container["env"] = [
            {
                "name": API_KEY_ENV,
                "valueFrom": {"secretKeyRef": {"name": key.name, "key": key.key}},
            }
        ]
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": job_name(pool, pod.name, attempt), "labels": labels},
        "spec": {
            "backoffLimit": c.backoff_limit,
            # The probe's budget plus warm-up and the fit; a stuck probe must not block re-probes.
            "activeDeadlineSeconds": int(c.budget_s * 3) + 300,
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "restartPolicy": "Never",
                    "serviceAccountName": service_account_name(pool, "probe"),
                    "securityContext": pod_security_context(),
                    "containers": [container],
                },
            },
        },
    }
    return stamp(job, pool)


def render_profile_placeholder(pool: PoolRef, pod: str) -> dict[str, Any]:
    """The empty ConfigMap a pod's probe writes its profile into, created before the probe: owned
    by the pool, labelled with its pool and pod but not yet as a profile (the probe adds that)."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": profile_configmap_name(pool, pod),
            "namespace": pool.namespace,
            "labels": {POOL_LABEL: pool.name, POD_LABEL: pod},
            "ownerReferences": [owner_reference(pool)],
        },
    }


@dataclasses.dataclass(frozen=True, slots=True)
class PodCalibration:
    """One pod's calibration state, why, and the profile and Job it refers to."""

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
    create_configmaps: list[dict[str, Any]]  # placeholders the new probes write into
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
    placeholders: Iterable[tuple[str, str]] = (),
) -> CalibrationPlan:
    """Decide per pod: keep its profile, wait for its probe, start a probe, or give up.

    `profiles`: the pool's profile ConfigMaps (those not owned by this pool are ignored);
    `placeholders`: (ConfigMap, pod) of the pool's ConfigMaps awaiting a probe's profile."""
    pods = sorted(pods, key=lambda p: p.name)
    by_pod_profile = {v.pod: v for v in profiles if v.pod and v.owned}
    waiting = dict((pod, cm) for cm, pod in placeholders)
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
    for pod_name, cm in sorted(waiting.items()):
        if pod_name not in live and cm not in plan.delete_configmaps:
            plan.delete_configmaps.append(cm)
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
            if view is None and pod.name not in waiting:
                plan.create_configmaps.append(render_profile_placeholder(pool, pod.name))
            plan.create_jobs.append(job)
            plan.pods.append(PodCalibration(pod, "probing", reason, view, job["metadata"]["name"]))
    return plan
