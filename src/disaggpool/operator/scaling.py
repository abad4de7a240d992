"""How many decode and prefill pods a pass renders: the spec's counts, or the router's
recommendations (pure).

With `autoscaling.enabled`, the router's autoscalers (`sidecar.autoscale`, run on the traffic it
routes) write their recommendations on the pool's status subresource:
``status.router.decodeRecommendation`` always, ``status.router.prefillRecommendation`` when
``prefill.maxReplicas`` is set (only then is prefill autoscaled), each
``{"replicas": N, "reason": "...", "at": ISO-8601}``. The router already applied the
stabilisation window and rate limits; the operator clamps each to its role's
``minReplicas..maxReplicas`` (the user's bounds are the last word), renders that role's single
variant with the count, and reports it in ``status.autoscaling`` (decode's fields at its top,
where they always were; prefill's in ``status.autoscaling.prefill``) and an Event.

Without autoscaling, or before the router's first recommendation, the spec's ``replicas`` is
rendered (for decode, also what an HPA or KEDA drives through the CRD's ``scale``
subresource). A recommendation that does not parse is reported and ignored: the role keeps the
count it has.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from disaggpool.core.contracts import Role
from disaggpool.labels import (
    DECODE_RECOMMENDATION_KEY,
    PREFILL_RECOMMENDATION_KEY,
    ROUTER_STATUS_KEY,
)
from disaggpool.operator.spec import PoolSpec, RoleSpec

__all__ = [
    "PoolScale",
    "Recommendation",
    "RoleScale",
    "pool_scale",
    "previous_role_status",
    "read_recommendation",
    "role_scale",
    "with_replicas",
]

#: Where the router writes each role's recommendation, under ``status.router``.
RECOMMENDATION_KEYS: Mapping[Role, str] = {
    "decode": DECODE_RECOMMENDATION_KEY,
    "prefill": PREFILL_RECOMMENDATION_KEY,
}


@dataclasses.dataclass(frozen=True, slots=True)
class Recommendation:
    replicas: int
    reason: str
    at: str


@dataclasses.dataclass(frozen=True, slots=True)
class RoleScale:
    """One role's count to render, and what to report about it."""

    role: Role
    replicas: int
    source: str  # "spec" | "autoscaler"
    reason: str
    recommendation: Recommendation | None = None
    error: str = ""  # a recommendation that did not parse

    def status(self) -> dict[str, Any]:
        """This role's part of ``status.autoscaling``."""
        out: dict[str, Any] = {
            "replicas": self.replicas,
            "source": self.source,
            "reason": self.reason,
        }
        if self.recommendation is not None:
            out["recommendedReplicas"] = self.recommendation.replicas
            out["recommendedAt"] = self.recommendation.at
        if self.error:
            out["error"] = self.error
        return out


@dataclasses.dataclass(frozen=True, slots=True)
class PoolScale:
    """Both roles' counts; `prefill` None when prefill is not autoscaled."""

    decode: RoleScale
    prefill: RoleScale | None = None

    @property
    def roles(self) -> tuple[RoleScale, ...]:
        return (self.decode,) if self.prefill is None else (self.decode, self.prefill)

    def status(self) -> dict[str, Any]:
        """``status.autoscaling``: decode's fields at the top (as before prefill was scaled),
        prefill's under ``prefill``."""
        out = self.decode.status()
        if self.prefill is not None:
            out["prefill"] = self.prefill.status()
        return out

    def apply(self, spec: PoolSpec) -> PoolSpec:
        """`spec` with each scaled role's variant at its count."""
        for scale in self.roles:
            spec = with_replicas(spec, scale.role, scale.replicas)
        return spec


def previous_role_status(previous: Mapping[str, Any] | None, role: Role) -> Mapping[str, Any]:
    """A role's part of the last ``status.autoscaling`` (`PoolScale.status`), {} if none."""
    previous = previous or {}
    got = previous if role == "decode" else previous.get(role)
    return got if isinstance(got, Mapping) else {}


def read_recommendation(
    report: Mapping[str, Any], role: Role = "decode"
) -> tuple[Recommendation | None, str]:
    """The router's recommendation for `role` in its report (``status.router``), or None and
    why not ("" when there is none)."""
    key = RECOMMENDATION_KEYS[role]
    doc = report.get(key)
    if doc is None:
        return None, ""
    where = f"status.{ROUTER_STATUS_KEY}.{key}"
    if not isinstance(doc, Mapping):
        return None, f"{where}: must be an object"
    n = doc.get("replicas")
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        return None, f"{where}: replicas must be a non-negative integer, got {n!r}"
    return Recommendation(n, str(doc.get("reason", "")), str(doc.get("at", ""))), ""


def role_scale(
    spec: PoolSpec,
    role: Role,
    report: Mapping[str, Any],
    previous: Mapping[str, Any] | None = None,
) -> RoleScale:
    """The replicas of `role` to render for `spec` given the router's report
    (``status.router``); `previous`: that role's last status (`previous_role_status`), whose
    count a malformed recommendation leaves in place."""
    rs: RoleSpec = spec.role(role)
    if not spec.autoscaling.enabled:
        return RoleScale(role, rs.replicas, "spec", f"autoscaling disabled: {role}.replicas")
    rec, error = read_recommendation(report, role)
    if rec is None and error and previous and isinstance(previous.get("replicas"), int):
        kept = int(previous["replicas"])
        source = str(previous.get("source", "spec"))
        return RoleScale(role, kept, source, f"{error}: kept", error=error)
    if rec is None:
        why = "no recommendation from the router yet"
        return RoleScale(role, rs.replicas, "spec", f"{why}: {role}.replicas", error=error)
    lo = rs.min_replicas or 0
    hi = rs.max_replicas if rs.max_replicas is not None else rec.replicas
    n = max(lo, min(hi, rec.replicas))
    bounded = "" if n == rec.replicas else f" (router asked {rec.replicas}, bounds {lo}..{hi})"
    return RoleScale(role, n, "autoscaler", f"{rec.reason}{bounded}", rec)


def pool_scale(
    spec: PoolSpec, report: Mapping[str, Any], previous: Mapping[str, Any] | None = None
) -> PoolScale:
    """Both roles' counts; `previous`: the last ``status.autoscaling``. Prefill is scaled only
    with autoscaling on and ``prefill.maxReplicas`` set; otherwise it keeps its replicas."""
    decode = role_scale(spec, "decode", report, previous_role_status(previous, "decode"))
    if not spec.autoscaling.enabled or spec.prefill.max_replicas is None:
        return PoolScale(decode)
    prefill = role_scale(spec, "prefill", report, previous_role_status(previous, "prefill"))
    return PoolScale(decode, prefill)


def with_replicas(spec: PoolSpec, role: Role, replicas: int) -> PoolSpec:
    """`spec` with `role`'s single variant at `replicas` (autoscaling allows no other)."""
    rs = spec.role(role)
    if rs.replicas == replicas:
        return spec
    (variant,) = rs.variants
    scaled = dataclasses.replace(rs, variants=(dataclasses.replace(variant, replicas=replicas),))
    if role == "prefill":
        return dataclasses.replace(spec, prefill=scaled)
    return dataclasses.replace(spec, decode=scaled)
