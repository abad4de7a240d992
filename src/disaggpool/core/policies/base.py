"""The one interface every routing policy implements, and the helpers they share.

A policy maps (request features, pool snapshot, seeded RNG) to a `RouteDecision`. It may keep
state of its own (a round-robin cursor) but reads no clock and does no I/O, so the simulator and
the sidecar call the very same objects. Adding a policy is one module plus one line in
`registry.py`.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol

from disaggpool.core import costmodel
from disaggpool.core.contracts import InstanceSnapshot, PoolSnapshot, RequestFeatures, RouteDecision

__all__ = ["NoCapacityError", "Policy", "healthy", "with_predictions"]


class NoCapacityError(RuntimeError):
    """No healthy instance of a role: the caller should answer 503, not guess."""


class Policy(Protocol):
    """Chooses a prefill and a decode instance for one request."""

    name: str

    def route(
        self, req: RequestFeatures, pool: PoolSnapshot, rng: random.Random
    ) -> RouteDecision: ...


def healthy(instances: Sequence[InstanceSnapshot], role: str) -> Sequence[InstanceSnapshot]:
    """The instances that may take work; raises NoCapacityError when there is none."""
    ok = [i for i in instances if i.healthy]
    if not ok:
        raise NoCapacityError(f"no healthy {role} instance")
    return ok


def with_predictions(
    policy: str, req: RequestFeatures, p: InstanceSnapshot, d: InstanceSnapshot
) -> RouteDecision:
    """A decision for a chosen pair, with the cost model's predictions when profiles are known.

    Baselines do not use predictions to choose, but reporting them lets the sidecar compare
    predicted and observed latency whatever policy runs.
    """
    if p.profile is None or d.profile is None:
        return RouteDecision(prefill=p.name, decode=d.name, policy=policy)
    ready = costmodel.prefill_ready_time(req, p, p.profile)
    est = costmodel.decode_estimate(req, d, d.profile, ready)
    return RouteDecision(
        prefill=p.name,
        decode=d.name,
        policy=policy,
        predicted_ttft_s=est.ttft_s,
        predicted_tpot_s=est.tpot_s,
        slo_feasible=req.slo.met(est.ttft_s, est.tpot_s),
    )
