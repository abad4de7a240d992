"""Time-varying traffic for the autoscaling experiment: the Azure 2023 requests on a moving rate.

A shape (`Shape`, one per name in `SHAPES`) says, at each time of the run, the arrival rate as a
fraction of the peak, the share of code requests, and multipliers of the output and prompt
lengths. Arrivals are a non-homogeneous Poisson process drawn by thinning, and each arrival takes
the lengths of a request drawn from the embedded Azure 2023 services (chat: conversation, code:
code completion), times the shape's multipliers then:

* `diurnal`: one day compressed into the run, from a night trough of 15% to the peak and back;
* `ramp`: 15% -> 100% over the first 40% of the run, held for 20%, back down over the last 40%;
* `bursts`: 35% with a burst at the peak for 60 s of every 300 s;
* `shift`: a constant 60% whose mix shifts halfway from chat only to half chat, half code: the
  rate stays, the heterogeneity and the work per request change (what a rate-only scaler misses);
* `mixshift`: a constant rate of chat whose outputs are ten times longer in the middle third of
  the run (a step at whole minutes): the same requests per second hold a decode slot ten times
  as long;
* `flash`: a flash crowd: a seventh of the peak, the peak for two minutes from 40% of the run,
  then back;
* `promptramp`: a constant rate of chat whose prompts grow linearly from 1x to 4x over the run:
  the work moves to prefill.

Each shape names the lengths that hold at its peak (`peak_output_x`, `peak_prompt_x`) and the
role its peak is sized for (`sized_by`), so that the study can size the peak for each
(`studies.autoscale_study`). Deterministic in its seed. Pure apart from reading the embedded
traces.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

from disaggpool.formats.traces import TraceRequest

__all__ = ["SHAPES", "Shape", "scaled_lengths", "shaped_trace"]

TROUGH = 0.15


BURST_EVERY_S, BURST_S, BURST_BASE = 300.0, 60.0, 0.35
MIXSHIFT_OUTPUT_X = 10.0
FLASH_X, FLASH_AT, FLASH_S = 7.0, 0.4, 120.0
PROMPTRAMP_X = 4.0


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


def _full(t: float, duration_s: float) -> float:
    return 1.0


def _no_code(t: float, duration_s: float) -> float:
    return 0.0


def _half_code_later(t: float, duration_s: float) -> float:
    return 0.0 if t < duration_s / 2 else 0.5


def _unscaled(t: float, duration_s: float) -> float:
    return 1.0


def _long_outputs_mid_run(t: float, duration_s: float) -> float:
    # The thirds rounded down to whole minutes: the step falls from one minute to the next.
    start, end = (60.0 * math.floor(duration_s * k / 3 / 60.0) for k in (1, 2))
    return MIXSHIFT_OUTPUT_X if start <= t < end else 1.0


def _flash(t: float, duration_s: float) -> float:
    start = FLASH_AT * duration_s
    return 1.0 if start <= t < start + FLASH_S else 1.0 / FLASH_X


def _prompt_ramp(t: float, duration_s: float) -> float:
    return 1.0 + (PROMPTRAMP_X - 1.0) * min(1.0, max(0.0, t / duration_s))


Profile = Callable[[float, float], float]
"""A value at time t of a run of duration_s (t < 0 before the run)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Shape:
    """One traffic shape (module docstring). `rate`: the arrival rate as a fraction of the
    peak; `code`: the share of code requests; `output_x` / `prompt_x`: length multipliers (the
    last three read at max(0, t): before the run, the traffic is as at its start)."""

    rate: Profile
    code: Profile = _no_code
    output_x: Profile = _unscaled
    prompt_x: Profile = _unscaled
    peak_output_x: float = 1.0  # the multipliers in force when the rate is at its peak
    peak_prompt_x: float = 1.0
    sized_by: Literal["decode", "prefill"] = "decode"  # the role the peak fills to a share


SHAPES: Mapping[str, Shape] = {
    "diurnal": Shape(_diurnal),
    "ramp": Shape(_ramp),
    "bursts": Shape(_bursts),
    "shift": Shape(_constant, code=_half_code_later),
    "mixshift": Shape(_full, output_x=_long_outputs_mid_run, peak_output_x=MIXSHIFT_OUTPUT_X),
    "flash": Shape(_flash),
    "promptramp": Shape(
        _full, prompt_x=_prompt_ramp, peak_prompt_x=PROMPTRAMP_X, sized_by="prefill"
    ),
}


def scaled_lengths(
    prompt: int, output: int, prompt_x: float, output_x: float, max_context: int | None
) -> tuple[int, int]:
    """(prompt, output) times the multipliers, the scaled one kept within `max_context` (prompt +
    output) when there is one, never below its own length (a request already over the context
    is left as it was: the engine refuses it as before)."""
    p, o = round(prompt * prompt_x), round(output * output_x)
    if max_context is not None:
        p = min(p, max(prompt, max_context - output))
        o = min(o, max(output, max_context - p))
    return p, o


def shaped_trace(
    shape: str,
    peak_rps: float,
    duration_s: float,
    services: Mapping[str, Sequence[TraceRequest]],
    seed: int,
    *,
    history_s: float = 0.0,
    max_context: int | None = None,
) -> list[TraceRequest]:
    """Arrivals over `duration_s` at `peak_rps` times the shape's rate; lengths and SLO class from
    `services` (``chat`` and ``code``, as `formats.embedded.azure_services` gives them), times
    the shape's multipliers (`scaled_lengths`, within `max_context`). `history_s`: also the
    traffic of that long before the run (negative arrival times: what an autoscaler that has
    been running remembers)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown traffic shape {shape!r}; choose from {', '.join(SHAPES)}")
    if not (peak_rps > 0 and duration_s > 0):
        raise ValueError(f"peak_rps and duration_s must be positive: {peak_rps!r}, {duration_s!r}")
    rng = random.Random(f"autoscale:{shape}:{seed}")
    spec = SHAPES[shape]
    out: list[TraceRequest] = []
    t = -history_s
    while True:
        t += rng.expovariate(peak_rps)  # thinning: candidates at the peak rate, kept by ratio
        if t >= duration_s:
            return out
        if rng.random() > spec.rate(t, duration_s):
            continue
        at = max(0.0, t)
        service = "code" if rng.random() < spec.code(at, duration_s) else "chat"
        lengths = rng.choice(services[service])
        prompt, output = scaled_lengths(
            lengths.prompt_tokens,
            lengths.output_tokens,
            spec.prompt_x(at, duration_s),
            spec.output_x(at, duration_s),
            max_context,
        )
        out.append(TraceRequest(t, prompt, output, slo_class=service))
