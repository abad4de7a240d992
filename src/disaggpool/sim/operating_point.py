"""The operating-point search: the highest rate at which a policy still attains a target goodput.

This is the one search used wherever a pool has to be run "hot but not overloaded": the paper
experiment (`studies.paper_setup` for the placement search and the per-trace rates,
`studies.paper` for the sweeps that put each pool at its own operating point), the prefix study,
the demo (the rate of its trace) and the benches.
It is DistServe's goodput capacity, measured in the simulator: each `SearchProblem` is a run
(trace, pool, policy, seed) whose trace is rescaled to a candidate rate, and bisection in the
problem's bracket keeps the highest rate whose run attains the problem's target.

All problems advance in lockstep, one bisection step at a time, so that each step's runs go to
`sim.runner.run_all` together and run in parallel. Runs are deterministic, so the rates do not
depend on how many problems are searched together nor on the number of workers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from disaggpool.formats.traces import TraceRequest
from disaggpool.sim import workload
from disaggpool.sim.runner import RunSpec, run_all

__all__ = ["Progress", "SearchProblem", "operating_rates"]

Progress = Callable[[str, int, int], None]
"""progress(stage, done, total): called as a long run advances."""


@dataclasses.dataclass(frozen=True)
class SearchProblem:
    """Find the highest rate in [`low`, `high`] at which `run` attains `target_goodput`.

    `run` is the run searched (its policy, pool, seed, SLO classes, predictor history) with its
    trace at any rate; at each candidate rate the trace is rescaled to that rate
    (`workload.rescale`) and then cut: to its first `limit` requests, and to the requests
    arriving before `horizon_s`, when those are given.
    """

    run: RunSpec
    target_goodput: float
    low: float
    high: float
    limit: int | None = None
    horizon_s: float | None = None

    def __post_init__(self) -> None:
        if not 0 < self.low < self.high:
            raise ValueError(f"bracket must satisfy 0 < low < high, got {self.low}, {self.high}")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit must be >= 1, got {self.limit}")

    def trace_at(self, rate: float) -> list[TraceRequest]:
        """The problem's trace at `rate` requests/s, cut to `limit` and `horizon_s`."""
        trace = workload.rescale(self.run.trace, rate)
        if self.limit is not None:
            trace = trace[: self.limit]
        if self.horizon_s is not None:
            trace = [r for r in trace if r.arrival_s < self.horizon_s]
        return trace

    def run_at(self, rate: float) -> RunSpec:
        """The searched run with its trace at `rate`."""
        return dataclasses.replace(self.run, trace=tuple(self.trace_at(rate)))


def operating_rates(
    problems: Sequence[SearchProblem],
    *,
    steps: int,
    workers: int | None = None,
    progress: Progress | None = None,
) -> list[float]:
    """For each problem, the highest rate found in `steps` bisection steps at which its run
    attains its target goodput (the bracket's low end if none does); in problem order.

    Each step halves every bracket: the run at the midpoint attains the target (goodput >=
    target) -> the midpoint is the new low end, else the new high end. The answer is the final
    low end, so it is a rate that was seen to attain the target, or the bracket's bottom.
    """
    lo = [p.low for p in problems]
    hi = [p.high for p in problems]
    stage = f"operating points ({len(problems)} pools)"
    for step in range(steps):
        if progress:
            progress(stage, step, steps)
        mids = [(a + b) / 2 for a, b in zip(lo, hi, strict=True)]
        specs = [p.run_at(m) for p, m in zip(problems, mids, strict=True)]
        rows = run_all(specs, workers=workers)
        for i, (problem, row) in enumerate(zip(problems, rows, strict=True)):
            if row["goodput"] >= problem.target_goodput:
                lo[i] = mids[i]
            else:
                hi[i] = mids[i]
    if progress:
        progress(stage, steps, steps)
    return lo
