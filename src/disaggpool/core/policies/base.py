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

__all__ = ["NoCapacityError", "Policy", "find", "healthy", "with_predictions"]


class NoCapacityError(RuntimeError):
    """No healthy instance of a role: the caller should answer 503, not guess."""


class Policy(Protocol):
    """Chooses a prefill and a decode instance for one request.

    `route` chooses both when the request arrives. `route_decode` chooses the decode instance
    alone for a request whose prefill leg on `prefill` has returned (late binding), on the state
    of that moment; `elapsed_s` is the time since the request arrived, which its TTFT already
    carries.
    """

    name: str

    def route(
        self, req: RequestFeatures, pool: PoolSnapshot, rng: random.Random
    ) -> RouteDecision: ...

    def route_decode(
        self,
        req: RequestFeatures,
        pool: PoolSnapshot,
        rng: random.Random,
        prefill: str,
        elapsed_s: float,
    ) -> RouteDecision: ...


def healthy(instances: Sequence[InstanceSnapshot], role: str) -> Sequence[InstanceSnapshot]:
    """The instances that may take work; raises NoCapacityError when there is none."""
    ok = [i for i in instances if i.healthy]
    if not ok:
        raise NoCapacityError(f"no healthy {role} instance")
    return ok


def find(instances: Sequence[InstanceSnapshot], name: str) -> InstanceSnapshot:
    """The instance called `name` (a late-bound request's prefill instance)."""
    for inst in instances:
        if inst.name == name:
            return inst
    raise NoCapacityError(f"instance {name!r} is not in the pool any more")


def with_predictions(
    policy: str,
    req: RequestFeatures,
    p: InstanceSnapshot,
    d: InstanceSnapshot,
    elapsed_s: float | None = None,
) -> RouteDecision:
    """A decision for a chosen pair, with the cost model's predictions when profiles are known.

    Baselines do not use predictions to choose, but reporting them lets the sidecar compare
    predicted and observed latency whatever policy runs. `elapsed_s` (late binding): the prefill
    is done, `elapsed_s` after arrival. A profile outside the physical bounds
    (`CalibrationProfile.implausible`, e.g. a zero decode step) predicts nothing.
    """
    if p.profile is None or d.profile is None or p.profile.implausible or d.profile.implausible:
        return RouteDecision(prefill=p.name, decode=d.name, policy=policy)
    ready = costmodel.prefill_ready_time(req, p, p.profile) if elapsed_s is None else elapsed_s
    est = costmodel.decode_estimate(req, d, d.profile, ready, bound_late=elapsed_s is not None)
    return RouteDecision(
        prefill=p.name,
        decode=d.name,
        policy=policy,
        predicted_ttft_s=est.ttft_s,
        predicted_tpot_s=est.tpot_s,
        slo_feasible=req.slo.met(est.ttft_s, est.tpot_s),
    )
