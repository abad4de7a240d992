"""Decode autoscaling by traffic heterogeneity: how many decode instances the recent traffic needs.

Pure: every call takes the `Demand` of `core.demand` (which carries `now`) and the pool's state;
no clock, no I/O. The simulator and the router (`sidecar.autoscale`, whose recommendation the
operator applies) run this code.

**Capacity of one instance for the current mix** (`decode_capacity`, the calibrated constants):
the largest batch B whose step time at the mean context of a decoding sequence meets the TPOT
target, fits the KV cache and `max_num_seqs`. A request then occupies a slot for its output
length times that step time, its *residence* R = E[output] * step(B). The mean context is that
of the sequences a pod holds at a random instant (`Demand.slot_context`): each request's context
over its life, prompt + output / 2, weighted by its output tokens, since a request stays as many
steps as it generates. The plain mean over requests would count a code completion's long prompt,
held 28 steps, as much as a chat's, held 211: with half the requests code it overstates the
context by 18% and understates B by about as much.

**Headroom, derived.** With arrivals at rate lambda and residence R, the number of sequences in
the pool is that of an M/G/infinity system: Poisson with mean L = lambda * R whatever the length
distribution. But a slot is sized for the *mean* context c-bar; a sequence of context c fills
c / c-bar of one. The sequences present at an instant are the requests weighted by residence, so
the load in mean-sized slots is a compound Poisson sum with mean L and variance
L * E_w[(c/c-bar)^2] = L * (1 + cv^2), cv the traffic's heterogeneity as the decode pool sees it
(`Demand.slot_cv`: the CV of context under that weighting; `core.heterogeneity`'s CV of prompt +
output per request is the same spread counted per request, not per step held). Bursty
arrivals scale the variance again by the index of dispersion D of arrival counts (1 for Poisson).
So the pool must hold

    S = L + z * sqrt(D * L * (1 + cv^2))   mean-sized slots,   z = Phi^-1(target goodput),

i.e. the target quantile of the load under a normal approximation, and the decode instances
needed are ceil(S / B). Heterogeneity and burstiness set the headroom; neither is a tuned factor.
(Sizing instead so that only 1 - target of the *load* overflows, through the normal loss
function, needs less headroom and saved more GPU-hours on smooth traffic in `sim autoscale`, but
lost 4.7 points of goodput on bursts, where load over capacity queues and delays what follows
instead of vanishing: the quantile stays.)

A new pod serves only after its cold start (vLLM loading the model, then the calibration probe),
so lambda is read one cold start ahead along the window's trend (only upwards: a falling trend is
left to the scale-down stabilisation).

Requests already queued for a decode slot (the pods' `num_requests_waiting`) are load this
steady-state picture misses, so they are added to S as slots.

**Rules** (`Stabilizer`): no scale-down before the demand window has seen a whole burst window
(the headroom depends on a burstiness not measured yet); scale up at once to the need (pods
still starting count as capacity, so a cold start is never paid twice); scale down only to the
largest need of the last stabilisation window, one pod per step: the asymmetry of a missed SLO
(now) and an idle GPU (minutes). Zero traffic gives a need of zero, clamped to `min_replicas`.

Only decode is scaled: decode instances hold every request's KV for its whole output, so they are
what bursts of long outputs exhaust; prefill pods are sized by the user (`prefill.replicas`), a
decision written in docs/operator.md. Baselines from other projects are in
`core.autoscaling_baselines`.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Sequence
from statistics import NormalDist, median

from disaggpool.core.demand import Demand
from disaggpool.core.profile import CalibrationProfile

__all__ = [
    "Bounds",
    "DecodeCapacity",
    "HeterogeneityScaler",
    "PoolState",
    "ScaleDecision",
    "Stabilizer",
    "decode_capacity",
    "slots_needed",
]


@dataclasses.dataclass(frozen=True, slots=True)
class DecodeCapacity:
    """What one decode instance sustains for a traffic mix at a TPOT target."""

    batch: int  # sequences held at once
    step_s: float  # step time at that batch
    rps: float  # requests per second (Little's law: batch / (E[output] * step))


def decode_capacity(
    profile: CalibrationProfile,
    mean_prompt: float,
    mean_output: float,
    tpot_s: float,
    *,
    context: float | None = None,
) -> DecodeCapacity:
    """The largest batch whose step at the mix's mean context meets `tpot_s` and whose KV fits;
    at least 1 (an instance too slow for the target still serves one sequence at a time).
    `context`: the mean context of a decoding sequence (`Demand.slot_context`); by default
    `mean_prompt + mean_output / 2`, every request counted alike."""
    out = max(1.0, mean_output)
    ctx = mean_prompt + out / 2.0 if context is None else context
    # Room for every sequence's final KV, half an output past its mean context: sized for the
    # mean instead (the KV a steady state holds), decode KV ran out in bursts and lost up to 5
    # points of goodput in `sim autoscale` (3 on average).
    kv = ctx + out / 2.0
    best, best_step = 1, profile.decode.step(1, ctx)
    for b in range(1, profile.max_num_seqs + 1):
        step = profile.decode.step(b, b * ctx)
        if step > tpot_s or b * kv > profile.kv_capacity_tokens:
            break
        best, best_step = b, step
    return DecodeCapacity(best, best_step, best / (out * best_step))


@dataclasses.dataclass(frozen=True, slots=True)
class Bounds:
    """Replica bounds and timing of one scaled role (validated here, named by field)."""

    min_replicas: int
    max_replicas: int
    startup_s: float = 120.0  # a new pod's cold start: engine load and calibration probe
    stabilization_s: float = 300.0  # scale down only to the largest need of this window

    def __post_init__(self) -> None:
        if self.min_replicas < 0:
            raise ValueError(f"min_replicas must be >= 0, got {self.min_replicas}")
        if self.max_replicas < max(1, self.min_replicas):
            raise ValueError(
                f"max_replicas must be >= max(1, min_replicas={self.min_replicas}), "
                f"got {self.max_replicas}"
            )
        if not self.startup_s >= 0:
            raise ValueError(f"startup_s must be >= 0, got {self.startup_s!r}")
        if not self.stabilization_s >= 0:
            raise ValueError(f"stabilization_s must be >= 0, got {self.stabilization_s!r}")

    def clamp(self, n: int) -> int:
        return max(self.min_replicas, min(self.max_replicas, n))


@dataclasses.dataclass(frozen=True, slots=True)
class PoolState:
    """The decode pool as an autoscaler sees it (scraped gauges and the router's estimates)."""

    ready: int  # serving
    starting: int  # asked for, not serving yet
    waiting: int = 0  # sum of vllm:num_requests_waiting over the ready pods
    kv_usage: float = 0.0  # sum of vllm:kv_cache_usage_perc (fractions) over the ready pods
    step_s: tuple[float, ...] = ()  # each ready pod's current step time, as its profile predicts

    @property
    def current(self) -> int:
        return self.ready + self.starting


@dataclasses.dataclass(frozen=True, slots=True)
class ScaleDecision:
    replicas: int
    reason: str


class Stabilizer:
    """Turns each tick's raw wish into a replica count: bounds, step sizes, cooldowns, and a
    scale-down that waits for the largest wish of the last `stabilization_s` (as the HPA does)."""

    def __init__(
        self,
        bounds: Bounds,
        *,
        up_step: int | None = None,
        up_every_s: float = 0.0,
        down_step: int | None = 1,
        down_every_s: float = 0.0,
    ) -> None:
        """`up_step` / `down_step`: the most pods added / removed at once (None: any number);
        `up_every_s` / `down_every_s`: the least time between two changes in that direction."""
        self.bounds = bounds
        self.up_step, self.up_every_s = up_step, up_every_s
        self.down_step, self.down_every_s = down_step, down_every_s
        self._wishes: deque[tuple[float, int]] = deque()
        self._last_up = -math.inf
        self._last_down = -math.inf

    def apply(self, now: float, wish: int, current: int) -> int:
        b = self.bounds
        wish = b.clamp(wish)
        self._wishes.append((now, wish))
        while self._wishes and self._wishes[0][0] < now - b.stabilization_s:
            self._wishes.popleft()
        if wish > current and now - self._last_up >= self.up_every_s:
            step = wish - current if self.up_step is None else min(self.up_step, wish - current)
            self._last_up = now
            return b.clamp(current + step)
        floor = max(w for _, w in self._wishes)
        if floor < current and now - self._last_down >= self.down_every_s:
            gap = current - floor
            step = gap if self.down_step is None else min(self.down_step, gap)
            self._last_down = now
            return b.clamp(current - step)
        return b.clamp(current)


def slots_needed(demand: Demand, residence_s: float, z: float, lookahead_s: float) -> float:
    """Mean-sized decode slots the traffic needs at quantile `z`, `lookahead_s` after now
    (module docstring). The window's mean rate is that of its middle, half a window ago."""
    ahead = lookahead_s + demand.window_s / 2.0
    rate = demand.arrival_rps + max(0.0, demand.rate_slope) * ahead
    load = rate * residence_s
    if load <= 0:
        return 0.0
    spread = max(1.0, demand.dispersion) * load * (1.0 + demand.slot_cv**2)
    return load + z * math.sqrt(spread)


class HeterogeneityScaler:
    """disaggpool's decode autoscaler (module docstring): capacity from the calibrated profiles,
    headroom from heterogeneity and burstiness, one cold start of look-ahead."""

    name = "disaggpool"

    def __init__(
        self,
        bounds: Bounds,
        profiles: Sequence[CalibrationProfile],
        tpot_s: float,
        target_goodput: float = 0.9,
    ) -> None:
        if not profiles:
            raise ValueError("the decode autoscaler needs at least one calibrated profile")
        if not 0.5 <= target_goodput < 1.0:
            raise ValueError(f"target_goodput must be in [0.5, 1), got {target_goodput!r}")
        self.bounds = bounds
        self.profiles = list(profiles)
        self.tpot_s = tpot_s
        self.z = NormalDist().inv_cdf(target_goodput)
        self.stabilizer = Stabilizer(bounds)

    def wish(self, demand: Demand, waiting: int = 0) -> tuple[int, str]:
        """Instances needed (unclamped) and why; `waiting`: requests queued for a decode slot."""
        if demand.arrival_rps <= 0 and waiting == 0:
            return 0, "no traffic in the window"
        caps = [
            decode_capacity(
                p, demand.mean_prompt, demand.mean_output, self.tpot_s, context=demand.slot_context
            )
            for p in self.profiles
        ]
        # A new pod's capacity is unknown until probed: plan with the pool's median instance.
        batch = median(c.batch for c in caps)
        residence = max(1.0, demand.mean_output) * median(c.step_s for c in caps)
        # A queue is load the steady-state formula does not see: it needs slots on top.
        slots = slots_needed(demand, residence, self.z, self.bounds.startup_s) + waiting
        n = math.ceil(slots / batch - 1e-9)
        return n, (
            f"{demand.arrival_rps:.2f} req/s (trend {demand.rate_slope:+.3f}/s), context "
            f"{demand.slot_context:.0f} cv {demand.slot_cv:.2f}, dispersion "
            f"{demand.dispersion:.2f}, {waiting} waiting: "
            f"{slots:.1f} slots of {batch:g} -> {n}"
        )

    def decide(self, demand: Demand, pool: PoolState) -> ScaleDecision:
        wish, why = self.wish(demand, pool.waiting)
        if wish < pool.current and not demand.bursts_known:
            # Too little history to know how bursty the traffic is: only grow until there is.
            return ScaleDecision(pool.current, why + "; burstiness not known yet: no scale-down")
        return ScaleDecision(self.stabilizer.apply(demand.now, wish, pool.current), why)
