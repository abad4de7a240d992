"""The traffic of the paper experiment: three mixed bursty traces and the synthetic sweep traces.

Mixed trace k takes the requests of the Azure 2023 conversation and code services (embedded in
the package, `formats.embedded.azure_services`) in the same wall-clock window (minute 20k to
20k+W of each one-hour trace), interleaved in their real order with their real lengths (prompts
clipped, to the 8k context for the llama8b setup, to 2,048 tokens for the paper setup:
`studies.paper_study` says why); conversation requests are class ``chat``, code requests class
``code``. Arrival times come from a Gamma renewal process with the setup's inter-arrival CV of
trace k (llama8b: 2, 3 and 4 for k = 0, 1, 2; paper: 1, 1.5, 2), at rate 1 (rescaled to each
operating rate later). Passing only the conversation service gives the one-class trace of the
paper setup's ``homogeneous_chat`` robustness case. Why not the real timestamps: the
code service alone has an inter-arrival CV of 13 with 25 idle gaps of over 30 s; rescaled to a
mean load, its bursts reach 10-26x the pool's capacity, a regime in which no placement matters
(the scarcity sweep covers overload explicitly). The output-length predictor is first fed
`history` requests of the same services from outside the window, clipped alike (the history a
running router has).

`synthetic_trace` builds the heterogeneity sweep's traces: the arrivals and mean lengths of a mixed
trace with log-normal lengths of a chosen spread.

Called by `studies.paper_setup`, `studies.paper_study` and `studies.paper`; pure (randomness is
seeded from fixed strings).
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Mapping, Sequence
from typing import Protocol

from disaggpool.formats.traces import TraceRequest
from disaggpool.sim import workload
from disaggpool.studies.paper_config import PaperConfig

__all__ = ["TRACE_CVS", "TraceSizes", "mixed_trace", "synthetic_trace"]

TRACE_CVS = PaperConfig().trace_cvs
"""Inter-arrival coefficient of variation of the llama8b setup's mixed trace k = 0, 1, 2."""


class TraceSizes(Protocol):
    """The sizes a setup's mixed traces are built with (`PaperConfig` for llama8b,
    `StudyConfig` for the paper setup)."""

    @property
    def window_minutes(self) -> float: ...

    @property
    def trace_cvs(self) -> tuple[float, ...]: ...

    @property
    def max_prompt(self) -> int: ...

    @property
    def max_output(self) -> int: ...

    @property
    def history(self) -> int: ...


def mixed_trace(
    services: Mapping[str, Sequence[TraceRequest]], k: int, cfg: TraceSizes
) -> tuple[list[TraceRequest], list[TraceRequest]]:
    """Mixed trace k (window starting at minute 20k) and the predictor's warm-up history.

    `services` is `formats.embedded.azure_services()` (class -> requests of one service), or a
    part of it. Prompts and outputs are clipped to `cfg`'s limits, arrivals have CV
    `cfg.trace_cvs[k]`.
    """
    start = 20.0 * 60.0 * k
    duration = cfg.window_minutes * 60.0
    parts = [workload.window(reqs, start, duration) for reqs in services.values()]
    mixed = workload.clip_lengths(workload.merge(*parts), cfg.max_prompt, cfg.max_output)
    arrivals = workload.gamma_arrivals(
        1.0, cfg.trace_cvs[k], len(mixed), random.Random(f"mixed:{k}")
    )
    mixed = workload.with_arrivals(mixed, arrivals)
    outside = [
        r for reqs in services.values() for r in reqs if not start <= r.arrival_s < start + duration
    ]
    outside.sort(key=lambda r: r.arrival_s)
    history = workload.clip_lengths(outside[: cfg.history], cfg.max_prompt, cfg.max_output)
    return mixed, history


def synthetic_trace(
    base: Sequence[TraceRequest], sigma: float, cfg: PaperConfig, seed: int
) -> tuple[list[TraceRequest], list[TraceRequest]]:
    """Same means and arrival pattern as `base`, lengths log-normal with spread `sigma`.

    Returns the trace (at most `cfg.sweep_requests` requests) and a predictor history of
    `cfg.history` requests drawn alike. sigma = 0 is the homogeneous extreme: one request shape
    and one SLO class (chat); otherwise the SLO mix is half chat, half code.
    """
    rng = random.Random(f"heterogeneity:{seed}:{sigma}")
    n = min(len(base), cfg.sweep_requests)
    prompt_mean = statistics.fmean(r.prompt_tokens for r in base)
    output_mean = statistics.fmean(r.output_tokens for r in base)
    classes = [("chat", 1.0)] if sigma == 0 else [("chat", 0.5), ("code", 0.5)]
    lengths = workload.lognormal_lengths(
        n + cfg.history,
        rng,
        prompt_mean=prompt_mean,
        output_mean=output_mean,
        sigma=sigma,
        slo_classes=classes,
    )
    lengths = workload.clip_lengths(lengths, cfg.max_prompt, cfg.max_output)
    trace = workload.with_arrivals(lengths[:n], [r.arrival_s for r in base[:n]])
    return trace, lengths[n:]
