"""One simulation run described as data, so runs can be fanned out to worker processes.

`RunSpec` carries everything a run needs (trace, pool sizes, profiles, policy, seed) and
`execute` turns it into one JSON row: the row schema shared by `sim paper` and `sim run`.
`run_all` executes many specs (these, or another experiment's with its own `run`) on a process
pool with a progress bar and returns rows in spec order, so the output does not depend on the
number of workers. A worker that dies (killed for memory, say) fails the whole call with
`BrokenProcessPool` instead of leaving it waiting for a row that never comes.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import multiprocessing
import os
from collections.abc import Callable, Sequence
from typing import Any

from disaggpool.core.contracts import SLOClass
from disaggpool.core.policies.registry import PolicyOptions, make_policy
from disaggpool.core.predictor import make_predictor
from disaggpool.core.profile import CalibrationProfile
from disaggpool.formats.traces import TraceRequest
from disaggpool.sim.cluster import InstanceSpec, RouterOptions, SimOutcome, Simulation
from disaggpool.sim.metrics import summarize

__all__ = ["RunSpec", "execute", "run_all", "simulate", "staged"]


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """A fully specified run. `extra` holds sweep values copied into the row (e.g. load)."""

    experiment: str
    trace_name: str
    trace: tuple[TraceRequest, ...]
    instances: tuple[InstanceSpec, ...]
    slo_classes: tuple[SLOClass, ...]
    policy: str
    seed: int
    datasheet: CalibrationProfile | None = None
    predictor: str = "online"
    history: tuple[TraceRequest, ...] = ()
    jitter: float = 0.03
    router: RouterOptions = dataclasses.field(default_factory=RouterOptions)
    options: PolicyOptions = dataclasses.field(default_factory=PolicyOptions)
    label: str = ""  # the row's name for this policy and options (default: the policy's name)
    extra: tuple[tuple[str, Any], ...] = ()
    prefix_caching: bool = False  # the engines cache prompt blocks


def execute(spec: RunSpec) -> dict[str, Any]:
    """Run one spec and return its JSON row."""
    classes = {c.name: c for c in spec.slo_classes}
    outcome = simulate(spec)
    summary = summarize(outcome, classes)
    return _row(spec, outcome, summary)


def simulate(spec: RunSpec) -> SimOutcome:
    """Run one spec: every request's record and the instances' counters (`execute` summarises
    them into a row)."""
    classes = {c.name: c for c in spec.slo_classes}
    default = spec.slo_classes[0].name
    datasheet = None
    if spec.datasheet is not None:
        datasheet = {i.name: spec.datasheet for i in spec.instances}
    policies = [
        make_policy(spec.policy, datasheet=datasheet, options=spec.options)
        for _ in range(spec.router.replicas)
    ]
    predictor = make_predictor(spec.predictor)
    for r in spec.history:  # the history a running router would already have learned from
        predictor.observe(r.slo_class or default, r.prompt_tokens, r.output_tokens)
    sim = Simulation(
        spec.instances,
        policies=policies,
        predictor=predictor,
        slo_classes=classes,
        default_class=default,
        seed=spec.seed,
        jitter=spec.jitter,
        router=spec.router,
        prefix_caching=spec.prefix_caching,
        # The switch means both: the engines schedule by priority, the policy sets them.
        scheduling="priority" if spec.options.priority_scheduling else "fcfs",
    )
    return sim.run(spec.trace)


def _row(spec: RunSpec, outcome: SimOutcome, summary: dict[str, Any]) -> dict[str, Any]:
    n_prefill = sum(1 for i in spec.instances if i.role == "prefill")
    queries = sum(q for q, _ in outcome.prefix_cache.values())
    hits = sum(h for _, h in outcome.prefix_cache.values())
    row: dict[str, Any] = {
        "trace": spec.trace_name,
        "policy": spec.label or spec.policy,
        "seed": spec.seed,
        **dict(spec.extra),
        "goodput": summary["goodput"],
        "misses": summary["misses"],
        "ttft_p99_s": summary["ttft_p99_s"],
        "tpot_p99_s": summary["tpot_p99_s"],
        "prefix_hit": round(hits / queries, 4) if queries else 0.0,
        "requests": summary["requests"],
        "prefill_instances": n_prefill,
        "decode_instances": len(spec.instances) - n_prefill,
        "predictor": spec.predictor,
        "options": dataclasses.asdict(spec.options),
        "router": dataclasses.asdict(spec.router),
        "summary": summary,
        "predictor_errors": {k: round(v, 4) for k, v in sorted(outcome.predictor_errors.items())},
    }
    return row


def _workers() -> int:
    return max(1, min(os.cpu_count() or 1, 8))


def run_all(
    specs: Sequence[Any],
    *,
    workers: int | None = None,
    progress: Callable[[int], None] | None = None,
    run: Callable[[Any], dict[str, Any]] = execute,
) -> list[dict[str, Any]]:
    """Execute specs with `run` (in parallel when workers > 1); rows come back in spec order.
    A spec has `trace` and `instances` (the longest runs start first)."""
    workers = workers or _workers()
    if workers == 1 or len(specs) <= 1:
        rows = []
        for spec in specs:
            rows.append(run(spec))
            if progress:
                progress(1)
        return rows
    ctx = multiprocessing.get_context("fork" if hasattr(os, "fork") else "spawn")
    rows_by_index: dict[int, dict[str, Any]] = {}
    # Longest runs first keeps every worker busy until the end.
    order = sorted(range(len(specs)), key=lambda i: -len(specs[i].trace) * len(specs[i].instances))
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        futures = {pool.submit(run, specs[i]): i for i in order}
        try:
            for future in concurrent.futures.as_completed(futures):
                rows_by_index[futures[future]] = future.result()
                if progress:
                    progress(1)
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)
            raise
    return [rows_by_index[i] for i in range(len(specs))]


def staged(
    progress: Callable[[str, int, int], None] | None, stage: str, total: int
) -> Callable[[int], None]:
    """A `run_all` progress callback (increments) reporting ``(stage, done, total)`` to
    `progress`, the callback every experiment takes."""
    done = 0

    def tick(n: int) -> None:
        nonlocal done
        done += n
        if progress:
            progress(stage, done, total)

    return tick
