"""The simulator's half of the engine-fidelity bench: one engine's load predicted as it was served.

`predicted` runs the simulator (`sim.runner.simulate`) on a load's stretches (`Part`: each from an
idle engine, each with the calibration it is predicted from), one engine doing prefill and decode
(`one_engine_run`), over `SIM_SEEDS` seeds of step jitter, and reports the figures as the engine
model gives them and with the probe's request path added to each TTFT (`RequestPath`: what a
client sees beyond the engine). `tpot_in_company` and `by_company` set each request's measured
TPOT over the predicted against how many others decoded beside it. Used by `engine_fidelity.py`.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence
from typing import Any, NamedTuple

from disaggpool.core.contracts import SLOClass
from disaggpool.core.policies.registry import PolicyOptions
from disaggpool.core.profile import CalibrationProfile
from disaggpool.formats.traces import TraceRequest
from disaggpool.sim.cluster import InstanceSpec
from disaggpool.sim.metrics import latency_percentiles
from disaggpool.sim.runner import RunSpec, simulate

SIM_SEEDS = 5
JITTER = 0.03
ALL_LOCAL = 10**9  # local_prefill_below: every prompt is prefilled on the one engine


def one_engine_run(
    profile: CalibrationProfile, trace: Sequence[TraceRequest], slo: SLOClass, seed: int
) -> RunSpec:
    """The simulator's run of one engine doing prefill and decode: a decode instance timed by
    `profile` that prefills every prompt itself (the prefill instance a pool needs is never
    used)."""
    return RunSpec(
        experiment="fidelity",
        trace_name="fidelity",
        trace=tuple(trace),
        instances=(
            InstanceSpec("unused-prefill", "prefill", profile, profile),
            InstanceSpec("engine", "decode", profile, profile),
        ),
        slo_classes=(slo,),
        policy="round_robin",
        seed=seed,
        jitter=JITTER,
        options=PolicyOptions(local_prefill_below=ALL_LOCAL),
    )


@dataclasses.dataclass(frozen=True)
class RequestPath:
    """What the probe measured of the request's way through the API server, outside the engine
    (`http_overhead` of its report: requests the server rejects unprocessed): a client's TTFT
    is the engine's plus this. The simulator models the engine only."""

    base_s: float
    per_prompt_token_s: float

    @classmethod
    def recorded(cls, record: dict[str, Any]) -> RequestPath:
        """From its record in this bench's file (`vllm_engine.request_path`)."""
        return cls(record["base_s"], record["per_prompt_token_s"])

    def seconds(self, prompt_tokens: int) -> float:
        return self.base_s + self.per_prompt_token_s * prompt_tokens


@dataclasses.dataclass(frozen=True)
class Part:
    """A stretch of one load's trace that the engine serves on its own (idle before it, as
    after a probe) and the calibration it is predicted from."""

    trace: tuple[TraceRequest, ...]  # arrivals from 0
    first: int  # the load's index of its first request
    profile: CalibrationProfile
    path: RequestPath


class Prediction(NamedTuple):
    """What `predicted` returns."""

    figures: dict[str, dict[str, Any]]  # "engine", "with_request_path"
    shared_tpot: float  # the median TPOT of the load's first `shared` requests (`compare`)
    tpot: dict[int, float]  # per request (the load's index): its TPOT, mean over seeds


def predicted(parts: Sequence[Part], slo: SLOClass, shared: int) -> Prediction:
    """The simulator's prediction of a load served as `parts`, the mean over SIM_SEEDS jitter
    seeds (and the goodput's spread), as the engine model gives it ("engine") and with every
    request's TTFT carrying the request path, as a client sees it ("with_request_path"); one set
    of runs for both."""
    runs = []
    for seed in range(SIM_SEEDS):
        # (load index, engine TTFT, path, TPOT, output tokens), None TTFT: never finished
        done: list[tuple[int, float | None, float, float, int]] = []
        for part in parts:
            outcome = simulate(one_engine_run(part.profile, part.trace, slo, seed))
            done += [
                (
                    part.first + r.index,
                    r.ttft if r.finish >= 0 else None,
                    part.path.seconds(r.prompt_tokens),
                    r.tpot,
                    r.output_tokens,
                )
                for r in outcome.requests
            ]
        runs.append(done)
    shared_runs = [
        [tpot for i, t, _, tpot, _ in run if i < shared and t is not None and tpot > 0]
        for run in runs
    ]
    shared_tpot = (
        statistics.fmean(statistics.median(v) for v in shared_runs)
        if all(shared_runs)
        else math.nan
    )
    per_request: dict[int, list[float]] = {}
    for run in runs:
        for i, t, _, tpot, _ in run:
            if t is not None and tpot > 0:
                per_request.setdefault(i, []).append(tpot)
    return Prediction(
        {
            "engine": _prediction(runs, slo, with_path=False),
            "with_request_path": _prediction(runs, slo, with_path=True),
        },
        shared_tpot,
        {i: statistics.fmean(v) for i, v in per_request.items()},
    )


def _prediction(
    runs: Sequence[Sequence[tuple[int, float | None, float, float, int]]],
    slo: SLOClass,
    *,
    with_path: bool,
) -> dict[str, Any]:
    out_runs = []
    for run in runs:
        done = [
            (t + (path if with_path else 0.0), tpot, n)
            for _, t, path, tpot, n in run
            if t is not None
        ]
        ttft = [t for t, _, _ in done]
        met = sum(slo.met(t, tpot) for t, tpot, _ in done)
        out_runs.append(
            {
                "goodput": met / len(run),
                "late": sum(t > slo.ttft_s for t in ttft),
                "slow": sum(tpot > slo.tpot_s for _, tpot, _ in done),
                **latency_percentiles(ttft, [tpot for _, tpot, n in done if n > 1], digits=None),
            }
        )
    out: dict[str, Any] = {k: statistics.fmean(r[k] for r in out_runs) for k in out_runs[0]}
    out["goodput_sd"] = statistics.pstdev(r["goodput"] for r in out_runs)
    return out


#: Buckets of `tpot_in_company`: how many other requests decoded while a request did.
COMPANY = (
    ("0", 0, 0),
    ("1", 1, 1),
    ("2-3", 2, 3),
    ("4-7", 4, 7),
    ("8-15", 8, 15),
    ("16+", 16, 10**9),
)


def tpot_in_company(
    trace: Sequence[TraceRequest],
    first: int,
    records: Sequence[Sequence[Any]],
    predicted_tpot: dict[int, float],
) -> list[tuple[int, float]]:
    """For each request of one stretch (`trace`, arrivals from its start; `first`, the load's
    index of its first request) that decoded at least 8 tokens: how many others decoded at some
    time while it did (as measured: from its first token to its last), and its measured TPOT
    over the predicted. Where the model prices a lone request right and requests in company
    wrong, what it misses is in how a changing batch costs, not in the step's constants."""
    by_index = {int(r[0]): r for r in records}
    spans: dict[int, tuple[float, float]] = {}
    for k, req in enumerate(trace):
        rec = by_index.get(first + k)
        # (index, TTFT, TPOT, met, answered); a file recorded without segments holds the first three
        if rec is not None and (len(rec) < 5 or rec[4]) and rec[2] > 0:
            start = req.arrival_s + rec[1]
            spans[k] = (start, start + rec[2] * max(0, req.output_tokens - 1))
    out = []
    for k, (start, end) in spans.items():
        tpot = predicted_tpot.get(first + k)
        if trace[k].output_tokens < 8 or not tpot:
            continue
        others = sum(1 for o, (s, e) in spans.items() if o != k and s < end and e > start)
        out.append((others, by_index[first + k][2] / tpot))
    return out


def by_company(pairs: Sequence[tuple[int, float]]) -> list[dict[str, Any]]:
    """Median measured / predicted TPOT per bucket of `COMPANY`."""
    out = []
    for name, lo, hi in COMPANY:
        ratios = [r for n, r in pairs if lo <= n <= hi]
        if ratios:
            out.append(
                {
                    "others_decoding": name,
                    "requests": len(ratios),
                    "tpot_measured_over_predicted_p50": round(statistics.median(ratios), 3),
                }
            )
    return out
