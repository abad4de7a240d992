"""Tests of disaggpool.sim.operating_point, the lockstep bisection of `sim paper` and the demo."""

from __future__ import annotations

import dataclasses
import random

import pytest

from disaggpool.core.contracts import SLOClass
from disaggpool.core.hardware import builtin_profile
from disaggpool.formats.traces import TraceRequest
from disaggpool.sim import workload
from disaggpool.sim.operating_point import SearchProblem, operating_rates
from disaggpool.sim.pools import build_pool
from disaggpool.sim.runner import RunSpec, execute

A40 = builtin_profile("a40-llama3-8b")
SLO = SLOClass("chat", 1.7, 0.065)
STEPS = 5


def _trace(n: int = 240, seed: int = 3) -> list[TraceRequest]:
    rng = random.Random(seed)
    lengths = workload.lognormal_lengths(
        n, rng, prompt_mean=900, output_mean=150, sigma=0.8, slo_classes=[("chat", 1.0)]
    )
    lengths = workload.clip_lengths(lengths, 4000, 600)
    return workload.with_arrivals(lengths, workload.gamma_arrivals(1.0, 2.0, n, rng))


def _problem(
    pool: tuple[int, int] = (1, 2), target: float = 0.85, **cut: int | float
) -> SearchProblem:
    run = RunSpec(
        experiment="operating_point",
        trace_name="t",
        trace=tuple(_trace()),
        instances=tuple(build_pool(*pool, A40, seed=1)),
        slo_classes=(SLO,),
        policy="round_robin",
        seed=1,
    )
    return SearchProblem(run, target, 0.5, 40.0, **cut)  # type: ignore[arg-type]


def test_found_rate_attains_the_target_and_twice_it_does_not() -> None:
    problem = _problem()
    (rate,) = operating_rates([problem], steps=STEPS, workers=1)
    assert problem.low < rate < problem.high
    # The answer is always a rate whose run was seen to attain the target.
    assert execute(problem.run_at(rate))["goodput"] >= 0.85
    assert execute(problem.run_at(2 * rate))["goodput"] < 0.85


def test_lockstep_gives_each_problem_its_own_answer() -> None:
    small, large = _problem(pool=(1, 1)), _problem(pool=(3, 4))
    together = operating_rates([small, large], steps=STEPS, workers=2)
    alone = [operating_rates([p], steps=STEPS, workers=1)[0] for p in (small, large)]
    assert together == alone
    assert together[0] < together[1]  # a bigger pool carries more


def test_unattainable_target_returns_the_bracket_bottom() -> None:
    problem = _problem(target=1.01)
    assert operating_rates([problem], steps=3, workers=1) == [problem.low]


def test_progress_reports_every_step() -> None:
    seen: list[tuple[str, int, int]] = []
    operating_rates([_problem()], steps=2, workers=1, progress=lambda *a: seen.append(a))
    assert seen == [("operating points (1 pools)", k, 2) for k in range(3)]


def test_trace_at_rescales_then_cuts() -> None:
    problem = _problem(limit=100)
    cut = problem.trace_at(4.0)
    assert len(cut) == 100
    assert cut == workload.rescale(problem.run.trace, 4.0)[:100]
    horizon = _problem(horizon_s=10.0).trace_at(4.0)
    assert horizon and all(r.arrival_s < 10.0 for r in horizon)
    assert len(horizon) < len(problem.run.trace)
    spec = problem.run_at(4.0)
    assert spec.trace == tuple(cut)
    assert dataclasses.replace(spec, trace=problem.run.trace) == problem.run


@pytest.mark.parametrize(("low", "high", "limit"), [(0.0, 1.0, None), (2.0, 1.0, None), (1, 2, 0)])
def test_invalid_problems(low: float, high: float, limit: int | None) -> None:
    run = _problem().run
    with pytest.raises(ValueError):
        SearchProblem(run, 0.85, low, high, limit=limit)
