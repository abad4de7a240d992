"""Traffic heterogeneity: how unequal the requests of the recent past are.

Definition (exported by the sidecar as `disaggpool_traffic_heterogeneity`; the decode autoscaler
sizes its headroom by the spread of the contexts a decode pod holds, each request weighted by how
long it stays, `core.demand`'s `slot_cv`): over a sliding window of the last `window` finished
requests, the coefficient of variation (standard deviation / mean) of each request's *token work*,
prompt tokens plus output tokens. 0 means identical requests, where every policy that spreads evenly
is as good as any other; the calibrated router's gain grows with it (`sim paper`'s heterogeneity
sweep, docs/results/routing-quality.md). Token work rather than predicted seconds keeps the signal
independent of any instance's calibration, so it means the same before and after a re-probe.

Pure: the caller feeds observations; no clock, O(1) per observation (ring buffer + running sums,
re-summed every `window` observations so floating-point drift cannot accumulate).
"""

from __future__ import annotations

import math

__all__ = ["SlidingSpread"]


class SlidingSpread:
    """Mean and coefficient of variation of the last `window` values."""

    def __init__(self, window: int = 512) -> None:
        if window < 2:
            raise ValueError("window must be at least 2")
        self.window = window
        self._values: list[float] = []
        self._next = 0
        self._sum = 0.0
        self._sq = 0.0
        self._since_resum = 0

    def add(self, value: float) -> None:
        if len(self._values) < self.window:
            self._values.append(value)
        else:
            old = self._values[self._next]
            self._sum -= old
            self._sq -= old * old
            self._values[self._next] = value
            self._next = (self._next + 1) % self.window
        self._sum += value
        self._sq += value * value
        self._since_resum += 1
        if self._since_resum >= self.window:
            self._sum = math.fsum(self._values)
            self._sq = math.fsum(v * v for v in self._values)
            self._since_resum = 0

    def __len__(self) -> int:
        return len(self._values)

    @property
    def mean(self) -> float:
        return self._sum / len(self._values) if self._values else 0.0

    @property
    def cv(self) -> float:
        """Population CV; 0 with fewer than two values or a zero mean."""
        n = len(self._values)
        if n < 2 or self._sum <= 0:
            return 0.0
        mean = self._sum / n
        var = max(0.0, self._sq / n - mean * mean)
        return math.sqrt(var) / mean
