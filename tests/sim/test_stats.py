"""Tests of disaggpool.core.stats, the statistics `sim.metrics`, `sim.workload` and `loadgen`
share."""

from __future__ import annotations

import math
import statistics

import pytest

from disaggpool.core.stats import (
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
