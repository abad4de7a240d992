"""Workload generation: synthetic arrival processes, synthetic lengths and trace transforms.

Everything here is pure: no file I/O, and all randomness comes from the `random.Random` the
caller passes in, so a scenario with a fixed seed always yields the same workload. Arrival
processes return sorted arrival times in seconds with the first arrival at 0; transforms take and
return lists of `disaggpool.formats.traces.TraceRequest` sorted by arrival.

Callers: the scenario builder and the experiment sweeps (rate sweeps use `rescale` on real traces
or the synthetic processes; the heterogeneity sweep uses `lognormal_lengths` + `with_arrivals`).
Invalid arguments raise `ValueError`; user-facing validation with file/field names happens in the
scenario loader before these functions are called.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from collections.abc import Iterable, Sequence

from disaggpool.core.stats import coefficient_of_variation, interpolated_quantile
from disaggpool.formats.traces import TraceRequest

__all__ = [
    "clip_lengths",
    "gamma_arrivals",
    "lognormal_lengths",
    "merge",
    "onoff_arrivals",
    "poisson_arrivals",
    "rescale",
    "trace_stats",
    "window",
    "with_arrivals",
]


# --- arrival processes -------------------------------------------------------------------------


def poisson_arrivals(rate: float, n: int, rng: random.Random) -> list[float]:
    """`n` arrivals of a Poisson process with `rate` requests/s (exponential gaps), first at 0."""
    _check_positive("rate", rate)
    _check_count(n)
    return _from_gaps(rng.expovariate(rate) for _ in range(n - 1)) if n else []


def gamma_arrivals(rate: float, cv: float, n: int, rng: random.Random) -> list[float]:
    """`n` arrivals of a Gamma renewal process: mean gap 1/`rate`, gap CV `cv`; first at 0.

    A Gamma gap with shape k = 1/cv² and scale cv²/rate has mean 1/rate and CV cv; cv = 1 is the
    exponential (Poisson) case, cv > 1 is burstier, cv = 0 is a perfectly regular process.
    """
    _check_positive("rate", rate)
    _check_non_negative("cv", cv)
    _check_count(n)
    if n == 0:
        return []
    if cv == 0:
        return [i / rate for i in range(n)]
    shape = 1.0 / (cv * cv)
    scale = cv * cv / rate
    return _from_gaps(rng.gammavariate(shape, scale) for _ in range(n - 1))


def onoff_arrivals(
    rate: float,
    n: int,
    rng: random.Random,
    *,
    on_s: float,
    off_s: float,
    burst_factor: float,
) -> list[float]:
    """`n` arrivals of a two-state Markov-modulated Poisson process with long-run mean `rate`.

    The process alternates between "on" and "off" periods whose lengths are exponential with means
    `on_s` and `off_s` (it starts in the stationary state mix). Within a period arrivals are
    Poisson; the on-rate is `burst_factor` times the off-rate, and both are chosen so that the
    time-averaged rate equals `rate`::

        rate_off = rate * (on_s + off_s) / (burst_factor * on_s + off_s)
        rate_on  = burst_factor * rate_off

    since (on_s * rate_on + off_s * rate_off) / (on_s + off_s) = rate. `burst_factor` = 1 is a
    plain Poisson process; `math.inf` silences the off periods (rate_on = rate * (on_s + off_s) /
    on_s). Arrival times are shifted so that the first is at 0.
    """
    _check_positive("rate", rate)
    _check_count(n)
    _check_positive("on_s", on_s)
    _check_positive("off_s", off_s)
    if math.isnan(burst_factor) or burst_factor < 1:
        raise ValueError(f"burst_factor must be >= 1 (math.inf allowed), got {burst_factor}")
    rate_on, rate_off = _onoff_rates(rate, on_s, off_s, burst_factor)
    times = _onoff_times(n, rng, (rate_off, rate_on), (off_s, on_s))
    first = times[0] if times else 0.0
    return [t - first for t in times]


def _onoff_rates(rate: float, on_s: float, off_s: float, burst: float) -> tuple[float, float]:
    """(rate_on, rate_off) with rate_on = burst * rate_off and time-averaged rate `rate`."""
    if math.isinf(burst):
        return rate * (on_s + off_s) / on_s, 0.0
    rate_off = rate * (on_s + off_s) / (burst * on_s + off_s)
    return burst * rate_off, rate_off


def _onoff_times(
    n: int, rng: random.Random, rates: tuple[float, float], means: tuple[float, float]
) -> list[float]:
    """Simulate the modulated process; index 0 is the off state, index 1 the on state."""
    times: list[float] = []
    state = 1 if rng.random() < means[1] / (means[0] + means[1]) else 0
    now = 0.0
    left = rng.expovariate(1.0 / means[state])  # time left in the current period
    while len(times) < n:
        rate = rates[state]
        gap = rng.expovariate(rate) if rate > 0 else math.inf
        if gap <= left:
            now += gap
            left -= gap
            times.append(now)
        else:
            # Exponential gaps are memoryless, so the unfinished gap can be dropped and redrawn
            # at the new state's rate without biasing the process.
            now += left
            state = 1 - state
            left = rng.expovariate(1.0 / means[state])
    return times


def _from_gaps(gaps: Iterable[float]) -> list[float]:
    """Arrival times 0, g1, g1+g2, ... from the inter-arrival gaps."""
    return list(itertools.accumulate(gaps, initial=0.0))


# --- synthetic lengths -------------------------------------------------------------------------


def lognormal_lengths(
    n: int,
    rng: random.Random,
    *,
    prompt_mean: float,
    output_mean: float,
    sigma: float,
    slo_classes: Sequence[tuple[str, float]] = (),
) -> list[TraceRequest]:
    """`n` requests (all arriving at 0) with log-normal prompt and output lengths.

    Each length is exp(N(mu, sigma²)) with mu = ln(mean) - sigma²/2, so its mean is the given
    mean and `sigma` is the spread alone (sigma = 0 gives constant lengths); values are rounded
    to integers >= 1. The class of each request is drawn from `slo_classes`, (name, weight) pairs;
    with none the class is "". Pair the result with arrival times via `with_arrivals`.
    """
    _check_count(n)
    _check_at_least_one("prompt_mean", prompt_mean)
    _check_at_least_one("output_mean", output_mean)
    _check_non_negative("sigma", sigma)
    names, cum_weights = _class_table(slo_classes)
    out: list[TraceRequest] = []
    for _ in range(n):
        prompt = _lognormal_int(rng, prompt_mean, sigma)
        output = _lognormal_int(rng, output_mean, sigma)
        slo_class = rng.choices(names, cum_weights=cum_weights)[0] if names else ""
        out.append(TraceRequest(0.0, prompt, output, slo_class))
    return out


def _lognormal_int(rng: random.Random, mean: float, sigma: float) -> int:
    """One log-normal draw with the given mean, rounded to an integer >= 1."""
    if sigma == 0:
        return max(1, round(mean))
    value = rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)
    return max(1, round(value))


def _class_table(slo_classes: Sequence[tuple[str, float]]) -> tuple[list[str], list[float]]:
    """Class names and cumulative weights, validated."""
    names = [name for name, _ in slo_classes]
    weights = [float(weight) for _, weight in slo_classes]
    if any(not math.isfinite(w) or w < 0 for w in weights):
        raise ValueError(f"slo_classes weights must be finite and >= 0, got {weights}")
    if names and sum(weights) <= 0:
        raise ValueError("slo_classes weights must not all be 0")
    return names, list(itertools.accumulate(weights))


# --- trace transforms --------------------------------------------------------------------------


def rescale(requests: Sequence[TraceRequest], rate: float) -> list[TraceRequest]:
    """Stretch or compress time so the mean rate (n-1)/(last-first) is `rate`; first at 0.

    Every gap is multiplied by the same factor, so the burstiness shape (gap CV, idle periods,
    ordering) is preserved. A single request is just moved to 0.
    """
    _check_positive("rate", rate)
    if not requests:
        return []
    first = min(r.arrival_s for r in requests)
    span = max(r.arrival_s for r in requests) - first
    if len(requests) == 1:
        return [dataclasses.replace(requests[0], arrival_s=0.0)]
    if span <= 0:
        raise ValueError("cannot rescale a trace whose arrivals all coincide")
    factor = (len(requests) - 1) / (span * rate)
    return [dataclasses.replace(r, arrival_s=(r.arrival_s - first) * factor) for r in requests]


def window(
    requests: Sequence[TraceRequest], start_s: float, duration_s: float
) -> list[TraceRequest]:
    """Requests arriving in [start_s, start_s + duration_s), with times relative to `start_s`.

    Times are re-based to the window start (not to the first arrival in it), so an idle stretch
    at the beginning of the window is kept and the window still spans `duration_s`.
    """
    if not math.isfinite(start_s):
        raise ValueError(f"start_s must be finite, got {start_s}")
    _check_positive("duration_s", duration_s, allow_inf=True)
    end_s = start_s + duration_s
    return [
        dataclasses.replace(r, arrival_s=r.arrival_s - start_s)
        for r in requests
        if start_s <= r.arrival_s < end_s
    ]


def merge(*traces: Sequence[TraceRequest]) -> list[TraceRequest]:
    """All requests of `traces` ordered by arrival; ties keep argument order, then list order."""
    # sorted() is stable, so equal arrivals stay in the order they were chained in.
    return sorted(itertools.chain.from_iterable(traces), key=lambda r: r.arrival_s)


def clip_lengths(
    requests: Sequence[TraceRequest], max_prompt: int, max_output: int
) -> list[TraceRequest]:
    """Clamp prompt lengths to `max_prompt` and output lengths to `max_output` (a clipped prompt
    keeps the prefix blocks that cover its first `max_prompt` tokens).

    Real traces contain prompts longer than a small model's context window; choosing
    max_prompt + max_output <= max_model_len keeps every request admissible by the engine (vLLM
    rejects a request whose prompt plus requested output exceeds max_model_len).
    """
    _check_at_least_one("max_prompt", max_prompt)
    _check_at_least_one("max_output", max_output)
    return [
        r
        if r.prompt_tokens <= max_prompt and r.output_tokens <= max_output
        else dataclasses.replace(
            r,
            prompt_tokens=min(r.prompt_tokens, max_prompt),
            output_tokens=min(r.output_tokens, max_output),
            blocks=r.blocks[: -(-max_prompt // r.block_tokens)] if r.blocks else (),
        )
        for r in requests
    ]


def with_arrivals(lengths: Sequence[TraceRequest], arrivals: Sequence[float]) -> list[TraceRequest]:
    """Request i of `lengths` at time `arrivals[i]`; arrivals must be finite, >= 0, sorted."""
    if len(lengths) != len(arrivals):
        raise ValueError(f"{len(lengths)} lengths but {len(arrivals)} arrivals")
    previous = 0.0
    for index, t in enumerate(arrivals):
        if not math.isfinite(t) or t < previous:
            raise ValueError(f"arrivals must be finite, >= 0 and non-decreasing (index {index})")
        previous = t
    return [dataclasses.replace(r, arrival_s=t) for r, t in zip(lengths, arrivals, strict=True)]


# --- statistics --------------------------------------------------------------------------------


def trace_stats(requests: Sequence[TraceRequest]) -> dict[str, float]:
    """Summary of a trace (sorted by arrival); undefined values (e.g. rate of 1 request) are NaN.

    Keys: n, duration_s (last - first arrival), rate ((n-1)/duration_s), interarrival_cv
    (population std / mean of the gaps), and prompt_/output_ mean, p50, p90, p99 (percentiles
    by linear interpolation between order statistics).
    """
    arrivals = [r.arrival_s for r in requests]
    stats: dict[str, float] = {"n": len(requests)}
    duration = arrivals[-1] - arrivals[0] if arrivals else math.nan
    stats["duration_s"] = duration
    stats["rate"] = (len(arrivals) - 1) / duration if duration > 0 else math.nan
    stats["interarrival_cv"] = coefficient_of_variation(
        [b - a for a, b in itertools.pairwise(arrivals)]
    )
    for name, values in (
        ("prompt", [r.prompt_tokens for r in requests]),
        ("output", [r.output_tokens for r in requests]),
    ):
        ordered = sorted(values)
        stats[f"{name}_mean"] = math.fsum(ordered) / len(ordered) if ordered else math.nan
        for q in (50, 90, 99):
            stats[f"{name}_p{q}"] = interpolated_quantile(ordered, q / 100)
    return stats


# --- argument checks ---------------------------------------------------------------------------


def _check_positive(name: str, value: float, *, allow_inf: bool = False) -> None:
    if math.isnan(value) or value <= 0 or (math.isinf(value) and not allow_inf):
        kind = "a number" if allow_inf else "a finite number"
        raise ValueError(f"{name} must be {kind} > 0, got {value}")


def _check_non_negative(name: str, value: float) -> None:
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value}")


def _check_at_least_one(name: str, value: float) -> None:
    if not math.isfinite(value) or value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def _check_count(n: int) -> None:
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
