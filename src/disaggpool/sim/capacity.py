"""Pool sizing from principles: SLO targets, per-instance capacity, the prefill/decode split.

Every threshold of the paper experiment comes from here, computed once from the profile and the
traffic's length distribution, never tuned against results:

* **SLO targets** are multiples of the *unloaded* latency of the class's p90 request on the
  nominal hardware (prefill + KV transfer + one decode step for TTFT; one decode step at batch 1
  for TPOT). Interactive chat: TTFT x4, TPOT x2 (a person reads the stream). Code completion:
  TTFT x3, TPOT x4 (the editor waits for the whole, short, completion).
* **Prefill capacity** (requests/s per instance): the inverse of the mean prefill time per request
  in a saturated chunked-prefill pipeline (iteration overhead amortised over the token budget).
* **Decode capacity**: Little's law at the largest batch whose step time still meets the
  tightest TPOT target, fits the KV cache and `max_num_seqs`: ``B / (E[output] * step(B))`` (the
  throughput at the SLO, as DistServe defines per-GPU goodput capacity; the decode autoscaler's
  own formula, `core.autoscaling.decode_capacity`).
* **Split**: the integer split of G GPUs that maximises the smaller of the two pool capacities
  (ties to more decode instances, where routing has choices to make).

Pure arithmetic; called by `studies.paper_setup`, `studies.paper` and the demo, and recorded in the
experiment's JSON.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from disaggpool.core.autoscaling import decode_capacity
from disaggpool.core.contracts import SLOClass
from disaggpool.core.profile import CalibrationProfile
from disaggpool.formats.traces import TraceRequest

__all__ = ["ClassTargets", "PoolCapacity", "best_split", "pool_capacity", "slo_targets"]

#: (TTFT multiple, TPOT multiple) of unloaded latency, per class (see module docstring).
ClassTargets = Mapping[str, tuple[float, float]]
DEFAULT_TARGETS: ClassTargets = {"chat": (4.0, 2.0), "code": (3.0, 4.0)}


def _p90(values: Sequence[int]) -> int:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


def slo_targets(
    profile: CalibrationProfile,
    trace: Sequence[TraceRequest],
    targets: ClassTargets = DEFAULT_TARGETS,
) -> dict[str, SLOClass]:
    """SLO classes for the classes present in `trace`, as multiples of unloaded latency."""
    out = {}
    for name, (k_ttft, k_tpot) in targets.items():
        prompts = [r.prompt_tokens for r in trace if r.slo_class == name]
        if not prompts:
            continue
        n = _p90(prompts)
        step = profile.decode.step(1, n)
        ttft = profile.prefill.prompt_time(n) + profile.kv_transfer.time(n) + step
        out[name] = SLOClass(name, round(max(0.25, k_ttft * ttft), 3), round(k_tpot * step, 4))
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class PoolCapacity:
    """Requests per second one instance sustains, per role, for a given traffic mix."""

    prefill_rps: float
    decode_rps: float
    decode_batch: int


def pool_capacity(
    profile: CalibrationProfile, trace: Sequence[TraceRequest], tightest_tpot_s: float
) -> PoolCapacity:
    n = len(trace)
    mean_prompt = sum(r.prompt_tokens for r in trace) / n
    mean_sq = sum(r.prompt_tokens**2 for r in trace) / n
    mean_out = sum(r.output_tokens for r in trace) / n
    pf = profile.prefill
    per_request = (
        pf.p0 * mean_prompt / profile.max_num_batched_tokens + pf.p1 * mean_prompt + pf.p2 * mean_sq
    )
    decode = decode_capacity(profile, mean_prompt, mean_out, tightest_tpot_s)
    # An instance that cannot meet the target even alone adds no capacity at the SLO.
    rps = decode.rps if decode.step_s <= tightest_tpot_s else 0.0
    return PoolCapacity(1.0 / per_request, rps, decode.batch)


def best_split(gpus: int, cap: PoolCapacity) -> tuple[int, int]:
    """(prefill, decode) instances out of `gpus` maximising the bottleneck capacity."""
    if gpus < 2:
        raise ValueError("a disaggregated pool needs at least 2 GPUs")
    best = max(
        range(1, gpus),
        key=lambda p: (min(p * cap.prefill_rps, (gpus - p) * cap.decode_rps), gpus - p),
    )
    return best, gpus - best


def bottleneck_rps(n_prefill: int, n_decode: int, cap: PoolCapacity) -> float:
    return min(n_prefill * cap.prefill_rps, n_decode * cap.decode_rps)
