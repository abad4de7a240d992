"""The DisaggPool's status (pure): replica counts, per-pod calibration, phase and conditions.

Conditions ``Ready``, ``Calibrated`` and ``Degraded`` carry observedGeneration, reason and message;
a condition's lastTransitionTime moves only when its status flips, so an unchanged pool gets an
identical status and `reconcile` writes nothing. Called by `reconcile` with the calibration plan.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from typing import Any

from disaggpool.core.profile import CalibrationProfile
from disaggpool.labels import POOL_LABEL, ROLE_LABEL, format_selector
from disaggpool.operator.calibration_plan import CalibrationPlan, PodCalibration
from disaggpool.operator.names import PoolRef, router_endpoint
from disaggpool.operator.observed import PodView
from disaggpool.operator.spec import PoolSpec, SpecIssue

__all__ = ["compute_status"]


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
    # The CRD's scale subresource (an HPA or KEDA driving decode.replicas) selects by this.
    status["decode"]["selector"] = format_selector({POOL_LABEL: pool.name, ROLE_LABEL: "decode"})
    pod_states = [_pod_status(c) for c in plan.pods] if plan else []
    calibrated = sum(1 for c in plan.pods if c.state == "calibrated") if plan else 0
    failed = [c for c in plan.pods if c.state == "failed"] if plan else []
    status["calibratedPods"] = calibrated
    status["pods"] = pod_states
    if spec is not None:
        status["policy"] = spec.router.policy
    elif previous.get("policy"):
        status["policy"] = previous["policy"]
    # else none: a pool invalid from its first version has no policy yet, and an empty string
    # is no way to say so (Kubernetes 1.20 turns "" in a status merge patch into null, which
    # the CRD's `type: string` refuses: the pool's status, Degraded included, was never written).
    # gRPC is reachable only when a token or the NetworkPolicy guards it (else loopback only).
    status["routerEndpoint"] = router_endpoint(
        pool, grpc=spec is not None and spec.router.grpc_exposed
    )
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
