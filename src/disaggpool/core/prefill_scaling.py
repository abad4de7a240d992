"""Prefill autoscaling: how many prefill instances the arriving prompts need for the TTFT target.

Pure, like `core.autoscaling` (whose `Bounds`, `PoolState`, `Stabilizer` and `Demand` it shares):
the simulator and the router run it, the operator applies its recommendation.

**Capacity model, from the calibrated prefill constants.** A prompt of n tokens takes
S(n) = p0 + p1 n + p2 n^2 seconds on a prefill instance (`PrefillModel.prompt_time`). Prompts are
known exactly as they are routed, so the service times of the last routed prompts
(`Demand.prompts`) give E[S] and its squared coefficient of variation cs^2 without waiting for
anything to finish: a shift to longer prompts is priced on its first requests. With arrivals at
rate lambda (read one cold start ahead along the window's trend, as for decode) the pool offers
a = lambda E[S] busy instances. The router spreads prompts over the pool as one queue does over c
servers, so the pool is an M/G/c queue; by the Allen-Cunneen approximation a prompt waits longer
than t with probability

    P(W > t) ~= C(c, a) exp(-2 (c - a) t / ((1 + cs^2) E[S])),

C the Erlang C probability that it waits at all. The TTFT target leaves a prompt at the target
quantile of S the slack t = TTFT - S_q - its KV transfer; the pool needs the smallest c with
P(W > t) <= 1 - target. The spread of the prompts (cs^2) widens the headroom, as the spread of
contexts does for decode; burstiness (the index of dispersion D of arrival counts) scales the
offered load's variance, so it is taken as a = D-inflated: the headroom over a is multiplied by
sqrt(D). Prompts already queued at the prefill pods are work the steady picture misses: they need
`waiting * E[S] / TTFT` instances on top, to be served within one target.

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
from statistics import fmean, median

from disaggpool.core.autoscaling import (
    Bounds,
    PoolState,
    ScaleDecision,
    Stabilizer,
    check_scaler,
)
from disaggpool.core.demand import Demand
from disaggpool.core.profile import CalibrationProfile

__all__ = ["PrefillScaler", "erlang_c", "prefill_service"]

#: The most instances above the offered load the search tries (a target no pool meets).
MAX_EXTRA = 256


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


def prefill_service(
    profile: CalibrationProfile, prompts: Sequence[int], quantile: float
) -> tuple[float, float, float]:
    """(E[S], cs^2, S at `quantile`) of the prompts' service times on `profile`."""
    times = sorted(profile.prefill.prompt_time(max(1, n)) for n in prompts)
    mean = fmean(times)
    second = fmean(t * t for t in times)
    scv = max(0.0, second / (mean * mean) - 1.0) if mean > 0 else 0.0
    q = times[min(len(times) - 1, int(quantile * len(times)))]
    return mean, scv, q


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
        self.min_headroom = min_headroom
        self.stabilizer = Stabilizer(bounds)

    def _profile(self, prompts: Sequence[int]) -> CalibrationProfile:
        """The pool's median instance for these prompts (a new pod is unknown until probed)."""
        n = round(median(prompts))
        ranked = sorted(self.profiles, key=lambda p: p.prefill.prompt_time(n))
        return ranked[len(ranked) // 2]

    def wish(self, demand: Demand, waiting: int = 0) -> tuple[int, str]:
        """Instances the routed prompts need (unclamped) and why; `waiting`: prompts queued at
        the prefill pods."""
        if (demand.arrival_rps <= 0 or not demand.prompts) and waiting == 0:
            return 0, "no traffic in the window"
        prompts = demand.prompts or (round(demand.mean_prompt),)
        profile = self._profile(prompts)
        mean_s, scv, s_q = prefill_service(profile, prompts, self.target)
        transfer = profile.kv_transfer.time(round(median(prompts)))
        ahead = self.bounds.startup_s + demand.window_s / 2.0
        rate = demand.arrival_rps + max(0.0, demand.rate_slope) * ahead
        load = rate * mean_s
        # A slack the tail cannot have (prompts longer than the target) still sizes the pool.
        slack = max(mean_s, self.ttft_s - s_q - transfer)
        c = _servers(load, scv, mean_s, slack, 1.0 - self.target)
        # Burstiness widens the headroom over the offered load as it widens decode's.
        pods = load + (c - load) * math.sqrt(max(1.0, demand.dispersion))
        pods = max(pods, (1.0 + self.min_headroom) * load) + waiting * mean_s / self.ttft_s
        n = math.ceil(pods - 1e-9)
        return n, (
            f"{demand.arrival_rps:.2f} req/s (trend {demand.rate_slope:+.3f}/s), prefill "
            f"{1000 * mean_s:.0f} ms cs2 {scv:.2f} (q {1000 * s_q:.0f} ms), dispersion "
            f"{demand.dispersion:.2f}, {waiting} waiting: {load:.2f} busy -> {n}"
        )

    def decide(self, demand: Demand, pool: PoolState) -> ScaleDecision:
        wish, why = self.wish(demand, pool.waiting)
        if wish < pool.current and not demand.bursts_known:
            return ScaleDecision(pool.current, why + "; burstiness not known yet: no scale-down")
        return ScaleDecision(self.stabilizer.apply(demand.now, wish, pool.current), why)


def _servers(load: float, scv: float, mean_s: float, slack_s: float, miss: float) -> int:
    """The fewest servers for which P(wait > slack_s) <= miss (Allen-Cunneen), at least one."""
    if load <= 0:
        return 0
    start = max(1, math.floor(load) + 1)
    for c in range(start, start + MAX_EXTRA):
        tail = erlang_c(c, load) * math.exp(-2.0 * (c - load) * slack_s / ((1 + scv) * mean_s))
        if tail <= miss:
            return c
    return start + MAX_EXTRA
