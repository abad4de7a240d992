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
left to the scale-down stabilisation). The whole slope, noise included: the prefill scaler reads
only its significant part, and `core.prefill_scaling` says why decode does not.

Requests already queued for a decode slot (the pods' `num_requests_waiting`) are load this
steady-state picture misses, so they are added to S as slots. A floor on the headroom,
`min_headroom` (S >= (1 + min_headroom) L), is the user's; 0 by default, since the quantile above
already follows the spread of the work (docs/results/autoscaling.md).

**The mix, as it arrives.** E[output] is the larger of the finished requests' mean and the mean
*predicted* output of the requests routed in the window (`Demand.admitted_output`): a shift to
another class or prompt length is priced as it is routed, not once it has finished.

**Prefill kept on decode.** The P/D decider prefills some prompts on their decode pod
(`Demand.local_share`); while one prefills, that pod's batch waits, so the decode pool needs
those instance-seconds on top (`core.prefill_scaling` sizes the prefill pool with them).

**The work already admitted** (`Occupancy`). When outputs grow longer at the same rate and in
the same class, nothing at the door says so: the predictor learns only from finished requests,
and the long ones finish last. What does show, within seconds, is the pool filling: decode
sequences held and their KV rise while completions stall (at a constant rate, a rising count of
sequences *is* a longer residence, by Little's law). So the scaler also follows the sequences
held (running + waiting) and their KV over the last `OCCUPANCY_SPAN_S`, and projects them one
cold start ahead along their least-squares trend, counting only the part of the slope
significant at the target quantile (slope - z * its standard error), so the noise of a steady
pool asks for nothing. The pods that projection needs, at the batch the TPOT target allows at
the context the held sequences have now (the KV in use over the sequences running or receiving
their KV, `PoolState.deferred`) and within the pool's KV, are a second wish; the
larger one wins. A falling occupancy projects nothing: scale-down stays with the rules below.

**Rules** (`Stabilizer`): no scale-down before the demand window has seen a whole burst window
(the headroom depends on a burstiness not measured yet); scale up at once to the need (pods
still starting count as capacity, so a cold start is never paid twice); scale down only to the
largest need of the last stabilisation window, one pod per step: the asymmetry of a missed SLO
(now) and an idle GPU (minutes). Zero traffic gives a need of zero, clamped to `min_replicas`.

This module scales decode; `core.prefill_scaling` scales prefill with the same `Bounds`,
`PoolState` and `Stabilizer`. Baselines from other projects are in `core.autoscaling_baselines`.
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
    "MAX_HEADROOM",
    "OCCUPANCY_SPAN_S",
    "Bounds",
    "DecodeCapacity",
    "HeterogeneityScaler",
    "Occupancy",
    "PoolState",
    "ScaleDecision",
    "Stabilizer",
    "check_scaler",
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
    deferred: int = 0  # of those, waiting for their KV from a prefill pod (its blocks taken)
    running: int = 0  # sum of vllm:num_requests_running over the ready pods
    # Prompt tokens routed to the role's pods and not yet prefilled (prefill pools; the
    # router's books): what llm-d's token-aware prefill scaler reads.
    queued_tokens: int = 0
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
    load = _load(demand, residence_s, lookahead_s)
    if load <= 0:
        return 0.0
    spread = max(1.0, demand.dispersion) * load * (1.0 + demand.slot_cv**2)
    return load + z * math.sqrt(spread)


#: The largest `min_headroom` a scaler takes (the operator and the router's config refuse more).
MAX_HEADROOM = 10.0


def check_scaler(
    role: str, profiles: Sequence[CalibrationProfile], target_goodput: float, min_headroom: float
) -> None:
    """What either role's scaler refuses, by argument name."""
    if not profiles:
        raise ValueError(f"the {role} autoscaler needs at least one calibrated profile")
    if not 0.5 <= target_goodput < 1.0:
        raise ValueError(f"target_goodput must be in [0.5, 1), got {target_goodput!r}")
    if not 0.0 <= min_headroom <= MAX_HEADROOM:
        raise ValueError(f"min_headroom must be in [0, {MAX_HEADROOM:g}], got {min_headroom!r}")


#: How far back the decode pool's occupancy trend looks (`Occupancy`): a few ticks, so a pool
#: that starts filling is seen within seconds; long enough to tell a trend from one noisy tick.
OCCUPANCY_SPAN_S = 30.0


class Occupancy:
    """The decode sequences held and their KV over the last `span_s`, and where they head
    (module docstring, "The work already admitted")."""

    def __init__(self, span_s: float = OCCUPANCY_SPAN_S) -> None:
        self.span_s = span_s
        self._points: deque[tuple[float, float, float]] = deque()  # (now, sequences, kv tokens)

    def add(self, now: float, sequences: float, kv_tokens: float) -> None:
        self._points.append((now, sequences, kv_tokens))
        while self._points and self._points[0][0] < now - self.span_s:
            self._points.popleft()

    def ahead(self, horizon_s: float, z: float) -> tuple[float, float, float]:
        """(sequences now, sequences and KV tokens `horizon_s` ahead): the last values plus the
        part of each trend significant at `z`, if it rises."""
        if not self._points:
            return 0.0, 0.0, 0.0
        _, seqs, kv = self._points[-1]
        ts = [p[0] for p in self._points]
        per_seq = kv / seqs if seqs > 0 else 1.0
        return (
            seqs,
            seqs + _rise(ts, [p[1] for p in self._points], z, 1.0) * horizon_s,
            kv + _rise(ts, [p[2] for p in self._points], z, per_seq) * horizon_s,
        )


def _rise(ts: Sequence[float], ys: Sequence[float], z: float, unit: float) -> float:
    """The least-squares slope of `ys` over `ts` less `z` standard errors, if positive; 0 under
    three points. The error is the one of a count: each point a Poisson number of sequences
    (`unit` the tokens each carries), the M/G/infinity pool's own noise, so a steady pool asks
    for nothing and a pool that fills is seen after a tick or two (the residuals of a line
    through a kink would hide the kink itself)."""
    n = len(ts)
    if n < 3:
        return 0.0
    mt, my = sum(ts) / n, sum(ys) / n
    sxx = sum((t - mt) ** 2 for t in ts)
    if sxx <= 0:
        return 0.0
    slope = sum((t - mt) * (y - my) for t, y in zip(ts, ys, strict=True)) / sxx
    stderr = math.sqrt(max(my, unit) * unit / sxx)
    return max(0.0, slope - z * stderr)


def tpot_batch(profile: CalibrationProfile, context: float, tpot_s: float) -> int:
    """The largest batch whose step at `context` tokens per sequence meets `tpot_s` (at least
    1, at most `max_num_seqs`)."""
    best = 1
    for b in range(1, profile.max_num_seqs + 1):
        if profile.decode.step(b, b * context) > tpot_s:
            break
        best = b
    return best


class HeterogeneityScaler:
    """disaggpool's decode autoscaler (module docstring): capacity from the calibrated profiles,
    headroom from heterogeneity and burstiness, one cold start of look-ahead, and the pool's
    occupancy trend for the work already admitted."""

    name = "disaggpool"

    def __init__(
        self,
        bounds: Bounds,
        profiles: Sequence[CalibrationProfile],
        tpot_s: float,
        target_goodput: float = 0.9,
        *,
        min_headroom: float = 0.0,
    ) -> None:
        check_scaler("decode", profiles, target_goodput, min_headroom)
        self.bounds = bounds
        self.profiles = list(profiles)
        self.tpot_s = tpot_s
        self.min_headroom = min_headroom
        self.z = NormalDist().inv_cdf(target_goodput)
        self.stabilizer = Stabilizer(bounds)
        self.occupancy = Occupancy()

    def wish(self, demand: Demand, waiting: int = 0) -> tuple[int, str]:
        """Instances the traffic's rate and mix need (unclamped) and why; `waiting`: requests
        queued for a decode slot."""
        n, why, _ = self._wish(demand, waiting)
        return n, why

    def _wish(self, demand: Demand, waiting: int) -> tuple[int, str, float]:
        """`wish`, and the mean-sized slots it counted."""
        if demand.arrival_rps <= 0 and waiting == 0:
            return 0, "no traffic in the window", 0.0
        # The mix as routed, where it says the outputs are longer than those finished lately.
        out = max(demand.mean_output, demand.admitted_output)
        context = demand.slot_context + max(0.0, out - demand.mean_output) / 2.0
        caps = [
            decode_capacity(p, demand.mean_prompt, out, self.tpot_s, context=context)
            for p in self.profiles
        ]
        # A new pod's capacity is unknown until probed: plan with the pool's median instance.
        batch = median(c.batch for c in caps)
        residence = max(1.0, out) * median(c.step_s for c in caps)
        slots = slots_needed(demand, residence, self.z, self.bounds.startup_s)
        floor = (1.0 + self.min_headroom) * _load(demand, residence, self.bounds.startup_s)
        # A queue is load the steady-state formula does not see: it needs slots on top.
        slots = max(slots, floor) + waiting
        local = self._local_prefill(demand)
        n = math.ceil(slots / batch + local - 1e-9)
        why = (
            f"{demand.arrival_rps:.2f} req/s (trend {demand.rate_slope:+.3f}/s), output "
            f"{out:.0f}, context {context:.0f} cv {demand.slot_cv:.2f}, dispersion "
            f"{demand.dispersion:.2f}, {waiting} waiting: "
            f"{slots:.1f} slots of {batch:g}"
            + (f" + {local:.2f} pods prefilling locally" if local > 0 else "")
            + f" -> {n}"
        )
        return n, why, slots

    def _local_prefill(self, demand: Demand) -> float:
        """Instances' worth of time the decode pool spends prefilling the prompts the P/D
        decider kept on it: while one prefills, its whole batch waits."""
        if demand.local_share <= 0 or not demand.prompts:
            return 0.0
        profile = self.profiles[len(self.profiles) // 2]
        mean_s = sum(profile.prefill.prompt_time(n) for n in demand.prompts) / len(demand.prompts)
        return demand.local_share * demand.arrival_rps * mean_s

    def held_wish(self, demand: Demand, pool: PoolState, expected: float) -> tuple[int, str]:
        """Instances the decode sequences held will need one cold start ahead, from their
        trend (module docstring, "The work already admitted"); `expected`: the sequences the
        rate and mix account for (with their headroom)."""
        held, seqs, kv = self.occupancy.ahead(self.bounds.startup_s, self.z)
        # A pool filling up to what the mix accounts for (a start, a scale-up) is no news.
        if seqs <= held or held <= expected:
            return 0, ""
        kv_now = self.occupancy.ahead(0.0, self.z)[2]
        # The context a held sequence has now, and will have at its end: one that has run so
        # far is expected to run as long again (at a random instant a sequence is, on average,
        # halfway through), so its generated part doubles. The KV in use is that of the running
        # sequences and of those waiting for their KV (their blocks taken), not of those waiting
        # for room: per running sequence alone, a pool starting up with its first transfers in
        # flight looked three times as deep as it was, and asked for pods.
        context = kv_now / max(1, pool.running + pool.deferred)
        final = max(context, 2.0 * context - demand.mean_prompt)
        batch = median(tpot_batch(p, context, self.tpot_s) for p in self.profiles)
        kv_cap = median(p.kv_capacity_tokens for p in self.profiles)
        n = math.ceil(max(seqs / batch, kv / kv_cap, seqs * final / kv_cap) - 1e-9)
        return n, (
            f"held {held:.0f} sequences at context {context:.0f}, heading for {seqs:.0f} "
            f"({kv:.0f} KV tokens) a cold start ahead: {n}"
        )

    def decide(self, demand: Demand, pool: PoolState) -> ScaleDecision:
        kv_cap = median(p.kv_capacity_tokens for p in self.profiles)
        self.occupancy.add(demand.now, pool.running + pool.waiting, pool.kv_usage * kv_cap)
        wish, why, slots = self._wish(demand, pool.waiting)
        held, held_why = self.held_wish(demand, pool, slots)
        if held > wish:
            wish, why = held, f"{why}; {held_why}"
        if wish < pool.current and not demand.bursts_known:
            # Too little history to know how bursty the traffic is: only grow until there is.
            return ScaleDecision(pool.current, why + "; burstiness not known yet: no scale-down")
        return ScaleDecision(self.stabilizer.apply(demand.now, wish, pool.current), why)


def _load(demand: Demand, residence_s: float, lookahead_s: float) -> float:
    """Mean decode sequences `lookahead_s` from now (`slots_needed` without the headroom)."""
    ahead = lookahead_s + demand.window_s / 2.0
    return (demand.arrival_rps + max(0.0, demand.rate_slope) * ahead) * residence_s
