"""How many decode pods a pass renders: the spec's count, or the router's recommendation (pure).

With `autoscaling.enabled`, the router's decode autoscaler (`core.autoscaling`, run by the
sidecar on the traffic it routes) writes its recommendation on the pool's status subresource as
``status.router.decodeRecommendation``: ``{"replicas": N, "reason": "...", "at": ISO-8601}``.
The router already applied the stabilisation window and rate limits; the operator clamps to
``decode.minReplicas..maxReplicas`` (the user's bounds are the last word), renders the single
decode variant with that count, and reports it in ``status.autoscaling`` and an Event.

Without autoscaling, or before the router's first recommendation, the spec's
``decode.replicas`` is rendered, which is also what an HPA or KEDA drives through the CRD's
``scale`` subresource. A recommendation that does not parse is reported and ignored: the pool
keeps the count it has.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from disaggpool.labels import DECODE_RECOMMENDATION_KEY, ROUTER_STATUS_KEY
from disaggpool.operator.spec import PoolSpec

__all__ = ["DecodeScale", "Recommendation", "decode_scale", "read_recommendation"]


@dataclasses.dataclass(frozen=True, slots=True)
class Recommendation:
    replicas: int
    reason: str
    at: str


@dataclasses.dataclass(frozen=True, slots=True)
class DecodeScale:
    """The decode count to render, and what to report about it."""

    replicas: int
    source: str  # "spec" | "autoscaler"
    reason: str
    recommendation: Recommendation | None = None
    error: str = ""  # a recommendation that did not parse

    def status(self) -> dict[str, Any]:
        """``status.autoscaling``."""
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


def read_recommendation(report: Mapping[str, Any]) -> tuple[Recommendation | None, str]:
    """The router's recommendation in its report (``status.router``), or None and why not (""
    when there is none)."""
    doc = report.get(DECODE_RECOMMENDATION_KEY)
    if doc is None:
        return None, ""
    where = f"status.{ROUTER_STATUS_KEY}.{DECODE_RECOMMENDATION_KEY}"
    if not isinstance(doc, Mapping):
        return None, f"{where}: must be an object"
    n = doc.get("replicas")
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        return None, f"{where}: replicas must be a non-negative integer, got {n!r}"
    return Recommendation(n, str(doc.get("reason", "")), str(doc.get("at", ""))), ""


def decode_scale(
    spec: PoolSpec, report: Mapping[str, Any], previous: Mapping[str, Any] | None = None
) -> DecodeScale:
    """The decode replicas to render for `spec` given the router's report (``status.router``);
    `previous`: the last `status.autoscaling`, whose count a malformed recommendation leaves in
    place."""
    if not spec.autoscaling.enabled:
        return DecodeScale(spec.decode.replicas, "spec", "autoscaling disabled: decode.replicas")
    rec, error = read_recommendation(report)
    if rec is None and error and previous and isinstance(previous.get("replicas"), int):
        kept = int(previous["replicas"])
        return DecodeScale(kept, str(previous.get("source", "spec")), f"{error}: kept", error=error)
    if rec is None:
        why = "no recommendation from the router yet"
        return DecodeScale(spec.decode.replicas, "spec", f"{why}: decode.replicas", error=error)
    lo = spec.decode.min_replicas or 0
    hi = spec.decode.max_replicas if spec.decode.max_replicas is not None else rec.replicas
    n = max(lo, min(hi, rec.replicas))
    bounded = "" if n == rec.replicas else f" (router asked {rec.replicas}, bounds {lo}..{hi})"
    return DecodeScale(n, "autoscaler", f"{rec.reason}{bounded}", rec)


def with_decode_replicas(spec: PoolSpec, replicas: int) -> PoolSpec:
    """`spec` with its single decode variant at `replicas` (autoscaling allows no other)."""
    if spec.decode.replicas == replicas:
        return spec
    (variant,) = spec.decode.variants
    decode = dataclasses.replace(
        spec.decode, variants=(dataclasses.replace(variant, replicas=replicas),)
    )
    return dataclasses.replace(spec, decode=decode)
