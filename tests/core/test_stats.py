"""Tests of disaggpool.core.stats, the statistics `sim.metrics`, `sim.workload` and `loadgen`
share."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from disaggpool.core.stats import (
    bootstrap_paired_difference_interval,
    bootstrap_share_interval,
    coefficient_of_variation,
    interpolated_quantile,
    mean_or_nan,
    percentile,
)


def test_percentile_is_nearest_rank() -> None:
    values = [5.0, 1.0, 4.0, 2.0, 3.0]  # unsorted on purpose
    assert percentile(values, 0) == 1.0
    assert percentile(values, 20) == 1.0
    assert percentile(values, 21) == 2.0
    assert percentile(values, 50) == 3.0
    assert percentile(values, 99) == 5.0
    assert percentile(values, 100) == 5.0
    assert math.isnan(percentile([], 50))


def test_interpolated_quantile() -> None:
    ordered = [0.0, 10.0, 20.0]
    assert interpolated_quantile(ordered, 0.0) == 0.0
    assert interpolated_quantile(ordered, 0.25) == 5.0
    assert interpolated_quantile(ordered, 1.0) == 20.0
    assert interpolated_quantile([7.0], 0.9) == 7.0
    assert math.isnan(interpolated_quantile([], 0.5))


def test_coefficient_of_variation() -> None:
    values = [1.0, 2.0, 3.0, 6.0]
    expected = statistics.pstdev(values) / statistics.fmean(values)
    assert coefficient_of_variation(values) == pytest.approx(expected)
    assert coefficient_of_variation([2.0, 2.0]) == 0.0
    assert math.isnan(coefficient_of_variation([]))
    assert math.isnan(coefficient_of_variation([0.0, 0.0]))


def test_mean_or_nan() -> None:
    assert mean_or_nan([1.0, 2.0, 6.0]) == 3.0
    assert math.isnan(mean_or_nan([]))


def test_bootstrap_share_interval_contains_the_share_and_narrows_with_more_requests() -> None:
    few = [True] * 85 + [False] * 15
    lo, hi = bootstrap_share_interval(few, seed=1)
    assert lo < 0.85 < hi and 0.05 < hi - lo < 0.2
    many_lo, many_hi = bootstrap_share_interval(few * 16, seed=1)
    assert many_lo < 0.85 < many_hi and (many_hi - many_lo) < (hi - lo) / 3
    assert bootstrap_share_interval(few, seed=1) == (lo, hi)  # seeded: the same every run
    assert bootstrap_share_interval([True] * 10, seed=0) == (1.0, 1.0)
    assert all(math.isnan(x) for x in bootstrap_share_interval([], seed=0))


def test_paired_difference_tells_apart_what_separate_intervals_cannot() -> None:
    """Two policies on one trace: b misses 4 more requests in 100 than a, the rest the same.
    Their separate intervals overlap; the paired interval of the difference excludes 0."""
    rng = random.Random(3)
    base = [rng.random() < 0.88 for _ in range(200)]
    a = list(base)
    b = list(base)
    flipped = [i for i, x in enumerate(base) if x][:8]
    for i in flipped:  # 8 of 200 requests met by a, missed by b: a 4-point gap
        b[i] = False
    a_lo, a_hi = bootstrap_share_interval(a, seed=1)
    b_lo, b_hi = bootstrap_share_interval(b, seed=1)
    assert a_lo <= b_hi and b_lo <= a_hi  # overlapping
    lo, hi = bootstrap_paired_difference_interval(a, b, seed=1)
    assert 0 < lo <= 0.04 <= hi
    same_lo, same_hi = bootstrap_paired_difference_interval(a, a, seed=1)
    assert (same_lo, same_hi) == (0.0, 0.0)
    with pytest.raises(ValueError):
        bootstrap_paired_difference_interval(a, b[:-1], seed=1)
    assert all(math.isnan(x) for x in bootstrap_paired_difference_interval([], [], seed=0))
