"""Time-varying traffic for the autoscaling experiment: the Azure 2023 requests on a moving rate.

A shape is the arrival rate as a fraction of the peak over the run (`SHAPES`), arrivals are a
non-homogeneous Poisson process drawn by thinning, and each arrival takes the lengths of a request
drawn from the embedded Azure 2023 services (chat: conversation, code: code completion):

* `diurnal`: one day compressed into the run, from a night trough of 15% to the peak and back;
* `ramp`: 15% -> 100% over the first 40% of the run, held for 20%, back down over the last 40%;
* `bursts`: 35% with a burst at the peak for 60 s of every 300 s;
* `shift`: a constant 60% whose mix shifts halfway from chat only to half chat, half code: the
  rate stays, the heterogeneity and the work per request change (what a rate-only scaler misses).

Deterministic in its seed. Pure apart from reading the embedded traces.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence

from disaggpool.formats.traces import TraceRequest

__all__ = ["SHAPES", "shaped_trace"]

TROUGH = 0.15


BURST_EVERY_S, BURST_S, BURST_BASE = 300.0, 60.0, 0.35


def _diurnal(t: float, duration_s: float) -> float:
    return TROUGH + (1 - TROUGH) * (1 - math.cos(2 * math.pi * t / duration_s)) / 2


def _ramp(t: float, duration_s: float) -> float:
    x = t / duration_s
    if x < 0:  # before the run: the night's trough
        return TROUGH
    if x < 0.4:
        return TROUGH + (1 - TROUGH) * x / 0.4
    if x < 0.6:
        return 1.0
    return TROUGH + (1 - TROUGH) * (1 - x) / 0.4


def _bursts(t: float, duration_s: float) -> float:
    return 1.0 if (t % BURST_EVERY_S) >= BURST_EVERY_S - BURST_S else BURST_BASE


def _constant(t: float, duration_s: float) -> float:
    return 0.6


def _no_code(t: float, duration_s: float) -> float:
    return 0.0


def _half_code_later(t: float, duration_s: float) -> float:
    return 0.0 if t < duration_s / 2 else 0.5


Profile = Callable[[float, float], float]
#: shape -> (rate as a fraction of the peak at time t of a run of duration_s, code share at t)
SHAPES: Mapping[str, tuple[Profile, Profile]] = {
    "diurnal": (_diurnal, _no_code),
    "ramp": (_ramp, _no_code),
    "bursts": (_bursts, _no_code),
    "shift": (_constant, _half_code_later),
}


def shaped_trace(
    shape: str,
    peak_rps: float,
    duration_s: float,
    services: Mapping[str, Sequence[TraceRequest]],
    seed: int,
    *,
    history_s: float = 0.0,
) -> list[TraceRequest]:
    """Arrivals over `duration_s` at `peak_rps` times the shape's rate; lengths and SLO class from
    `services` (``chat`` and ``code``, as `formats.embedded.azure_services` gives them).
    `history_s`: also the traffic of that long before the run (negative arrival times: what an
    autoscaler that has been running remembers)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown traffic shape {shape!r}; choose from {', '.join(SHAPES)}")
    if not (peak_rps > 0 and duration_s > 0):
        raise ValueError(f"peak_rps and duration_s must be positive: {peak_rps!r}, {duration_s!r}")
    rng = random.Random(f"autoscale:{shape}:{seed}")
    rate_at, code_share = SHAPES[shape]
    out: list[TraceRequest] = []
    t = -history_s
    while True:
        t += rng.expovariate(peak_rps)  # thinning: candidates at the peak rate, kept by ratio
        if t >= duration_s:
            return out
        if rng.random() > rate_at(t, duration_s):
            continue
        service = "code" if rng.random() < code_share(max(0.0, t), duration_s) else "chat"
        lengths = rng.choice(services[service])
        out.append(TraceRequest(t, lengths.prompt_tokens, lengths.output_tokens, slo_class=service))
