"""Baseline policies from the study and common practice: they look at counts, not time.

* `round_robin`: independent cursors over prefill and decode instances (vLLM's toy proxy).
* `random`: uniform choice.
* `least_loaded`: fewest requests in flight from this router (queue counting).
* `length`: least outstanding work in tokens: queued prompt tokens for prefill, predicted
  remaining output tokens for decode.
* `p2c`: power of two choices on in-flight counts.

Ties are broken by the seeded RNG, so that a tie never systematically favours the first pod.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from disaggpool.core.contracts import InstanceSnapshot, PoolSnapshot, RequestFeatures, RouteDecision
from disaggpool.core.policies.base import find, healthy, with_predictions

__all__ = ["LeastLoaded", "LengthHeuristic", "PowerOfTwo", "RandomChoice", "RoundRobin"]

Key = Callable[[InstanceSnapshot], float]


def argmin(instances: Sequence[InstanceSnapshot], key: Key, rng: random.Random) -> InstanceSnapshot:
    best = min(key(i) for i in instances)
    ties = [i for i in instances if key(i) == best]
    return ties[0] if len(ties) == 1 else rng.choice(ties)


class _Baseline:
    """Independent prefill and decode choices; subclasses say how to pick one instance."""

    name = ""
    _bound_role = "decode"  # the role `route_decode` names to `_pick` (late binding)

    def _pick(
        self, instances: Sequence[InstanceSnapshot], role: str, rng: random.Random
    ) -> InstanceSnapshot:
        raise NotImplementedError

    def route(self, req: RequestFeatures, pool: PoolSnapshot, rng: random.Random) -> RouteDecision:
        p = self._pick(healthy(pool.prefill, "prefill"), "prefill", rng)
        d = self._pick(healthy(pool.decode, "decode"), "decode", rng)
        return with_predictions(self.name, req, p, d)

    def route_decode(
        self,
        req: RequestFeatures,
        pool: PoolSnapshot,
        rng: random.Random,
        prefill: str,
        elapsed_s: float,
    ) -> RouteDecision:
        d = self._pick(healthy(pool.decode, "decode"), self._bound_role, rng)
        return with_predictions(self.name, req, find(pool.prefill, prefill), d, elapsed_s)


class RoundRobin(_Baseline):
    name = "round_robin"

    def __init__(self) -> None:
        # Late binding asks `route` for a decode pod it then discards, and `route_decode` for the
        # one it keeps: each has its own cursor, so the kept ones take turns in binding order.
        self._next = {"prefill": 0, "decode": 0, "bound": 0}

    _bound_role = "bound"

    def _pick(
        self, instances: Sequence[InstanceSnapshot], role: str, rng: random.Random
    ) -> InstanceSnapshot:
        i = self._next[role] % len(instances)
        self._next[role] = i + 1
        return instances[i]


class RandomChoice(_Baseline):
    name = "random"

    def _pick(
        self, instances: Sequence[InstanceSnapshot], role: str, rng: random.Random
    ) -> InstanceSnapshot:
        return rng.choice(instances)


def _load(i: InstanceSnapshot) -> float:
    return float(max(i.inflight, i.running + i.waiting))


class LeastLoaded(_Baseline):
    name = "least_loaded"

    def _pick(
        self, instances: Sequence[InstanceSnapshot], role: str, rng: random.Random
    ) -> InstanceSnapshot:
        return argmin(instances, _load, rng)


def _outstanding_prompt(i: InstanceSnapshot) -> float:
    return float(i.queued_tokens)


def _outstanding_output(i: InstanceSnapshot) -> float:
    return i.remaining_output_tokens


class LengthHeuristic(_Baseline):
    name = "length"

    def _pick(
        self, instances: Sequence[InstanceSnapshot], role: str, rng: random.Random
    ) -> InstanceSnapshot:
        key = _outstanding_prompt if role == "prefill" else _outstanding_output
        return argmin(instances, key, rng)


class PowerOfTwo(_Baseline):
    name = "p2c"

    def _pick(
        self, instances: Sequence[InstanceSnapshot], role: str, rng: random.Random
    ) -> InstanceSnapshot:
        if len(instances) == 1:
            return instances[0]
        a, b = rng.sample(list(instances), 2)
        return a if a.inflight <= b.inflight else b
