"""`disaggpool sim paper`: the "Calibrate, Then Route" experiments, reproduced in our simulator.

Two setups, every row tagged with its own (``"setup"``):

* ``llama8b``: Llama-3-8B on 8 A40s, the split found by placement search, three Azure mixed
  traces with arrival CV 2/3/4, SLOs as multiples of unloaded latency (`studies.paper_setup`);
* ``paper``: the study's own configuration, Qwen2.5-3B on 2P+4D A40s with its fixed SLOs at two
  levels (rows carry ``"slo"``: ``tight`` or ``loose``) (`studies.paper_study`).

Every trace (and SLO level) runs at the rate at which round-robin attains 0.85 goodput on it, and
every sweep point or case at its own such rate. The experiments (`EXPERIMENTS`, in output order):

* ``main`` (both setups): every policy label x 3 traces x seeds;
* ``ablation`` (paper, tight): what each lever of ``calibrated`` earns (rows carry ``"variant"``);
* ``robustness`` (paper, tight): four cases (rows carry ``"case"``), each at its own point;
* ``pool_size`` (llama8b): 3..16 decode instances (``"decode_pool"``);
* ``heterogeneity`` (llama8b): log-normal length spread and SLO mix (``"length_sigma"``);
* ``scarcity`` (llama8b): up to 3x the operating rate (``"load"``);
* ``herding`` (llama8b): what the router knows between two scrapes (``"view"``, `HERDING_VIEWS`):
  its own books (one replica, the setup's router), 4 or 16 replicas each with its own books and
  an even share of the arrivals, or no books at all (the gauges alone), and 4 or 16 replicas
  sharing their books over a bus of `SHARED_BOOKS_DELAY_S` (`core.shared_books`), at the main
  rate;
* ``hardware_spread`` (llama8b): calibrated vs datasheet constants on pools whose instances spread
  more in speed (``"hardware_spread"``);
* ``gpu_count`` (both setups): 4..8 GPUs (paper: 3..8) at the rate round-robin carries at 0.85 on
  7 GPUs (``"gpus"``). llama8b: each count at its best split for that rate (of the three nearest
  the main pool's ratio, by a round-robin probe); paper: prefill = round(G/3), the study's ratio;
* ``constant_error`` (both setups; paper at the tight SLO): our scorer (with and without the P/D
  decider) and the study's weighted-sum form fed the setup's nominal profile with every decode
  constant off by a factor (``"error_factor"``, `paper_setup.ERROR_FACTORS`; 1/7.4 is the study's
  own error), on the main traces at their operating points; rows' ``policy`` names the scorer.

The document `run_paper` returns (and ``--json`` writes):

* ``setups``: per setup run, its derived constants (profile, split, SLO targets, rates, traces);
* ``experiments``: experiment -> list of rows (`sim.runner.execute`'s row plus ``setup``, ``slo``
  for the paper setup, the experiment's own key above, and ``rate_rps`` where one rate applies);
  each row's ``policy`` is a label of `paper_setup.LABELS` (``calibrated`` = the P/D decider on,
  ``constant_error`` rows: a scorer of `paper_setup.ERROR_ARMS`;
  as the product runs it), its ``options``, ``router`` and ``predictor`` say what ran;
* ``findings``: `paper_report.findings`, whose keys its docstring documents.

The searches run lockstep (`paper_setup.solve_searches`) in three stages: everything the
configuration alone fixes (llama8b's placement, all of the paper setup's rates), then llama8b's
sweep points (they need its split), then llama8b's GPU-count split probe; then every run of both
setups at once. Called by the CLI (`cmd_sim_paper`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from disaggpool.formats.traces import TraceRequest
from disaggpool.sim import capacity, workload
from disaggpool.sim.operating_point import Progress, SearchProblem
from disaggpool.sim.runner import RunSpec, run_all, staged
from disaggpool.studies import paper_report
from disaggpool.studies.paper_config import PaperConfig
from disaggpool.studies.paper_setup import (
    SEARCH_POLICY,
    SWEEP_LABELS,
    Setup,
    constant_error_runs,
    llama8b_setup,
    paper_run,
    placed,
    placement_searches,
    rate_search,
    solve_searches,
)
from disaggpool.studies.paper_study import BASE_LABELS, Study
from disaggpool.studies.paper_traces import synthetic_trace

__all__ = ["EXPERIMENTS", "LLAMA8B_LABELS", "PaperConfig", "build_specs", "run_paper"]

LLAMA8B_LABELS = (*BASE_LABELS, "calibrated+priority")
SCARCITY_LABELS = ("round_robin", "random", "calibrated_greedy", "calibrated")
HERDING_LABELS = (
    "round_robin",
    "random",
    "least_loaded",
    "p2c",
    "calibrated_greedy",
    "calibrated",
    "calibrated_no_pd",
)
SHARED_BOOKS_DELAY_S = 0.005  # a bus (NATS) hop between two router replicas in one cluster
HERDING_VIEWS: dict[str, dict[str, Any]] = {
    "own_books": {},
    "4_replicas": {"replicas": 4},
    "16_replicas": {"replicas": 16},
    "no_books": {"own_books": False},
    "4_replicas_shared": {
        "replicas": 4,
        "shared_books": True,
        "bus_delay_s": SHARED_BOOKS_DELAY_S,
    },
    "16_replicas_shared": {
        "replicas": 16,
        "shared_books": True,
        "bus_delay_s": SHARED_BOOKS_DELAY_S,
    },
}
"""The `herding` experiment's router views: changes to the setup's `RouterOptions`."""
SPREAD_LABELS = ("least_loaded", "uncalibrated", "calibrated")

EXPERIMENTS = (
    "main",
    "ablation",
    "robustness",
    "pool_size",
    "heterogeneity",
    "scarcity",
    "herding",
    "hardware_spread",
    "gpu_count",
    "constant_error",
)
"""The experiments, in the order of the output document."""


def build_specs(
    cfg: PaperConfig, *, workers: int | None = None, progress: Progress | None = None
) -> tuple[dict[str, Any], dict[str, list[RunSpec]]]:
    """The ``setups`` block and every run of every experiment, keyed by experiment (in
    `EXPERIMENTS` order).

    Runs the operating-point searches and llama8b's GPU-count split probe; the experiments' own
    runs are returned, not run.
    """
    steps = cfg.bisection_steps
    llama = llama8b_setup(cfg) if "llama8b" in cfg.setups else None
    study = Study.build(cfg) if "paper" in cfg.setups else None
    first: dict[str, list[SearchProblem]] = {}
    if llama:
        first["llama8b"] = placement_searches(llama, cfg)
    if study:
        first |= study.searches()
    rates = solve_searches(first, steps=steps, workers=workers, progress=progress)
    setups: dict[str, Any] = {}
    specs: dict[str, list[RunSpec]] = {name: [] for name in EXPERIMENTS}
    if llama:
        llama = placed(llama, cfg, rates["llama8b"])
        experiments = _Experiments(cfg, llama)
        sweeps = solve_searches(
            experiments.searches(), steps=steps, workers=workers, progress=progress
        )
        for name, group in experiments.specs(sweeps, workers=workers).items():
            specs[name] += group
        setups["llama8b"] = llama.describe(cfg)
    if study:
        study = study.rated(rates)
        for name, group in study.specs().items():
            specs[name] += group
        setups["paper"] = study.describe()
    return setups, specs


class _Experiments:
    """The runs of each llama8b experiment, and the searches for the sweeps' rates.

    Every experiment but ``main`` runs on mixed trace 0 and its history; the sweeps run every
    seed (the bands of their plots), their operating points are searched with the first.
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

    def searches(self) -> dict[str, list[SearchProblem]]:
        """The sweeps' operating-point searches, by experiment (`specs` takes their rates)."""
        return {
            "hardware_spread": self._spread_searches(),
            "pool_size": self._pool_size_searches(),
            "heterogeneity": self._heterogeneity_searches(),
            "gpu_count": [self._gpu_count_search()],
        }

    def specs(
        self, rates: dict[str, list[float]], *, workers: int | None
    ) -> dict[str, list[RunSpec]]:
        """The runs of every llama8b experiment (runs the GPU-count split probe)."""
        return {
            "main": self._main(),
            "pool_size": self._pool_size(rates["pool_size"]),
            "heterogeneity": self._heterogeneity(rates["heterogeneity"]),
            "scarcity": self._scarcity(),
            "herding": self._herding(),
            "hardware_spread": self._spread(rates["hardware_spread"]),
            "gpu_count": self._gpu_count(rates["gpu_count"][0], workers=workers),
            "constant_error": constant_error_runs(self.setup, self.cfg, self.cfg.error_traces),
        }

    def _run(
        self,
        experiment: str,
        trace_name: str,
        trace: Sequence[TraceRequest],
        history: Sequence[TraceRequest],
        split: tuple[int, int],
        label: str,
        seed: int,
        **extra: Any,
    ) -> RunSpec:
        return paper_run(
            self.setup, experiment, trace_name, trace, history, *split, label, seed, **extra
        )

    def _sweep_trace(self, rate: float, n: int | None = None) -> list[TraceRequest]:
        """Trace 0 at `rate`, its first `n` requests (default `cfg.sweep_requests`)."""
        return _head(workload.rescale(self.base, rate), self.cfg.sweep_requests if n is None else n)

    def _main(self) -> list[RunSpec]:
        s = self.setup
        return [
            self._run(
                "main",
                f"mixed-{k}",
                workload.rescale(t, s.rates[k]),
                h,
                s.split,
                label,
                seed,
                rate_rps=round(s.rates[k], 4),
            )
            for k, (t, h) in enumerate(zip(s.traces, s.histories, strict=True))
            for seed in self.cfg.seeds
            for label in LLAMA8B_LABELS
        ]

    # Calibration matters most where instances differ: the same comparison on pools whose boards
    # spread more in speed (mixed clocks, thermal limits, degraded links).
    def _spread_searches(self) -> list[SearchProblem]:
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

    def _spread(self, rates: Sequence[float]) -> list[RunSpec]:
        return [
            self._run(
                "hardware_spread",
                "mixed-0",
                self._sweep_trace(rate),
                self.history,
                self.setup.split,
                label,
                seed,
                speed_sigma=sigma,
                hardware_spread=sigma,
            )
            for sigma, rate in zip(self.cfg.hardware_spread, rates, strict=True)
            for seed in self.cfg.seeds
            for label in SPREAD_LABELS
        ]

    # Each pool size at its own operating point, so that every size is compared equally hot; the
    # trace grows with the pool so that every size sees as many requests per instance.
    def _pool_requests(self, d: int) -> int:
        return self.cfg.sweep_requests * d // self.n_d

    def _pool_size_searches(self) -> list[SearchProblem]:
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

    def _pool_size(self, rates: Sequence[float]) -> list[RunSpec]:
        return [
            self._run(
                "pool_size",
                "mixed-0",
                self._sweep_trace(rate, self._pool_requests(d)),
                self.history,
                (p, d),
                label,
                seed,
                decode_pool=d,
            )
            for (p, d), rate in zip(self.sizes, rates, strict=True)
            for seed in self.cfg.seeds
            for label in SWEEP_LABELS
        ]

    def _heterogeneity_searches(self) -> list[SearchProblem]:
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

    def _heterogeneity(self, rates: Sequence[float]) -> list[RunSpec]:
        return [
            self._run(
                "heterogeneity",
                f"lognormal-{sigma}",
                workload.rescale(t, rate),
                h,
                self.setup.split,
                label,
                seed,
                length_sigma=sigma,
            )
            for sigma, (t, h), rate in zip(
                self.cfg.heterogeneity, self.synthetic, rates, strict=True
            )
            for seed in self.cfg.seeds
            for label in SWEEP_LABELS
        ]

    def _scarcity(self) -> list[RunSpec]:
        return [
            self._run(
                "scarcity",
                "mixed-0",
                self._sweep_trace(self.rate * load),
                self.history,
                self.setup.split,
                label,
                seed,
                load=load,
            )
            for load in self.cfg.scarcity_loads
            for seed in self.cfg.seeds
            for label in SCARCITY_LABELS
        ]

    # Greedy placement herds when the router's view is stale: the study's collapse. The same
    # trace and rate, six views of the pool between scrapes (HERDING_VIEWS).
    def _herding(self) -> list[RunSpec]:
        trace = self._sweep_trace(self.rate)
        return [
            self._run(
                "herding",
                "mixed-0",
                trace,
                self.history,
                self.setup.split,
                label,
                seed,
                router=dataclasses.replace(self.setup.router, **change),
                view=view,
            )
            for view, change in HERDING_VIEWS.items()
            for seed in self.cfg.seeds
            for label in HERDING_LABELS
        ]

    # The rate 7 GPUs carry at the operating point; each GPU count at its best split for it.
    def _gpu_count_search(self) -> SearchProblem:
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

    def _gpu_count(self, rate7: float, *, workers: int | None) -> list[RunSpec]:
        trace = self._sweep_trace(rate7)
        candidates = {g: _near_split(g, self.n_p, self.n_d) for g in self.cfg.gpu_counts}
        probe = [
            self._run("split", "mixed-0", trace, self.history, split, SEARCH_POLICY, self.seed)
            for g in self.cfg.gpu_counts
            for split in candidates[g]
        ]
        goodput = iter(r["goodput"] for r in run_all(probe, workers=workers))
        specs: list[RunSpec] = []
        for gpus in self.cfg.gpu_counts:
            scored = [(next(goodput), -p, (p, d)) for p, d in candidates[gpus]]
            split = max(scored)[2]
            specs += [
                self._run(
                    "gpu_count",
                    "mixed-0",
                    trace,
                    self.history,
                    split,
                    label,
                    seed,
                    gpus=gpus,
                    rate_rps=round(rate7, 4),
                )
                for seed in self.cfg.seeds
                for label in SWEEP_LABELS
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
    """All experiments of the configured setups; returns the JSON document
    (``{"setups", "experiments", "findings"}``, see the module docstring)."""
    setups, specs = build_specs(cfg, workers=workers, progress=progress)
    flat = [s for group in specs.values() for s in group]
    rows = run_all(flat, workers=workers, progress=staged(progress, "experiments", len(flat)))
    experiments: dict[str, list[dict[str, Any]]] = {name: [] for name in EXPERIMENTS}
    for spec, row in zip(flat, rows, strict=True):
        experiments[spec.experiment].append(row)
    findings = paper_report.findings(experiments)
    return {"setups": setups, "experiments": experiments, "findings": findings}
