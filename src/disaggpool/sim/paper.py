"""`disaggpool sim paper`: the "Calibrate, Then Route" experiments, reproduced in our simulator.

The setup (hardware, traffic, SLO targets, pool split, operating rates) is derived once by
`sim.paper_setup` from the traces of `sim.paper_traces` and the sizes of `PaperConfig`. This
module lays out the experiments on it and runs them:

* ``main``: all policies x 3 traces x seeds, each trace at its operating rate;
* ``ablation``: calibrated vs the same scorer on datasheet constants, on pools with growing
  hardware speed spread, each at its own operating point;
* ``pool_size``: 3..16 decode instances, each pool at its own operating point;
* ``heterogeneity``: log-normal length spread and SLO mix, each at its own operating point;
* ``scarcity``: up to 3x the operating rate;
* ``gpu_count``: 4..8 GPUs at the rate 7 GPUs carry, each count at its best split for that rate.

The sweeps' operating points are found by one lockstep search (`sim.operating_point`), so all
their bisection runs of a step run in parallel. Called by the CLI (`cmd_sim_paper`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from disaggpool.formats.traces import TraceRequest
from disaggpool.sim import capacity, report, workload
from disaggpool.sim.operating_point import Progress, SearchProblem, operating_rates
from disaggpool.sim.paper_config import PaperConfig
from disaggpool.sim.paper_setup import SEARCH_POLICY, Setup, make_setup, paper_run, rate_search
from disaggpool.sim.paper_traces import synthetic_trace
from disaggpool.sim.runner import RunSpec, run_all

__all__ = ["EXPERIMENTS", "PaperConfig", "build_specs", "run_paper"]

ALL_POLICIES = (
    "round_robin",
    "least_loaded",
    "length",
    "random",
    "p2c",
    "uncalibrated",
    "calibrated",
)
SWEEP_POLICIES = ("round_robin", "least_loaded", "length", "calibrated")
SCARCITY_POLICIES = ("round_robin", "random", "calibrated_greedy", "calibrated")
ABLATION_POLICIES = ("least_loaded", "uncalibrated", "calibrated")

EXPERIMENTS = ("main", "ablation", "pool_size", "heterogeneity", "scarcity", "gpu_count")
"""The experiments, in the order of the output document."""


def build_specs(
    cfg: PaperConfig, setup: Setup, *, workers: int | None = None, progress: Progress | None = None
) -> dict[str, list[RunSpec]]:
    """Every run of every experiment, keyed by experiment (in `EXPERIMENTS` order).

    Runs the sweeps' operating-point searches (one lockstep search) and the GPU-count split
    probe; the experiments' own runs are returned, not run.
    """
    experiments = _Experiments(cfg, setup)
    searches = {
        "ablation": experiments.ablation_searches(),
        "pool_size": experiments.pool_size_searches(),
        "heterogeneity": experiments.heterogeneity_searches(),
        "gpu_count": [experiments.gpu_count_search()],
    }
    found = iter(
        operating_rates(
            [p for group in searches.values() for p in group],
            steps=cfg.bisection_steps,
            workers=workers,
            progress=progress,
        )
    )
    rates = {name: [next(found) for _ in group] for name, group in searches.items()}
    return {
        "main": experiments.main(),
        "ablation": experiments.ablation(rates["ablation"]),
        "pool_size": experiments.pool_size(rates["pool_size"]),
        "heterogeneity": experiments.heterogeneity(rates["heterogeneity"]),
        "scarcity": experiments.scarcity(),
        "gpu_count": experiments.gpu_count(rates["gpu_count"][0], workers=workers),
    }


class _Experiments:
    """The runs of each experiment on one setup, and the searches for the sweeps' rates.

    Every experiment but ``main`` runs on mixed trace 0 and its history.
    """

    def __init__(self, cfg: PaperConfig, setup: Setup) -> None:
        self.cfg = cfg
        self.setup = setup
        self.n_p, self.n_d = setup.split
        self.base = setup.traces[0]
        self.history = setup.histories[0]
        self.rate = setup.rates[0]
        self.seed = cfg.seeds[0]
        # Each pool size keeps the main pool's prefill:decode ratio.
        self.sizes = [(max(1, round(d * self.n_p / self.n_d)), d) for d in cfg.pool_sizes]
        self.synthetic = [
            synthetic_trace(self.base, sigma, cfg, self.seed) for sigma in cfg.heterogeneity
        ]

    def _sweep_trace(self, rate: float, n: int | None = None) -> list[TraceRequest]:
        """Trace 0 at `rate`, its first `n` requests (default `cfg.sweep_requests`)."""
        return _head(workload.rescale(self.base, rate), self.cfg.sweep_requests if n is None else n)

    def main(self) -> list[RunSpec]:
        s, cfg = self.setup, self.cfg
        return [
            paper_run(
                s,
                "main",
                f"mixed-{k}",
                workload.rescale(t, s.rates[k]),
                h,
                self.n_p,
                self.n_d,
                policy,
                seed,
                rate_rps=round(s.rates[k], 4),
            )
            for k, (t, h) in enumerate(zip(s.traces, s.histories, strict=True))
            for seed in cfg.seeds
            for policy in ALL_POLICIES
        ]

    # Calibration matters most where instances differ: the same comparison on pools whose boards
    # spread more in speed (mixed clocks, thermal limits, degraded links).
    def ablation_searches(self) -> list[SearchProblem]:
        return [
            rate_search(
                self.setup,
                self.cfg,
                self.base,
                self.history,
                self.n_p,
                self.n_d,
                self.rate,
                limit=self.cfg.sweep_requests,
                speed_sigma=sigma,
            )
            for sigma in self.cfg.hardware_spread
        ]

    def ablation(self, rates: Sequence[float]) -> list[RunSpec]:
        return [
            paper_run(
                self.setup,
                "ablation",
                "mixed-0",
                self._sweep_trace(rate),
                self.history,
                self.n_p,
                self.n_d,
                policy,
                seed,
                speed_sigma=sigma,
                hardware_spread=sigma,
            )
            for sigma, rate in zip(self.cfg.hardware_spread, rates, strict=True)
            for seed in self.cfg.seeds
            for policy in ABLATION_POLICIES
        ]

    # Each pool size at its own operating point, so that every size is compared equally hot; the
    # trace grows with the pool so that every size sees as many requests per instance.
    def _pool_requests(self, d: int) -> int:
        return self.cfg.sweep_requests * d // self.n_d

    def pool_size_searches(self) -> list[SearchProblem]:
        return [
            rate_search(
                self.setup,
                self.cfg,
                self.base,
                self.history,
                p,
                d,
                capacity.bottleneck_rps(p, d, self.setup.cap),
                limit=self._pool_requests(d),
            )
            for p, d in self.sizes
        ]

    def pool_size(self, rates: Sequence[float]) -> list[RunSpec]:
        return [
            paper_run(
                self.setup,
                "pool_size",
                "mixed-0",
                self._sweep_trace(rate, self._pool_requests(d)),
                self.history,
                p,
                d,
                policy,
                self.seed,
                decode_pool=d,
            )
            for (p, d), rate in zip(self.sizes, rates, strict=True)
            for policy in SWEEP_POLICIES
        ]

    def heterogeneity_searches(self) -> list[SearchProblem]:
        s = self.setup
        return [
            rate_search(
                s,
                self.cfg,
                t,
                h,
                self.n_p,
                self.n_d,
                capacity.bottleneck_rps(
                    self.n_p, self.n_d, capacity.pool_capacity(s.nominal, t, s.tightest_tpot_s)
                ),
                limit=self.cfg.sweep_requests,
            )
            for t, h in self.synthetic
        ]

    def heterogeneity(self, rates: Sequence[float]) -> list[RunSpec]:
        return [
            paper_run(
                self.setup,
                "heterogeneity",
                f"lognormal-{sigma}",
                workload.rescale(t, rate),
                h,
                self.n_p,
                self.n_d,
                policy,
                self.seed,
                length_sigma=sigma,
            )
            for sigma, (t, h), rate in zip(
                self.cfg.heterogeneity, self.synthetic, rates, strict=True
            )
            for policy in SWEEP_POLICIES
        ]

    def scarcity(self) -> list[RunSpec]:
        return [
            paper_run(
                self.setup,
                "scarcity",
                "mixed-0",
                self._sweep_trace(self.rate * load),
                self.history,
                self.n_p,
                self.n_d,
                policy,
                self.seed,
                load=load,
            )
            for load in self.cfg.scarcity_loads
            for policy in SCARCITY_POLICIES
        ]

    # The rate 7 GPUs carry at the operating point; each GPU count at its best split for it.
    def gpu_count_search(self) -> SearchProblem:
        p7, d7 = _near_split(7, self.n_p, self.n_d)[1]
        return rate_search(
            self.setup,
            self.cfg,
            self.base,
            self.history,
            p7,
            d7,
            capacity.bottleneck_rps(p7, d7, self.setup.cap),
            limit=self.cfg.sweep_requests,
        )

    def gpu_count(self, rate7: float, *, workers: int | None) -> list[RunSpec]:
        trace = self._sweep_trace(rate7)
        candidates = {g: _near_split(g, self.n_p, self.n_d) for g in self.cfg.gpu_counts}
        probe = [
            paper_run(
                self.setup, "split", "mixed-0", trace, self.history, p, d, SEARCH_POLICY, self.seed
            )
            for g in self.cfg.gpu_counts
            for p, d in candidates[g]
        ]
        goodput = iter(r["goodput"] for r in run_all(probe, workers=workers))
        specs: list[RunSpec] = []
        for gpus in self.cfg.gpu_counts:
            scored = [(next(goodput), -p, (p, d)) for p, d in candidates[gpus]]
            p, d = max(scored)[2]
            specs += [
                paper_run(
                    self.setup,
                    "gpu_count",
                    "mixed-0",
                    trace,
                    self.history,
                    p,
                    d,
                    policy,
                    self.seed,
                    gpus=gpus,
                )
                for policy in SWEEP_POLICIES
            ]
        return specs


def _near_split(gpus: int, n_p: int, n_d: int) -> list[tuple[int, int]]:
    """Splits of `gpus` within one prefill instance of the main pool's ratio (middle one second)."""
    centre = round(gpus * n_p / (n_p + n_d))
    return (
        [(p, gpus - p) for p in (centre - 1, centre, centre + 1) if 1 <= p < gpus]
        if gpus > 2
        else [(1, 1)]
    )


def _head(trace: Sequence[TraceRequest], n: int) -> list[TraceRequest]:
    return list(trace[: max(1, n)])


def run_paper(
    cfg: PaperConfig,
    *,
    workers: int | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """All experiments; returns the JSON document (``{"setup", "experiments", "findings"}``)."""
    setup = make_setup(cfg, workers=workers, progress=progress)
    specs = build_specs(cfg, setup, workers=workers, progress=progress)
    flat = [s for group in specs.values() for s in group]
    total = len(flat)
    done = 0

    def tick(k: int) -> None:
        nonlocal done
        done += k
        if progress:
            progress("experiments", done, total)

    rows = run_all(flat, workers=workers, progress=tick)
    experiments: dict[str, list[dict[str, Any]]] = {name: [] for name in EXPERIMENTS}
    for spec, row in zip(flat, rows, strict=True):
        experiments[spec.experiment].append(row)
    return {
        "setup": setup.describe(cfg),
        "experiments": experiments,
        "findings": report.findings(experiments),
    }
