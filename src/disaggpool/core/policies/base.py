"""The one interface every routing policy implements, the shape they share, and their helpers.

A policy maps (request features, pool snapshot, seeded RNG) to a `RouteDecision`: `route` chooses
the prefill and the decode pod of a new request, `route_decode` the decode pod alone of a request
whose prefill leg answered (late binding; a retry), given as a `DecodeChoice`. It may keep state
of its own (a round-robin cursor) but reads no clock and does no I/O, so the simulator and the
sidecar call the very same objects, through `core.router.Router`.

The shape. The Gateway API Inference Extension's endpoint picker (and llm-d's scheduler built on
it) runs, per role, *filters* (which pods may take the request), *scorers* (a number per pod)
and one *picker* (which pod, from the scores). Ours follow it as far as their rules allow:

* Filter: the healthy pods of each role (`healthy`); the router marks the pods a retry must avoid
  unhealthy, so every policy honours them with no code of its own.
* `PerRole` policies choose the prefill and the decode pod each on its own, by one `pick` per
  role: a scorer and a picker together. The counting baselines score a pod by one count (requests
  in flight, queued tokens) and `argmin` picks the lowest, ties broken by the seeded RNG;
  round-robin, random and power-of-two are pickers alone; `llmd_weighted` is llm-d's weighted sum
  of normalised scorers with its max-score picker, faithfully, because that is the rule it
  reproduces. Late binding picks the decode pod again (stage ``"bound"``), with no code of its own.
* The calibrated policy does not decompose into per-pod scores. It scores a (prefill, decode)
  *pair* (the decode pod's TTFT depends on where and when the prompt is prefilled), its score is
  lexicographic — fewest expected SLO violations, then least additional completion time — which
  no weighted sum reproduces (no number of seconds is worth one violation), and its
  bounded-load guard filters *after* scoring (it needs every pod's load, and the decision records
  whether it overrode the cheapest). So it is one module with its stages named in its docstring
  (`calibrated.py`); the P/D decider is a third path priced the same way.
* P/D deciders wrap a policy (`deciders.ThresholdDecider`), as llm-d's decider plugin wraps the
  prefill profile: the inner policy places, the decider says whether the prefill leg is skipped.

Adding a policy: one module with a class that has a `name` and implements `route` (and
`route_decode`, or subclasses `PerRole` and implements `pick`), plus one line in `registry.py`.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Sequence
from typing import Literal, Protocol

from disaggpool.core import costmodel
from disaggpool.core.contracts import InstanceSnapshot, PoolSnapshot, RequestFeatures, RouteDecision

__all__ = [
    "DecodeChoice",
    "Key",
    "NoCapacityError",
    "PerRole",
    "Policy",
    "Stage",
    "argmin",
    "find",
    "healthy",
    "with_predictions",
]


class NoCapacityError(RuntimeError):
    """No healthy instance of a role: the caller should answer 503, not guess."""


@dataclasses.dataclass(frozen=True, slots=True)
class DecodeChoice:
    """A request whose prefill leg on `prefill` answered `elapsed_s` after it arrived (its TTFT
    already carries that time), to be given a decode pod on `pool`."""

    req: RequestFeatures
    pool: PoolSnapshot
    prefill: str
    elapsed_s: float


class Policy(Protocol):
    """Chooses a prefill and a decode instance for one request (module docstring)."""

    name: str

    def route(
        self, req: RequestFeatures, pool: PoolSnapshot, rng: random.Random
    ) -> RouteDecision: ...

    def route_decode(self, choice: DecodeChoice, rng: random.Random) -> RouteDecision: ...


#: Which pick a `PerRole` policy is asked for: a new request's prefill or decode pod, or the
#: decode pod of a request whose prefill leg answered (late binding).
Stage = Literal["prefill", "decode", "bound"]

#: A scorer: lower is better.
Key = Callable[[InstanceSnapshot], float]


def argmin(instances: Sequence[InstanceSnapshot], key: Key, rng: random.Random) -> InstanceSnapshot:
    """The picker of the counting policies: the lowest `key`, ties broken by the seeded RNG, so
    that a tie never systematically favours the first pod."""
    best = min(key(i) for i in instances)
    ties = [i for i in instances if key(i) == best]
    return ties[0] if len(ties) == 1 else rng.choice(ties)


class PerRole:
    """A policy that picks the prefill and the decode pod each on its own (module docstring);
    subclasses implement `pick`."""

    name = ""

    def pick(
        self,
        req: RequestFeatures,
        instances: Sequence[InstanceSnapshot],
        stage: Stage,
        rng: random.Random,
    ) -> InstanceSnapshot:
        """One pod of `instances` (healthy, never empty) for `stage`."""
        raise NotImplementedError

    def route(self, req: RequestFeatures, pool: PoolSnapshot, rng: random.Random) -> RouteDecision:
        p = self.pick(req, healthy(pool.prefill, "prefill"), "prefill", rng)
        d = self.pick(req, healthy(pool.decode, "decode"), "decode", rng)
        return with_predictions(self.name, req, p, d)

    def route_decode(self, choice: DecodeChoice, rng: random.Random) -> RouteDecision:
        req, pool = choice.req, choice.pool
        d = self.pick(req, healthy(pool.decode, "decode"), "bound", rng)
        p = find(pool.prefill, choice.prefill)
        return with_predictions(self.name, req, p, d, choice.elapsed_s)


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
