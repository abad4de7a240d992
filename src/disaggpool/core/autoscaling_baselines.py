"""The autoscalers others use, written from their documentation, to compare ours against.

Each reads the same `Demand` and `PoolState` as `core.autoscaling.HeterogeneityScaler` and
returns a `ScaleDecision`; each keeps its project's own rate limits. Pure, like the rest of the
core. Where a project leaves a number to the user, the choice is named here.

* `StaticPeak`: no autoscaler, the pool sized for the peak (`bounds.max_replicas`).
* `KedaQueue`: KEDA's Prometheus scaler on `vllm:num_requests_waiting` driving the HPA: desired =
  ceil(waiting / target per pod), the HPA's 10% tolerance, scale-up at once (at most double or +4
  per 15 s), scale-down to the largest recommendation of the stabilisation window (the HPA's
  `behavior.scaleDown.stabilizationWindowSeconds`, default 300 s; here the same window as ours, so
  the comparison is of signals, not of patience). Target: 2 waiting per pod (KEDA's examples for
  vLLM leave it to the user; 2 keeps a little queue).
* `LlmdToken`: llm-d's token-aware decode scaling (its KEDA guide): the summed
  `vllm:kv_cache_usage_perc` over a 0.8 target per pod, at most +1 pod per 180 s and -1 per
  300 s.
* `LlmdSlo`: llm-d's SLO-aware variant: r = max(P90 TTFT / target, P90 TPOT / target); one more
  pod when r > 0.55, one fewer when r < 0.40, the same rate limits.
* `DynamoPlanner`: NVIDIA Dynamo's planner: every 180 s, predicted demand (the last window's rate:
  its constant predictor) over per-engine capacity (the largest batch meeting the ITL target,
  Little's law: the same `decode_capacity` as ours, from the calibrated profiles); a 5 s fast
  loop adds one pod when every engine's predicted step time is over the ITL target, and a pod is
  removed only when the load still fits under 80% of the smaller pool.

Their prefill counterparts (`make_prefill_autoscaler`), each project's own where it has one:

* `StaticPeak` and `KedaQueue` as they are, on the prefill pods' gauges (KEDA's queue trigger on
  the prefill Deployment);
* `LlmdTokenPrefill`: llm-d's token-aware prefill ScaledObject: the prompt tokens in flight at
  the prefill pods over `V_P` (the pool's prefill throughput, tokens/s, here from the calibrated
  constants at the mean prompt, as its `calibrate.sh` measures it) is seconds of backlog, over a
  1.5 s target per pod, with the decode side's rate limits;
* `LlmdSlo` on P90 TTFT / target alone (the guide leaves P/D to future work; TTFT is the
  prefill pool's part of the SLO);
* `DynamoPrefillPlanner`: Dynamo's prefill replicas, every 180 s the window's rate times the
  prefill time of its mean prompt (`ceil(rps * isl / throughput)`), and a fast loop adding one
  when the queued prompts' predicted wait is over the TTFT target.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from statistics import median
from typing import Protocol

from disaggpool.core.autoscaling import (
    Bounds,
    HeterogeneityScaler,
    PoolState,
    ScaleDecision,
    Stabilizer,
    decode_capacity,
)
from disaggpool.core.demand import Demand
from disaggpool.core.prefill_scaling import PrefillScaler
from disaggpool.core.profile import CalibrationProfile

__all__ = [
    "AUTOSCALERS",
    "Autoscaler",
    "DynamoPlanner",
    "DynamoPrefillPlanner",
    "KedaQueue",
    "LlmdSlo",
    "LlmdToken",
    "LlmdTokenPrefill",
    "StaticPeak",
    "make_autoscaler",
    "make_prefill_autoscaler",
]


class StaticPeak:
    name = "static_peak"

    def __init__(self, bounds: Bounds) -> None:
        self.bounds = bounds

    def decide(self, demand: Demand, pool: PoolState) -> ScaleDecision:
        return ScaleDecision(self.bounds.max_replicas, "static pool sized for the peak")


class KedaQueue:
    name = "keda_queue"
    TARGET_WAITING = 2.0
    TOLERANCE = 0.1

    def __init__(self, bounds: Bounds) -> None:
        # HPA v2 defaults: up at once by max(100%, 4 pods) per 15 s; down after the window.
        self.stabilizer = Stabilizer(bounds, up_every_s=15.0, down_step=None, down_every_s=15.0)
        self.bounds = bounds

    def decide(self, demand: Demand, pool: PoolState) -> ScaleDecision:
        # The HPA's ratio is over the pods that report (the ready ones); desired = ready * ratio.
        ready = max(1, pool.ready)
        ratio = (pool.waiting / ready) / self.TARGET_WAITING
        wish = pool.current if abs(ratio - 1.0) <= self.TOLERANCE else math.ceil(ready * ratio)
        wish = min(wish, pool.current + max(pool.current, 4))
        return ScaleDecision(
            self.stabilizer.apply(demand.now, wish, pool.current),
            f"{pool.waiting} waiting over {ready} ready pods (target {self.TARGET_WAITING:g})",
        )


class LlmdToken:
    name = "llmd_token"
    KV_TARGET = 0.8

    def __init__(self, bounds: Bounds) -> None:
        self.stabilizer = _llmd_rates(bounds)

    def decide(self, demand: Demand, pool: PoolState) -> ScaleDecision:
        wish = math.ceil(pool.kv_usage / self.KV_TARGET - 1e-9)
        return ScaleDecision(
            self.stabilizer.apply(demand.now, wish, pool.current),
            f"summed KV usage {pool.kv_usage:.2f} over {self.KV_TARGET}",
        )


class LlmdTokenPrefill:
    name = "llmd_token"
    BACKLOG_TARGET_S = 1.5

    def __init__(self, bounds: Bounds, profiles: Sequence[CalibrationProfile]) -> None:
        self.profiles = list(profiles)
        self.stabilizer = _llmd_rates(bounds)

    def decide(self, demand: Demand, pool: PoolState) -> ScaleDecision:
        isl = max(1, round(demand.mean_prompt))
        v_p = median(isl / p.prefill.prompt_time(isl) for p in self.profiles)
        backlog = pool.queued_tokens / v_p
        wish = math.ceil(backlog / self.BACKLOG_TARGET_S - 1e-9)
        return ScaleDecision(
            self.stabilizer.apply(demand.now, wish, pool.current),
            f"{pool.queued_tokens} prompt tokens in flight: {backlog:.2f} s of backlog over "
            f"{self.BACKLOG_TARGET_S} s per pod",
        )


class LlmdSlo:
    name = "llmd_slo"
    UP, DOWN = 0.55, 0.40

    def __init__(self, bounds: Bounds, *, ttft_only: bool = False) -> None:
        self.stabilizer = _llmd_rates(bounds)
        self.ttft_only = ttft_only

    def decide(self, demand: Demand, pool: PoolState) -> ScaleDecision:
        r = demand.ttft_ratio_p90
        if not self.ttft_only:
            r = max(r, demand.tpot_ratio_p90)
        wish = pool.current + (1 if r > self.UP else -1 if r < self.DOWN else 0)
        return ScaleDecision(
            self.stabilizer.apply(demand.now, wish, pool.current),
            f"P90 latency / SLO {r:.2f} (up > {self.UP}, down < {self.DOWN})",
        )


def _llmd_rates(bounds: Bounds) -> Stabilizer:
    return Stabilizer(
        Bounds(bounds.min_replicas, bounds.max_replicas, bounds.startup_s, 0.0),
        up_step=1,
        up_every_s=180.0,
        down_step=1,
        down_every_s=300.0,
    )


class DynamoPlanner:
    name = "dynamo_planner"
    INTERVAL_S = 180.0
    SCALE_DOWN_FILL = 0.8

    def __init__(
        self, bounds: Bounds, profiles: Sequence[CalibrationProfile], tpot_s: float
    ) -> None:
        self.bounds = bounds
        self.profiles = list(profiles)
        self.tpot_s = tpot_s
        self._next_plan = -math.inf

    def decide(self, demand: Demand, pool: PoolState) -> ScaleDecision:
        current = pool.current
        if pool.step_s and min(pool.step_s) > self.tpot_s and pool.starting == 0:
            return ScaleDecision(
                self.bounds.clamp(current + 1), "fast loop: every engine over the ITL target"
            )
        if demand.now < self._next_plan:
            return ScaleDecision(self.bounds.clamp(current), "between planning intervals")
        self._next_plan = demand.now + self.INTERVAL_S
        if demand.arrival_rps <= 0 or demand.mean_output <= 0:
            # Dynamo's planner has no load to divide by; it keeps the pool (it cannot reach 0).
            return ScaleDecision(self.bounds.clamp(current), "no demand observed: hold")
        rps = median(
            decode_capacity(p, demand.mean_prompt, demand.mean_output, self.tpot_s).rps
            for p in self.profiles
        )
        wish = math.ceil(demand.arrival_rps / rps - 1e-9)
        if wish < current and demand.arrival_rps > self.SCALE_DOWN_FILL * (current - 1) * rps:
            wish = current  # the smaller pool would run above 80%: keep it
        return ScaleDecision(
            self.bounds.clamp(wish),
            f"{demand.arrival_rps:.2f} req/s over {rps:.2f} req/s per engine",
        )


#: The autoscaler names `sim autoscale` compares (ours last).
AUTOSCALERS = (
    "static_peak",
    "keda_queue",
    "llmd_token",
    "llmd_slo",
    "dynamo_planner",
    "disaggpool",
)


class Autoscaler(Protocol):
    """What the simulator and the router need of any autoscaler, of either role."""

    name: str

    def decide(self, demand: Demand, pool: PoolState) -> ScaleDecision: ...


def make_autoscaler(
    name: str,
    bounds: Bounds,
    profiles: Sequence[CalibrationProfile],
    tpot_s: float,
    target_goodput: float = 0.9,
    *,
    min_headroom: float = 0.0,
) -> Autoscaler:
    """One autoscaler by name (`AUTOSCALERS`); `profiles`: the decode pool's calibrated ones;
    `min_headroom`: ours' floor (the others have none)."""
    if name == "static_peak":
        return StaticPeak(bounds)
    if name == "keda_queue":
        return KedaQueue(bounds)
    if name == "llmd_token":
        return LlmdToken(bounds)
    if name == "llmd_slo":
        return LlmdSlo(bounds)
    if name == "dynamo_planner":
        return DynamoPlanner(bounds, profiles, tpot_s)
    if name == "disaggpool":
        return HeterogeneityScaler(
            bounds, profiles, tpot_s, target_goodput, min_headroom=min_headroom
        )
    raise ValueError(f"unknown autoscaler {name!r}; choose from {', '.join(AUTOSCALERS)}")


class DynamoPrefillPlanner:
    name = "dynamo_planner"
    INTERVAL_S = 180.0

    def __init__(
        self, bounds: Bounds, profiles: Sequence[CalibrationProfile], ttft_s: float
    ) -> None:
        self.bounds = bounds
        self.profiles = list(profiles)
        self.ttft_s = ttft_s
        self._next_plan = -math.inf

    def decide(self, demand: Demand, pool: PoolState) -> ScaleDecision:
        current = pool.current
        isl = max(1, round(demand.mean_prompt))
        per_token = median(p.prefill.prompt_time(isl) / isl for p in self.profiles)
        wait = pool.queued_tokens * per_token / max(1, pool.ready)
        if wait > self.ttft_s and pool.starting == 0:
            return ScaleDecision(
                self.bounds.clamp(current + 1), "fast loop: queued prompts over the TTFT target"
            )
        if demand.now < self._next_plan:
            return ScaleDecision(self.bounds.clamp(current), "between planning intervals")
        self._next_plan = demand.now + self.INTERVAL_S
        if demand.arrival_rps <= 0:
            return ScaleDecision(self.bounds.clamp(current), "no demand observed: hold")
        busy = demand.arrival_rps * per_token * isl
        wish = math.ceil(busy - 1e-9)
        return ScaleDecision(
            self.bounds.clamp(wish), f"{demand.arrival_rps:.2f} req/s x {isl} tokens: {busy:.2f}"
        )


def make_prefill_autoscaler(
    name: str,
    bounds: Bounds,
    profiles: Sequence[CalibrationProfile],
    ttft_s: float,
    target_goodput: float = 0.9,
    *,
    min_headroom: float = 0.0,
) -> Autoscaler:
    """The prefill counterpart of autoscaler `name` (`AUTOSCALERS`; module docstring);
    `profiles`: the prefill pool's calibrated ones, `ttft_s`: the tightest TTFT target."""
    if name == "static_peak":
        return StaticPeak(bounds)
    if name == "keda_queue":
        return KedaQueue(bounds)
    if name == "llmd_token":
        return LlmdTokenPrefill(bounds, profiles)
    if name == "llmd_slo":
        return LlmdSlo(bounds, ttft_only=True)
    if name == "dynamo_planner":
        return DynamoPrefillPlanner(bounds, profiles, ttft_s)
    if name == "disaggpool":
        return PrefillScaler(bounds, profiles, ttft_s, target_goodput, min_headroom=min_headroom)
    raise ValueError(f"unknown autoscaler {name!r}; choose from {', '.join(AUTOSCALERS)}")
