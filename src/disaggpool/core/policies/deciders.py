"""The P/D decider by prompt length: short prompts are prefilled by the decode instance itself.

What llm-d's and Dynamo's deciders do in their simplest form: a fixed threshold on the prompt,
below which the prefill leg is skipped (the decode pod computes the prompt in its own steps, no
KV transfer). It wraps any policy, so a baseline can be compared with and without it; the
calibrated policy has its own decider priced in seconds (`CalibratedPolicy(pd_decider=True)`).
"""

from __future__ import annotations

import dataclasses
import random

from disaggpool.core.contracts import PoolSnapshot, RequestFeatures, RouteDecision
from disaggpool.core.policies.base import DecodeChoice, Policy

__all__ = ["ThresholdDecider"]


class ThresholdDecider:
    """`inner`'s placement; prompts shorter than `below` tokens skip the prefill leg."""

    def __init__(self, inner: Policy, below: int) -> None:
        if below < 1:
            raise ValueError(f"local_prefill_below must be >= 1, got {below}")
        self.inner = inner
        self.below = below
        self.name = inner.name

    def route(self, req: RequestFeatures, pool: PoolSnapshot, rng: random.Random) -> RouteDecision:
        decision = self.inner.route(req, pool, rng)
        if req.prompt_tokens < self.below and decision.prefill is not None:
            return dataclasses.replace(decision, prefill=None)
        return decision

    def route_decode(self, choice: DecodeChoice, rng: random.Random) -> RouteDecision:
        return self.inner.route_decode(choice, rng)
