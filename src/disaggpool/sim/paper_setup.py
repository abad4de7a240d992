"""The setup of the paper experiment: hardware, SLO targets, pool split and operating rates.

Every constant is chosen here once, from the principles in `sim.capacity` and `sim.pools`, and
recorded in the output's ``setup`` block (`Setup.describe`):

* Hardware: Llama-3-8B on A40 (`a40-llama3-8b`), per-instance speed spread 5%, probe fit error 3%.
* Traffic: the three mixed bursty traces of `sim.paper_traces`.
* Operating point: the paper reports baselines at 0.835-0.847 goodput, i.e. a pool run hot. We
  put every trace at *the rate at which round-robin attains 0.85 goodput* on it (found by
  bisection in the simulator, `sim.operating_point`). The policy used to find it knows nothing,
  so the operating point favours none of the policies compared, and traces with different length
  mixes are equally hot.
* Pool: 8 GPUs. The prefill/decode split is found the way DistServe places instances: for every
  split, the rate at which round-robin attains 0.85 goodput (averaged over the three traces); the
  split carrying the most traffic wins (ties to more decode instances). The analytic bottleneck
  (`capacity.best_split`) is only the bracket of that search.
* SLO targets: multiples of unloaded latency (`sim.capacity`).

`paper_run` and `rate_search` build the runs and searches of the experiments from a `Setup`;
`sim.paper` calls them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from disaggpool.core.contracts import SLOClass
from disaggpool.core.hardware import builtin_profile
from disaggpool.core.profile import CalibrationProfile
from disaggpool.core.stats import mean_or_nan
from disaggpool.formats.embedded import azure_services
from disaggpool.formats.traces import TraceRequest
from disaggpool.sim import capacity, workload
from disaggpool.sim.operating_point import Progress, SearchProblem, operating_rates
from disaggpool.sim.paper_config import PaperConfig
from disaggpool.sim.paper_traces import mixed_trace
from disaggpool.sim.pools import build_pool
from disaggpool.sim.runner import RunSpec

__all__ = ["SEARCH_POLICY", "Setup", "make_setup", "paper_run", "rate_search"]

SEARCH_POLICY = "round_robin"
"""The policy whose goodput defines an operating point: it knows nothing, so favours none."""


@dataclasses.dataclass(frozen=True)
class Setup:
    """The derived constants every experiment of the paper shares."""

    nominal: CalibrationProfile
    datasheet: CalibrationProfile
    slo: tuple[SLOClass, ...]
    cap: capacity.PoolCapacity
    split: tuple[int, int]
    rates: tuple[float, ...]  # per trace: the rate at which round-robin attains the target goodput
    split_rates: dict[int, float]  # prefill instances -> mean such rate over the traces
    traces: tuple[tuple[TraceRequest, ...], ...]
    histories: tuple[tuple[TraceRequest, ...], ...]

    @property
    def tightest_tpot_s(self) -> float:
        """The tightest TPOT target of the SLO classes (it bounds the decode batch)."""
        return min(c.tpot_s for c in self.slo)

    def describe(self, cfg: PaperConfig) -> dict[str, Any]:
        """The ``setup`` block of the experiment's JSON document."""
        return {
            "profile": self.nominal.name,
            "datasheet": self.datasheet.name,
            "target_goodput": cfg.target_goodput,
            "gpus": cfg.gpus,
            "split": {"prefill": self.split[0], "decode": self.split[1]},
            "split_search_rps": {
                f"{p}P{cfg.gpus - p}D": round(r, 3) for p, r in sorted(self.split_rates.items())
            },
            "rates_rps": [round(r, 4) for r in self.rates],
            "analytic_capacity_rps_per_instance": {
                "prefill": round(self.cap.prefill_rps, 4),
                "decode": round(self.cap.decode_rps, 4),
                "decode_batch": self.cap.decode_batch,
            },
            "slo_classes": {c.name: {"ttft_s": c.ttft_s, "tpot_s": c.tpot_s} for c in self.slo},
            "traces": [workload.trace_stats(t) for t in self.traces],
            "window_minutes": cfg.window_minutes,
            "seeds": list(cfg.seeds),
        }


def paper_run(
    setup: Setup,
    experiment: str,
    trace_name: str,
    trace: Sequence[TraceRequest],
    history: Sequence[TraceRequest],
    n_prefill: int,
    n_decode: int,
    policy: str,
    seed: int,
    speed_sigma: float = 0.05,
    **extra: Any,
) -> RunSpec:
    """One run of the experiment on a pool of the setup's hardware; `extra` goes into its row."""
    return RunSpec(
        experiment=experiment,
        trace_name=trace_name,
        trace=tuple(trace),
        instances=tuple(
            build_pool(n_prefill, n_decode, setup.nominal, seed, speed_sigma=speed_sigma)
        ),
        slo_classes=setup.slo,
        policy=policy,
        seed=seed,
        datasheet=setup.datasheet,
        history=tuple(history),
        extra=tuple(sorted(extra.items())),
    )


def rate_search(
    setup: Setup,
    cfg: PaperConfig,
    trace: Sequence[TraceRequest],
    history: Sequence[TraceRequest],
    n_prefill: int,
    n_decode: int,
    guess: float,
    *,
    limit: int | None = None,
    speed_sigma: float = 0.05,
) -> SearchProblem:
    """The operating-point search of one trace on one pool: round-robin at the target goodput.

    `guess` is the analytic bottleneck capacity; the bracket is 0.2x to 2x of it. `limit`
    searches on the first `limit` requests only (the sweeps).
    """
    run = paper_run(
        setup,
        "operating_point",
        "search",
        trace,
        history,
        n_prefill,
        n_decode,
        SEARCH_POLICY,
        cfg.seeds[0],
        speed_sigma=speed_sigma,
    )
    return SearchProblem(run, cfg.target_goodput, 0.2 * guess, 2.0 * guess, limit=limit)


def make_setup(
    cfg: PaperConfig, *, workers: int | None = None, progress: Progress | None = None
) -> Setup:
    """Derive the setup: traces, SLO targets, analytic capacity, then the placement search."""
    nominal = builtin_profile(cfg.profile)
    services = azure_services()
    pairs = [mixed_trace(services, k, cfg) for k in range(3)]
    all_requests = [r for t, _ in pairs for r in t]
    slo = capacity.slo_targets(nominal, all_requests)
    tightest = min(c.tpot_s for c in slo.values())
    cap = capacity.pool_capacity(nominal, all_requests, tightest)
    setup = Setup(
        nominal=nominal,
        datasheet=builtin_profile(cfg.datasheet),
        slo=tuple(slo.values()),
        cap=cap,
        split=(0, 0),
        rates=(),
        split_rates={},
        traces=tuple(tuple(t) for t, _ in pairs),
        histories=tuple(tuple(h) for _, h in pairs),
    )
    return _place(setup, cfg, workers=workers, progress=progress)


def _place(
    setup: Setup, cfg: PaperConfig, *, workers: int | None, progress: Progress | None
) -> Setup:
    """Placement search: every split, every trace; keep the split with the most goodput capacity."""
    n_traces = len(setup.traces)
    splits = range(1, cfg.gpus)
    problems = [
        rate_search(
            setup,
            cfg,
            setup.traces[k],
            setup.histories[k],
            p,
            cfg.gpus - p,
            capacity.bottleneck_rps(
                p,
                cfg.gpus - p,
                capacity.pool_capacity(setup.nominal, setup.traces[k], setup.tightest_tpot_s),
            ),
        )
        for p in splits
        for k in range(n_traces)
    ]
    found = operating_rates(problems, steps=cfg.bisection_steps, workers=workers, progress=progress)
    per_trace = {p: found[i * n_traces : (i + 1) * n_traces] for i, p in enumerate(splits)}
    per_split = {p: mean_or_nan(rates) for p, rates in per_trace.items()}
    best = max(per_split, key=lambda p: (round(per_split[p], 6), -p))
    return dataclasses.replace(
        setup, split=(best, cfg.gpus - best), rates=tuple(per_trace[best]), split_rates=per_split
    )
