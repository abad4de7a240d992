"""The traffic of the recent past, as an autoscaler reads it: rate, trend, burstiness, mix, SLOs.

A `DemandWindow` is fed what a router sees (each arrival, each finished request with its
latencies against its class's targets) and summarises the last `window_s` seconds as a `Demand`:

* **rate** and its **trend**: arrivals per second, and the least-squares slope of the per-bin
  rate over the window (req/s per s), so a scaler can look one cold start ahead, with the
  slope's standard error were the counts Poisson: a minute of steady traffic has a slope too,
  and `Demand.significant_rise` keeps only the part of it that noise does not explain;
* **burstiness**: the index of dispersion of the per-bin arrival counts around their trend
  (residual variance / mean; 1 for Poisson arrivals) over the longer `burst_window_s`, so
  bursts that come every few minutes are remembered between them. The trend is a centred moving
  average `trend_s` wide, about as fast as a scaler can follow (a cold start and a window): what
  moves slower is followed by scaling, what moves faster must be absorbed by headroom. With bins
  near a decode request's residence time R, D = 1 + R Var(rate) / mean rate, exactly the factor
  by which a modulated rate widens the number of sequences in an M/G/infinity pool
  (`core.autoscaling`);
* **mix**: mean prompt and output tokens of the last `mix_requests` finished requests (however
  old: a pool that finishes nothing for a while still knows its mix), and the traffic
  heterogeneity of `core.heterogeneity` (the coefficient of variation of prompt + output tokens);
* **what a decode slot holds**: the same requests seen from a decode instance, where a request
  stays for as many steps as it has output tokens and holds its context (prompt plus the tokens
  generated so far) meanwhile. Its mean context over its life is prompt + output / 2; weighted
  by output tokens (how long it is there), the mean and CV of that context are what the
  sequences found in a decode pool at a random instant hold. The two views differ where output
  and prompt lengths do not go together: a code completion's 2,000-token prompt is in the
  request mean as much as a chat's 1,100, but it stays 28 steps against 211;
* **SLO attainment**: the P90 of TTFT / target and TPOT / target over the requests finished in
  the window;
* **the work arriving**, known as each request is routed (`admitted`), not when it finishes:
  its exact prompt, its predicted output and whether the P/D decider prefilled it on its decode
  pod. The mean predicted output of the requests routed in the window follows a shift of the
  mix within seconds wherever the predictor tells the new requests apart (another SLO class,
  another prompt length), where the finished requests' mean waits for them to finish; the
  prompts of the last `mix_requests` routed requests size the prefill pool
  (`core.prefill_scaling`), and the share prefilled locally is prefill work the decode pool
  takes off it.

Pure: the caller passes `now` with every call; O(1) amortised per observation.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Sequence

from disaggpool.core.stats import coefficient_of_variation, percentile

__all__ = ["BURST_WINDOW_DEFAULT_S", "BURST_WINDOW_MIN_S", "Demand", "DemandWindow"]


@dataclasses.dataclass(frozen=True, slots=True)
class Demand:
    """The last `window_s` seconds of traffic (see the module docstring)."""

    now: float
    window_s: float
    arrival_rps: float
    rate_slope: float  # req/s per second
    dispersion: float  # index of dispersion of per-bin arrival counts; 1 = Poisson
    bursts_known: bool  # the burst window is full: `dispersion` has seen all it should
    mean_prompt: float
    mean_output: float
    work_cv: float  # heterogeneity: CV of prompt + output tokens per finished request
    slot_context: float  # mean context of a decoding sequence, weighted by its output tokens
    slot_cv: float  # CV of that context under the same weighting
    ttft_ratio_p90: float  # P90 of TTFT / the class's TTFT target; 0 with nothing finished
    tpot_ratio_p90: float
    finished: int
    # The work arriving (`DemandWindow.admitted`): requests routed in the window.
    admitted_output: float = 0.0  # their mean predicted output tokens; 0 with none
    local_share: float = 0.0  # the share of them the decode pool prefilled
    prompts: tuple[int, ...] = ()  # prompt tokens of the last `mix_requests` routed requests
    # The standard error of `rate_slope` were the per-bin counts Poisson (0: taken as exact).
    rate_slope_se: float = 0.0

    def significant_rise(self, z: float) -> float:
        """The part of the rate's upward trend that is significant at `z`: the slope less `z`
        standard errors, the Poisson error widened by the burstiness (counts vary `dispersion`
        times as much), or 0. A window of steady traffic has a slope of about one standard
        error either way (0.02 req/s per s at 6 req/s over 60 s in 5 s bins): read 90 s ahead,
        that alone would be a quarter more traffic."""
        se = self.rate_slope_se * math.sqrt(max(1.0, self.dispersion))
        return max(0.0, self.rate_slope - z * se)


@dataclasses.dataclass(frozen=True, slots=True)
class _Routed:
    at: float
    predicted_output: float
    local: bool


@dataclasses.dataclass(frozen=True, slots=True)
class _Done:
    at: float
    prompt: int
    output: int
    ttft_ratio: float
    tpot_ratio: float


#: The burst window's default, and its least: it must cover the rate's trend (`trend_s`, 120 s)
#: and window (60 s). Until a window has seen this much traffic, burstiness is not known.
BURST_WINDOW_DEFAULT_S = 600
BURST_WINDOW_MIN_S = 120


class DemandWindow:
    """A sliding window over arrivals and completions (see the module docstring)."""

    def __init__(
        self,
        window_s: float = 60.0,
        bin_s: float = 5.0,
        burst_window_s: float = BURST_WINDOW_DEFAULT_S,
        trend_s: float = 120.0,
        mix_requests: int = 512,
    ) -> None:
        if not (bin_s > 0 and window_s >= 2 * bin_s and burst_window_s >= max(window_s, trend_s)):
            raise ValueError(
                "need bin_s > 0, window_s >= 2 * bin_s and burst_window_s >= window_s, trend_s: "
                f"bin_s={bin_s!r}, window_s={window_s!r}, burst_window_s={burst_window_s!r}, "
                f"trend_s={trend_s!r}"
            )
        if mix_requests < 2:
            raise ValueError(f"mix_requests must be at least 2, got {mix_requests!r}")
        self.window_s = window_s
        self.bin_s = bin_s
        self.burst_window_s = burst_window_s
        self._trend_bins = max(1, round(trend_s / bin_s))
        self._arrivals: deque[float] = deque()
        self._done: deque[_Done] = deque()
        self._mix: deque[_Done] = deque(maxlen=mix_requests)
        self._routed: deque[_Routed] = deque()
        self._prompts: deque[int] = deque(maxlen=mix_requests)
        self._started: float | None = None  # first observation: a window not yet full is shorter

    def arrived(self, now: float) -> None:
        self._note(now)
        self._arrivals.append(now)

    def admitted(
        self, now: float, prompt: int, predicted_output: float, *, local: bool = False
    ) -> None:
        """A request was routed (after `arrived`): its prompt, its predicted output, and whether
        its decode pod prefills it (`local`)."""
        self._note(now)
        self._routed.append(_Routed(now, max(0.0, predicted_output), local))
        self._prompts.append(max(0, prompt))

    def finished(
        self, now: float, prompt: int, output: int, ttft_ratio: float, tpot_ratio: float
    ) -> None:
        """A request finished; `*_ratio`: its latency over its class's target (1 = on target)."""
        self._note(now)
        done = _Done(now, prompt, output, ttft_ratio, tpot_ratio)
        self._done.append(done)
        self._mix.append(done)

    def _note(self, now: float) -> None:
        if self._started is None:
            self._started = now

    def _evict(self, now: float) -> None:
        while self._arrivals and self._arrivals[0] < now - self.burst_window_s:
            self._arrivals.popleft()
        while self._done and self._done[0].at < now - self.window_s:
            self._done.popleft()
        while self._routed and self._routed[0].at < now - self.window_s:
            self._routed.popleft()

    def _counts(self, now: float, span_s: float) -> list[int]:
        """Arrivals per bin over the last `span_s` (whole bins, at least one)."""
        n_bins = max(1, int(span_s / self.bin_s))
        counts = [0] * n_bins
        start = now - n_bins * self.bin_s
        for t in self._arrivals:
            if t >= start:
                counts[min(n_bins - 1, int((t - start) / self.bin_s))] += 1
        return counts

    def _span(self, now: float, window_s: float) -> float:
        """The window, or less while the observations are younger than it (0 before any)."""
        return 0.0 if self._started is None else min(window_s, now - self._started)

    def demand(self, now: float) -> Demand:
        self._evict(now)
        span = self._span(now, self.window_s)
        counts = self._counts(now, span)
        span = len(counts) * self.bin_s if span >= self.bin_s else max(span, 1e-9)
        done = list(self._done)
        mix = list(self._mix)
        work = [float(d.prompt + d.output) for d in mix]
        slot_context, slot_cv = _slot_context(mix)
        routed = list(self._routed)
        slope, slope_se = _slope(counts, self.bin_s)
        return Demand(
            now=now,
            window_s=span,
            arrival_rps=sum(counts) / span,
            rate_slope=slope,
            rate_slope_se=slope_se,
            dispersion=_dispersion(
                self._counts(now, self._span(now, self.burst_window_s)), self._trend_bins
            ),
            bursts_known=self._span(now, self.burst_window_s) >= self.burst_window_s,
            mean_prompt=_mean([d.prompt for d in mix]),
            mean_output=_mean([d.output for d in mix]),
            work_cv=0.0 if len(work) < 2 else _finite(coefficient_of_variation(work)),
            slot_context=slot_context,
            slot_cv=slot_cv,
            ttft_ratio_p90=percentile([d.ttft_ratio for d in done], 90) if done else 0.0,
            tpot_ratio_p90=percentile([d.tpot_ratio for d in done], 90) if done else 0.0,
            finished=len(done),
            admitted_output=_mean([r.predicted_output for r in routed]),
            local_share=_mean([int(r.local) for r in routed]),
            prompts=tuple(self._prompts),
        )


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _slot_context(mix: list[_Done]) -> tuple[float, float]:
    """Mean and CV of a decoding sequence's context (prompt + output / 2), each request weighted
    by its output tokens (at least 1: a request that generated nothing still took a step)."""
    if not mix:
        return 0.0, 0.0
    weights = [max(1, d.output) for d in mix]
    contexts = [d.prompt + d.output / 2.0 for d in mix]
    total = sum(weights)
    mean = sum(w * c for w, c in zip(weights, contexts, strict=True)) / total
    if len(mix) < 2 or mean <= 0:
        return mean, 0.0
    var = sum(w * (c - mean) ** 2 for w, c in zip(weights, contexts, strict=True)) / total
    return mean, _finite(math.sqrt(var) / mean)


def _finite(x: float) -> float:
    return x if math.isfinite(x) else 0.0


def _dispersion(counts: list[int], trend_bins: int) -> float:
    """Variance of the bin counts around their centred moving average of `trend_bins` bins,
    over their mean (1 for Poisson); 1 when there is too little to say (fewer than two trend
    widths). The trend is taken out so that a daily swing is not mistaken for bursts."""
    n = len(counts)
    mean = sum(counts) / n
    if n < 2 * trend_bins or mean <= 0 or trend_bins < 2:
        return 1.0
    prefix = [0]
    for c in counts:
        prefix.append(prefix[-1] + c)
    half = trend_bins // 2
    squares = 0.0
    for i, c in enumerate(counts):
        lo, hi = max(0, i - half), min(n, i + half + 1)
        squares += (c - (prefix[hi] - prefix[lo]) / (hi - lo)) ** 2
    # A moving average of k bins absorbs 1/k of each bin's own noise: correct for it.
    return squares / n / (1.0 - 1.0 / trend_bins) / mean


def _slope(counts: list[int], bin_s: float) -> tuple[float, float]:
    """Least-squares slope of the per-bin rate against time (req/s per s) and its standard error
    were the counts Poisson (each bin's variance its mean count); (0, 0) under 3 bins."""
    n = len(counts)
    if n < 3:
        return 0.0, 0.0
    xs = [(i + 0.5) * bin_s for i in range(n)]
    ys = [c / bin_s for c in counts]
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    # Var(rate in a bin) = mean count / bin_s^2; at least one arrival's worth, so a window
    # with almost none does not read one arrival as a trend.
    se = math.sqrt(max(1.0, my * bin_s) / bin_s**2 / sxx)
    return slope, se
