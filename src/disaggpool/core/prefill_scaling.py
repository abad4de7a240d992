"""Prefill autoscaling: how many prefill instances the arriving prompts need for the TTFT target.

Pure, like `core.autoscaling` (whose `Bounds`, `PoolState`, `Stabilizer` and `Demand` it shares):
the simulator and the router run it, the operator applies its recommendation.

**Capacity model, from the calibrated prefill constants.** A prompt of n tokens takes
S(n) = p0 + p1 n + p2 n^2 seconds on a prefill instance (`PrefillModel.prompt_time`). Prompts are
known exactly as they are routed, so the service times of the last routed prompts
(`Demand.prompts`) give E[S] and its squared coefficient of variation cs^2 without waiting for
anything to finish: a shift to longer prompts is priced on its first requests. With arrivals at
rate lambda the pool offers a = lambda E[S] busy instances. lambda is read one cold start ahead
along the part of the window's trend that is significant at the target quantile
(`Demand.significant_rise`). The whole upward slope, as decode reads it, is noise on steady
traffic, and the stabiliser keeps the largest wish of its window, so the noise's peaks held a
second prefill pod through the flash crowd's base rate. Counting only the significant part saved
up to 7% of ours' GPU-hours in `sim autoscale` (2% on `diurnal`, 7% on `flash`, whose goodput rose
3 points; none on `bursts` and `mixshift`), every other goodput within 0.07 points.
(Decode keeps the whole slope: a trial of the same rule there lost goodput on `bursts`, whose
bursts last one cold start and are met by the pods the pool holds between them.)

The router spreads prompts over the pool as one queue does over c servers, so the pool is an
M/G/c queue; by the Allen-Cunneen approximation a prompt waits longer than t with probability

    P(W > t) ~= C(c, a) exp(-2 (c - a) t / ((ca^2 + cs^2) E[S])),

C the Erlang C probability that it waits at all, ca^2 and cs^2 the squared coefficients of
variation of the arrivals and of the service times (1 + 1 is the M/M/c case). The arrivals' is
their burstiness, the index of dispersion D of the arrival counts (1 for Poisson): bursts make
queues longer in proportion. Each prompt has its own slack: the TTFT target less its own prefill
and KV transfer, t_i = TTFT - S(n_i) - X(n_i). A short prompt may wait much longer than a long
one, so the pool is sized for the share of prompts that would miss, the mean over the routed
prompts of P(W > t_i), at most 1 - target. Prompts with no slack at all miss on any pool and are
left out of that mean: no number of pods helps them, and counting them would ask for every pod
the bounds allow. (Sizing every prompt for the tail prompt's slack, as this did at first, asks
for more pods than a mix of short and long prompts needs.) On the study's chat prompts that
share is within 30% of a simulated first-come-first-served queue's at one and two pods
(`tests/core/test_prefill_scaling.py`).

Prompts already queued at the prefill pods are work the steady picture misses: they need
`waiting * E[S] / TTFT` instances to be served within one target. The headroom over the offered
load serves them first; only a backlog beyond it adds pods (a single queued prompt used to round
a whole pod up, and the stabiliser then held it for its window).

**KV parked for decode.** A prefill pod keeps each prompt's KV until the decode pod pulls it, and
when decode is short (a mix shift, a decode cold start) that KV stays parked: a prefill pool
sized for its prompts alone fills its KV cache and stalls every prompt behind it. So the pool
keeps at least the pods that hold its KV in use at `PARKED_KV_SHARE` of their cache
(`PoolState.kv_usage`, the sum of the pods' `vllm:kv_cache_usage_perc`). The share is measured
on a mix shift, where decode is short, against a diurnal day, where every pod held is paid for
(`bench/parked_kv_share.py`; docs/results/autoscaling.md, "Prefill").

**Sized with decode, not beside it.** The P/D decider sends a prompt to its decode pod when the
prefill pool is busier than the stall it causes there (`core.policies.calibrated`), so decode
pods absorb prefill bursts. The decode autoscaler counts that work (`HeterogeneityScaler`, the
local share of `Demand`); the prefill pool is sized for *every* routed prompt, the local ones
included: subtracting them would let a short prefill pool, by pushing prompts to decode, argue
itself shorter still.

`min_headroom`: the user's floor, c >= (1 + min_headroom) a.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from statistics import NormalDist, fmean, median

from disaggpool.core.autoscaling import (
    Bounds,
    PoolState,
    ScaleDecision,
    Stabilizer,
    check_scaler,
)
from disaggpool.core.demand import Demand
from disaggpool.core.profile import CalibrationProfile

__all__ = ["PrefillScaler", "erlang_c", "miss_share", "prefill_service"]

#: The most instances above the offered load the search tries (a target no pool meets).
MAX_EXTRA = 256
#: The share of the prefill pool's KV cache that KV parked for decode may fill (module docstring).
PARKED_KV_SHARE = 0.25


def erlang_c(c: int, a: float) -> float:
    """The probability that an arrival waits in an M/M/c queue of offered load `a` (1 when
    c <= a: the queue grows)."""
    if c <= a:
        return 1.0
    # Erlang B by its recurrence (stable for large c), then C from B.
    b = 1.0
    for k in range(1, c + 1):
        b = a * b / (k + a * b)
    rho = a / c
    return b / (1.0 - rho + rho * b)


def prefill_service(profile: CalibrationProfile, prompts: Sequence[int]) -> tuple[float, float]:
    """(E[S], cs^2) of the prompts' service times on `profile`."""
    times = [profile.prefill.prompt_time(max(1, n)) for n in prompts]
    mean = fmean(times)
    second = fmean(t * t for t in times)
    scv = max(0.0, second / (mean * mean) - 1.0) if mean > 0 else 0.0
    return mean, scv


class PrefillScaler:
    """disaggpool's prefill autoscaler (module docstring)."""

    name = "disaggpool"

    def __init__(
        self,
        bounds: Bounds,
        profiles: Sequence[CalibrationProfile],
        ttft_s: float,
        target_goodput: float = 0.9,
        *,
        min_headroom: float = 0.0,
    ) -> None:
        check_scaler("prefill", profiles, target_goodput, min_headroom)
        if not ttft_s > 0:
            raise ValueError(f"ttft_s must be positive, got {ttft_s!r}")
        self.bounds = bounds
        self.profiles = list(profiles)
        self.ttft_s = ttft_s
        self.target = target_goodput
        self.z = NormalDist().inv_cdf(target_goodput)
        self.min_headroom = min_headroom
        self.stabilizer = Stabilizer(bounds)

    def _profile(self, prompts: Sequence[int]) -> CalibrationProfile:
        """The pool's median instance for these prompts (a new pod is unknown until probed)."""
        n = round(median(prompts))
        ranked = sorted(self.profiles, key=lambda p: p.prefill.prompt_time(n))
        return ranked[len(ranked) // 2]

    def wish(self, demand: Demand, waiting: int = 0, kv_usage: float = 0.0) -> tuple[int, str]:
        """Instances the routed prompts need (unclamped) and why; `waiting`: prompts queued at
        the prefill pods; `kv_usage`: the pods' KV cache in use, summed (in pods' worth)."""
        if (demand.arrival_rps <= 0 or not demand.prompts) and waiting == 0 and kv_usage <= 0:
            return 0, "no traffic in the window"
        prompts = demand.prompts or (round(demand.mean_prompt),)
        profile = self._profile(prompts)
        mean_s, scv = prefill_service(profile, prompts)
        slacks = [
            self.ttft_s - profile.prefill.prompt_time(max(1, n)) - profile.kv_transfer.time(n)
            for n in prompts
        ]
        ahead = self.bounds.startup_s + demand.window_s / 2.0
        rise = demand.significant_rise(self.z)
        rate = demand.arrival_rps + rise * ahead
        load = rate * mean_s
        burst = max(1.0, demand.dispersion)
        c = _servers(load, burst + scv, mean_s, slacks, 1.0 - self.target)
        backlog = waiting * mean_s / self.ttft_s
        parked = kv_usage / PARKED_KV_SHARE
        pods = max(c, (1.0 + self.min_headroom) * load, load + backlog, parked)
        n = math.ceil(pods - 1e-9)
        return n, (
            f"{demand.arrival_rps:.2f} req/s (trend {demand.rate_slope:+.3f}/s, {rise:+.3f} "
            f"significant), prefill "
            f"{1000 * mean_s:.0f} ms cs2 {scv:.2f}, dispersion {demand.dispersion:.2f}, "
            f"{waiting} waiting, KV {kv_usage:.2f} pods' worth: {load:.2f} busy -> {n}"
        )

    def decide(self, demand: Demand, pool: PoolState) -> ScaleDecision:
        wish, why = self.wish(demand, pool.waiting, pool.kv_usage)
        if wish < pool.current and not demand.bursts_known:
            return ScaleDecision(pool.current, why + "; burstiness not known yet: no scale-down")
        return ScaleDecision(self.stabilizer.apply(demand.now, wish, pool.current), why)


def miss_share(
    servers: int, load: float, variability: float, mean_s: float, slacks: Sequence[float]
) -> float:
    """The mean over `slacks` of P(wait > slack) in an M/G/c queue of `servers` and offered
    `load` (Allen-Cunneen, `variability` = ca^2 + cs^2, `mean_s` = E[S]); prompts without slack
    left out, 0 when none has any (module docstring)."""
    helped = [t for t in slacks if t > 0]
    if not helped:
        return 0.0
    decay = 2.0 * (servers - load) / (variability * mean_s)
    waits = erlang_c(servers, load)
    return fmean(waits * math.exp(-decay * t) for t in helped)


def _servers(
    load: float, variability: float, mean_s: float, slacks: Sequence[float], miss: float
) -> int:
    """The fewest servers for which `miss_share` is at most `miss`, at least one."""
    if load <= 0:
        return 0
    start = max(1, math.floor(load) + 1)
    helped = [t for t in slacks if t > 0]
    if not helped:
        return start
    for c in range(start, start + MAX_EXTRA):
        if miss_share(c, load, variability, mean_s, helped) <= miss:
            return c
    return start + MAX_EXTRA
