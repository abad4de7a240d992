"""Small descriptive statistics shared by the simulator, the load generator and the reports.

Pure functions of a sequence of numbers, no I/O. Two percentile definitions live here on purpose:
`percentile` is nearest-rank (every result is one of the observations, so latency reports are
exact and deterministic: `sim.metrics`, `loadgen`), `interpolated_quantile` interpolates linearly
between order statistics (trace summaries: `sim.workload.trace_stats`). Undefined values (no
observations) are NaN rather than an exception, so a summary of an empty run still renders.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence

__all__ = [
    "bootstrap_paired_difference_interval",
    "bootstrap_share_interval",
    "coefficient_of_variation",
    "interpolated_quantile",
    "mean_or_nan",
    "percentile",
]


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of `values`; NaN for an empty sequence."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def interpolated_quantile(ordered: Sequence[float], q: float) -> float:
    """Quantile `q` (in [0, 1]) of already sorted values, interpolating linearly; NaN if empty."""
    if not ordered:
        return math.nan
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def coefficient_of_variation(values: Sequence[float]) -> float:
    """Population standard deviation over mean; NaN when empty or the mean is not positive."""
    if not values:
        return math.nan
    mean = math.fsum(values) / len(values)
    if mean <= 0:
        return math.nan
    variance = math.fsum((v - mean) ** 2 for v in values) / len(values)
    return math.sqrt(variance) / mean


def mean_or_nan(values: Sequence[float]) -> float:
    """Arithmetic mean; NaN for an empty sequence (where `statistics.fmean` would raise)."""
    return statistics.fmean(values) if values else math.nan


def bootstrap_share_interval(
    flags: Sequence[bool], seed: int, resamples: int = 2000
) -> tuple[float, float]:
    """The 95% percentile-bootstrap interval of the share of true `flags` (a goodput over its
    requests), resampling them `resamples` times from a generator seeded with `seed`."""
    return _bootstrap_mean_interval([int(f) for f in flags], seed, resamples)


def bootstrap_paired_difference_interval(
    a: Sequence[bool], b: Sequence[bool], seed: int, resamples: int = 2000
) -> tuple[float, float]:
    """The 95% percentile-bootstrap interval of share(a) - share(b) where ``a[i]`` and ``b[i]``
    are the same item under two treatments (one request of one trace under two policies).

    Items are resampled in pairs, so what both runs share (the same bursts, the same long
    prompts) cancels: two policies replayed on one trace are told apart by an interval that
    excludes 0, which two overlapping separate intervals cannot say."""
    if len(a) != len(b):
        raise ValueError(f"paired flags of unequal length: {len(a)} and {len(b)}")
    diff = [int(x) - int(y) for x, y in zip(a, b, strict=True)]
    return _bootstrap_mean_interval(diff, seed, resamples)


def _bootstrap_mean_interval(
    values: Sequence[int], seed: int, resamples: int
) -> tuple[float, float]:
    """The 95% percentile-bootstrap interval of the mean of `values` (NaNs when empty)."""
    n = len(values)
    if not n:
        return (math.nan, math.nan)
    rng = random.Random(seed)
    boots = sorted(sum(values[rng.randrange(n)] for _ in range(n)) / n for _ in range(resamples))
    return boots[int(0.025 * resamples)], boots[int(0.975 * resamples) - 1]
