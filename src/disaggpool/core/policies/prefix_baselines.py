"""The peers' prefix-cache-aware rules, written from their sources, as baselines.

All three read what the router believes each prefill instance has cached from
`RequestFeatures.prefix_hits` (the router's `core.prefix_index`, the same index our calibrated
policy reads, so the comparison is of the rules, not of the indexes), and choose the decode
instance as their P/D deployments do: by load alone.

* `cache_aware`: vLLM's router (`vllm-project/router`, `src/policies/cache_aware.rs`; the same
  rule as SGLang's router). Load is the router's own requests in flight per instance. When the
  loads are imbalanced (max - min > `balance_abs` and max > min x `balance_rel`) the least
  loaded instance wins; otherwise, when the best match covers more than `cache_threshold` of the
  prompt, the instance with the longest match wins; otherwise the least loaded. Thresholds are
  its command-line defaults (`src/main.rs`): 0.3, 64, 1.5. It matches prompt characters in a
  radix tree; here, prompt blocks (a token-granular stand-in: the rule is the same). Decode: the
  least loaded instance (its documented P/D pairing puts power-of-two there, which on the small
  pools here is the least loaded most of the time).
* `dynamo_kv`: NVIDIA Dynamo's KV router (`ai-dynamo/dynamo`, `lib/kv-router/src/scheduling/
  selector/default.rs`) with its defaults: cost = prefill blocks (tokens still to prefill there
  plus this prompt, in KV blocks) minus the blocks it has cached (credit 1), plus the blocks of
  the requests decoding there; the lowest cost wins, ties at random. Its disaggregated mode
  (`router-disaggregated-serving.md`) scores prefill workers without decode blocks and decode
  workers without the cache credit and prefill tokens, which is what is done here: prefill by
  uncached prefill blocks, decode by KV blocks in use.
* `llmd_weighted`: llm-d's endpoint picker (`llm-d/llm-d-inference-scheduler`) as its precise
  prefix-cache sample configures it (`deploy/config/epp-precise-prefix-cache-config.yaml`):
  scorers in [0, 1] summed with weights, the highest sum wins, ties at random
  (`max-score-picker`). Prefix 2.0 (leading cached blocks / prompt blocks, the score since its
  PR #1107), KV-cache utilisation 1.0 (1 - the fraction in use), queue 1.0 (waiting requests,
  min-max normalised across the instances, all 1.0 when equal). Decode instances by the two load
  scorers alone (nothing is indexed there); every request is disaggregated (its P/D decider's
  default threshold, 0, always sends the prompt to the prefill pool).

All three are cache-aware but count blocks and requests; none knows how fast an instance is.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from disaggpool.core.contracts import InstanceSnapshot, RequestFeatures
from disaggpool.core.policies.base import PerRole, Stage, argmin

__all__ = ["CacheAware", "DynamoKv", "LlmdWeighted"]


class _PrefixBaseline(PerRole):
    """A prefill rule of its own (`_prefill`: it reads the request's cached prefixes); decode by
    `_decode`, by load, at arrival and at late binding alike."""

    def pick(
        self,
        req: RequestFeatures,
        instances: Sequence[InstanceSnapshot],
        stage: Stage,
        rng: random.Random,
    ) -> InstanceSnapshot:
        if stage == "prefill":
            return self._prefill(req, instances, rng)
        return self._decode(instances, rng)

    def _prefill(
        self, req: RequestFeatures, instances: Sequence[InstanceSnapshot], rng: random.Random
    ) -> InstanceSnapshot:
        raise NotImplementedError

    def _decode(
        self, instances: Sequence[InstanceSnapshot], rng: random.Random
    ) -> InstanceSnapshot:
        return argmin(instances, lambda i: i.inflight, rng)


class CacheAware(_PrefixBaseline):
    """vLLM router's `cache_aware` (module docstring)."""

    name = "cache_aware"

    def __init__(
        self, cache_threshold: float = 0.3, balance_abs: int = 64, balance_rel: float = 1.5
    ) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel

    def _prefill(
        self, req: RequestFeatures, instances: Sequence[InstanceSnapshot], rng: random.Random
    ) -> InstanceSnapshot:
        loads = [i.inflight for i in instances]
        high, low = max(loads), min(loads)
        if high - low > self.balance_abs and high > low * self.balance_rel:
            return argmin(instances, lambda i: i.inflight, rng)
        hits = req.prefix_hits
        best = max((hits.get(i.name, 0) for i in instances), default=0)
        if best > self.cache_threshold * req.prompt_tokens:
            # Every instance at the deepest match holds it; the tree hands back one of them.
            return next(i for i in instances if hits.get(i.name, 0) == best)
        return argmin(instances, lambda i: i.inflight, rng)


def _block_size(i: InstanceSnapshot) -> int:
    """`i`'s KV block in tokens: its profile's, or vLLM's default 16 without a plausible one (a
    block of 0 tokens, possible only in a profile built in code, would be divided by)."""
    p = i.profile
    return p.block_size if p is not None and not p.implausible else 16


class DynamoKv(_PrefixBaseline):
    """NVIDIA Dynamo's KV-router cost, disaggregated mode (module docstring)."""

    name = "dynamo_kv"

    def _prefill(
        self, req: RequestFeatures, instances: Sequence[InstanceSnapshot], rng: random.Random
    ) -> InstanceSnapshot:
        hits = req.prefix_hits
        n = req.prompt_tokens

        def cost(i: InstanceSnapshot) -> float:
            block = _block_size(i)
            return max(0.0, (i.queued_tokens + n - hits.get(i.name, 0)) / block)

        return argmin(instances, cost, rng)

    def _decode(
        self, instances: Sequence[InstanceSnapshot], rng: random.Random
    ) -> InstanceSnapshot:
        # KV blocks in use; the request's own new blocks are the same on every instance.
        def blocks(i: InstanceSnapshot) -> float:
            block = _block_size(i)
            return (i.kv_tokens_used + i.queued_tokens) / block

        return argmin(instances, blocks, rng)


class LlmdWeighted(_PrefixBaseline):
    """llm-d's weighted scorers and max-score picker (module docstring)."""

    name = "llmd_weighted"

    def __init__(self, prefix: float = 2.0, kv_utilisation: float = 1.0, queue: float = 1.0):
        self.weights = (prefix, kv_utilisation, queue)

    def _scores(
        self, instances: Sequence[InstanceSnapshot], prefix: Sequence[float]
    ) -> list[float]:
        w_prefix, w_kv, w_queue = self.weights
        waiting = [i.waiting for i in instances]
        high, low = max(waiting), min(waiting)
        scores = []
        for inst, hit in zip(instances, prefix, strict=True):
            prof = inst.profile
            capacity = prof.kv_capacity_tokens if prof is not None and not prof.implausible else 0
            used = min(1.0, inst.kv_tokens_used / capacity) if capacity > 0 else 0.0
            queue = 1.0 if high == low else (high - inst.waiting) / (high - low)
            scores.append(w_prefix * hit + w_kv * (1.0 - used) + w_queue * queue)
        return scores

    def _best(
        self, instances: Sequence[InstanceSnapshot], prefix: Sequence[float], rng: random.Random
    ) -> InstanceSnapshot:
        scores = self._scores(instances, prefix)
        top = max(scores)
        return rng.choice([i for i, s in zip(instances, scores, strict=True) if s == top])

    def _prefill(
        self, req: RequestFeatures, instances: Sequence[InstanceSnapshot], rng: random.Random
    ) -> InstanceSnapshot:
        n = max(1, req.prompt_tokens)
        hits = req.prefix_hits
        return self._best(instances, [min(1.0, hits.get(i.name, 0) / n) for i in instances], rng)

    def _decode(
        self, instances: Sequence[InstanceSnapshot], rng: random.Random
    ) -> InstanceSnapshot:
        return self._best(instances, [0.0] * len(instances), rng)
