"""Baseline policies from the study and common practice: they look at counts, not time.

* `round_robin`: independent cursors over prefill and decode instances (vLLM's toy proxy).
* `random`: uniform choice.
* `least_loaded`: fewest requests in flight from this router (queue counting).
* `length`: least outstanding work in tokens: queued prompt tokens for prefill, predicted
  remaining output tokens for decode.
* `p2c`: power of two choices on in-flight counts.

Each is a `PerRole` policy (`core.policies.base`): one `pick` per role, ties broken by the seeded
RNG, so that a tie never systematically favours the first pod.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from disaggpool.core.contracts import InstanceSnapshot, RequestFeatures
from disaggpool.core.policies.base import PerRole, Stage, argmin

__all__ = ["LeastLoaded", "LengthHeuristic", "PowerOfTwo", "RandomChoice", "RoundRobin"]


class RoundRobin(PerRole):
    name = "round_robin"

    def __init__(self) -> None:
        # Late binding asks `route` for a decode pod it then discards, and `route_decode` for the
        # one it keeps: each stage has its own cursor, so the kept ones take turns in binding
        # order.
        self._next: dict[Stage, int] = {"prefill": 0, "decode": 0, "bound": 0}

    def pick(
        self,
        req: RequestFeatures,
        instances: Sequence[InstanceSnapshot],
        stage: Stage,
        rng: random.Random,
    ) -> InstanceSnapshot:
        i = self._next[stage] % len(instances)
        self._next[stage] = i + 1
        return instances[i]


class RandomChoice(PerRole):
    name = "random"

    def pick(
        self,
        req: RequestFeatures,
        instances: Sequence[InstanceSnapshot],
        stage: Stage,
        rng: random.Random,
    ) -> InstanceSnapshot:
        return rng.choice(instances)


def _load(i: InstanceSnapshot) -> float:
    return float(max(i.inflight, i.running + i.waiting))


class LeastLoaded(PerRole):
    name = "least_loaded"

    def pick(
        self,
        req: RequestFeatures,
        instances: Sequence[InstanceSnapshot],
        stage: Stage,
        rng: random.Random,
    ) -> InstanceSnapshot:
        return argmin(instances, _load, rng)


def _outstanding_prompt(i: InstanceSnapshot) -> float:
    return float(i.queued_tokens)


def _outstanding_output(i: InstanceSnapshot) -> float:
    return i.remaining_output_tokens


class LengthHeuristic(PerRole):
    name = "length"

    def pick(
        self,
        req: RequestFeatures,
        instances: Sequence[InstanceSnapshot],
        stage: Stage,
        rng: random.Random,
    ) -> InstanceSnapshot:
        key = _outstanding_prompt if stage == "prefill" else _outstanding_output
        return argmin(instances, key, rng)


class PowerOfTwo(PerRole):
    name = "p2c"

    def pick(
        self,
        req: RequestFeatures,
        instances: Sequence[InstanceSnapshot],
        stage: Stage,
        rng: random.Random,
    ) -> InstanceSnapshot:
        if len(instances) == 1:
            return instances[0]
        a, b = rng.sample(list(instances), 2)
        return a if a.inflight <= b.inflight else b
