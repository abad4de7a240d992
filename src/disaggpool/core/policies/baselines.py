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
from disaggpool.core.policies.base import healthy, with_predictions

__all__ = ["LeastLoaded", "LengthHeuristic", "PowerOfTwo", "RandomChoice", "RoundRobin"]

Key = Callable[[InstanceSnapshot], float]


def argmin(instances: Sequence[InstanceSnapshot], key: Key, rng: random.Random) -> InstanceSnapshot:
    best = min(key(i) for i in instances)
    ties = [i for i in instances if key(i) == best]
    return ties[0] if len(ties) == 1 else rng.choice(ties)


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._next = {"prefill": 0, "decode": 0}

    def _pick(self, instances: Sequence[InstanceSnapshot], role: str) -> InstanceSnapshot:
        ok = healthy(instances, role)
        i = self._next[role] % len(ok)
        self._next[role] = i + 1
        return ok[i]

    def route(self, req: RequestFeatures, pool: PoolSnapshot, rng: random.Random) -> RouteDecision:
        return with_predictions(
            self.name, req, self._pick(pool.prefill, "prefill"), self._pick(pool.decode, "decode")
        )


class RandomChoice:
    name = "random"

    def route(self, req: RequestFeatures, pool: PoolSnapshot, rng: random.Random) -> RouteDecision:
        p = rng.choice(healthy(pool.prefill, "prefill"))
        d = rng.choice(healthy(pool.decode, "decode"))
        return with_predictions(self.name, req, p, d)


class LeastLoaded:
    name = "least_loaded"

    def route(self, req: RequestFeatures, pool: PoolSnapshot, rng: random.Random) -> RouteDecision:
        def key(i: InstanceSnapshot) -> float:
            return float(max(i.inflight, i.running + i.waiting))

        p = argmin(healthy(pool.prefill, "prefill"), key, rng)
        d = argmin(healthy(pool.decode, "decode"), key, rng)
        return with_predictions(self.name, req, p, d)


class LengthHeuristic:
    name = "length"

    def route(self, req: RequestFeatures, pool: PoolSnapshot, rng: random.Random) -> RouteDecision:
        p = argmin(healthy(pool.prefill, "prefill"), lambda i: float(i.queued_tokens), rng)
        d = argmin(healthy(pool.decode, "decode"), lambda i: i.remaining_output_tokens, rng)
        return with_predictions(self.name, req, p, d)


class PowerOfTwo:
    name = "p2c"

    def _pick(
        self, instances: Sequence[InstanceSnapshot], role: str, rng: random.Random
    ) -> InstanceSnapshot:
        ok = healthy(instances, role)
        if len(ok) == 1:
            return ok[0]
        a, b = rng.sample(list(ok), 2)
        return a if a.inflight <= b.inflight else b

    def route(self, req: RequestFeatures, pool: PoolSnapshot, rng: random.Random) -> RouteDecision:
        return with_predictions(
            self.name,
            req,
            self._pick(pool.prefill, "prefill", rng),
            self._pick(pool.decode, "decode", rng),
        )
