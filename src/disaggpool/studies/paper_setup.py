"""The setups of the paper experiment, the policies it compares, and the llama8b derivation.

Shared by both setups (``llama8b`` here, ``paper`` in `studies.paper_study`):

* `Setup`: the derived constants every run of one setup (and SLO level) shares; its runs are
  built by `paper_run` and its operating-point searches by `rate_search`. Every row carries the
  setup's name (``"setup"``) and, for the paper setup, its SLO level (``"slo"``).
* What the router knows: every run uses ``RouterOptions(scrape_interval_s=1.0)``, the sidecar's
  default scrape period (the router's own ledger and streamed tokens are exact), unless an
  experiment varies it; each row records it (``"router"``).
* `LABELS`: the policies compared, by the name a row carries: the baselines with their default
  switches, ``length+local<512`` (the length heuristic with a fixed 512-token local-prefill
  threshold: the simplest form of llm-d's and Dynamo's P/D decider, a peer-style baseline),
  ``calibrated`` and ``uncalibrated`` with the product's default switches (the P/D decider on;
  `core.policies.registry.default_options`), ``calibrated+priority`` (the same with
  `priority_scheduling`: engines scheduling by priority, requests predicted late yield), the
  study's weighted-sum scorer with calibrated or datasheet constants, ``calibrated_no_pd``
  (``calibrated`` with the P/D decider off). `BASELINES` are "the baselines" the findings
  compare against.
* `constant_error_runs`: the scorers of `ERROR_ARMS` fed constants off by `ERROR_FACTORS`.
* `solve_searches`: many setups' operating-point searches in one lockstep search.

The ``llama8b`` setup (`llama8b_setup`, `placement_searches`, `placed`), every constant chosen
once from the principles in `sim.capacity` and `sim.pools` and recorded in the output
(`Setup.describe`):

* Hardware: Llama-3-8B on A40 (`a40-llama3-8b`), per-instance speed spread 5%, probe fit error 3%.
* Traffic: the three mixed bursty traces of `studies.paper_traces`.
* Operating point: the paper reports baselines at 0.835-0.847 goodput, i.e. a pool run hot. We
  put every trace at *the rate at which round-robin attains 0.85 goodput* on it (found by
  bisection in the simulator, `sim.operating_point`). The policy used to find it knows nothing,
  so the operating point favours none of the policies compared, and traces with different length
  mixes are equally hot.
* Pool: 8 GPUs. The prefill/decode split is found the way DistServe places instances: for every
  split, the rate at which round-robin attains 0.85 goodput (averaged over the three traces); the
  split carrying the most traffic wins (ties to more decode instances). The analytic bottleneck
  (`capacity.best_split`) is only the bracket of that search (and, with
  `PaperConfig.split_window`, its centre: ``--quick`` searches only the nearby splits).
* SLO targets: multiples of unloaded latency (`sim.capacity`).

Called by `studies.paper` and `studies.paper_study`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from disaggpool.core.contracts import SLOClass
from disaggpool.core.hardware import builtin_profile
from disaggpool.core.policies.registry import PolicyOptions, default_options
from disaggpool.core.profile import CalibrationProfile, DecodeModel
from disaggpool.core.stats import mean_or_nan
from disaggpool.formats.embedded import azure_services
from disaggpool.formats.traces import TraceRequest
from disaggpool.sim import capacity, workload
from disaggpool.sim.cluster import RouterOptions
from disaggpool.sim.operating_point import Progress, SearchProblem, operating_rates
from disaggpool.sim.pools import build_pool
from disaggpool.sim.runner import RunSpec
from disaggpool.studies.paper_config import PaperConfig
from disaggpool.studies.paper_traces import mixed_trace

__all__ = [
    "BASELINES",
    "ERROR_ARMS",
    "ERROR_FACTORS",
    "LABELS",
    "SEARCH_POLICY",
    "SWEEP_LABELS",
    "Arm",
    "Setup",
    "constant_error_runs",
    "decode_scaled",
    "llama8b_setup",
    "make_setup",
    "paper_run",
    "placed",
    "placement_searches",
    "placement_splits",
    "rate_search",
    "solve_searches",
]

SEARCH_POLICY = "round_robin"
"""The policy whose goodput defines an operating point: it knows nothing, so favours none."""


@dataclasses.dataclass(frozen=True)
class Arm:
    """A registered policy with its switches: what a row's ``policy`` label stands for."""

    policy: str
    options: PolicyOptions = dataclasses.field(default_factory=PolicyOptions)


def _product(policy: str) -> Arm:
    """A calibrated-family policy with the switches the product runs it with."""
    return Arm(policy, default_options(policy))


LABELS: dict[str, Arm] = {
    "round_robin": Arm("round_robin"),
    "random": Arm("random"),
    "least_loaded": Arm("least_loaded"),
    "length": Arm("length"),
    "p2c": Arm("p2c"),
    "length+local<512": Arm("length", PolicyOptions(local_prefill_below=512)),
    "calibrated": _product("calibrated"),
    "calibrated+priority": Arm(
        "calibrated",
        dataclasses.replace(default_options("calibrated"), priority_scheduling=True),
    ),
    "calibrated_greedy": _product("calibrated_greedy"),
    "uncalibrated": _product("uncalibrated"),
    "study_weighted": Arm("study_weighted"),
    "study_weighted_datasheet": Arm("study_weighted_datasheet"),
    "calibrated_no_pd": Arm("calibrated"),
}
"""Row label -> policy and switches (see the module docstring)."""

ERROR_FACTORS = (0.1351, 0.5, 1.0, 2.0, 7.4)
"""The `constant_error` experiment's uniform errors of the decode constants (factor x every one
of d0, d1, d2): 1/7.4 is the study's own, whose simulator-derived decode step was 7.4x too small."""

ERROR_ARMS: dict[str, Arm] = {
    "seconds": LABELS["uncalibrated"],
    "seconds_no_pd": Arm("uncalibrated", PolicyOptions()),
    "weighted_sum": LABELS["study_weighted_datasheet"],
}
"""The scorers fed the erroneous constants: ours with and without the P/D decider, the study's."""

BASELINES = ("round_robin", "least_loaded", "length", "p2c")
""""The baselines" of the findings (random is run and reported, but not counted among them)."""

SWEEP_LABELS = ("round_robin", "least_loaded", "length", "calibrated")
"""The labels every sweep (and both setups' GPU-count experiment) compares."""


@dataclasses.dataclass(frozen=True)
class Setup:
    """The derived constants every run of one setup (and, for the paper setup, SLO level) shares.

    `rates` are per trace: the rate at which round-robin attains the target goodput on it.
    `split_rates` (llama8b only): prefill instances -> mean such rate over the traces.
    """

    name: str
    nominal: CalibrationProfile
    datasheet: CalibrationProfile
    slo: tuple[SLOClass, ...]
    cap: capacity.PoolCapacity
    split: tuple[int, int]
    rates: tuple[float, ...]
    traces: tuple[tuple[TraceRequest, ...], ...]
    histories: tuple[tuple[TraceRequest, ...], ...]
    router: RouterOptions
    slo_level: str = ""  # "tight" or "loose" for the paper setup
    split_rates: dict[int, float] = dataclasses.field(default_factory=dict)

    @property
    def tightest_tpot_s(self) -> float:
        """The tightest TPOT target of the SLO classes (it bounds the decode batch)."""
        return min(c.tpot_s for c in self.slo)

    @property
    def key(self) -> str:
        """``llama8b``, ``paper/tight`` or ``paper/loose``: how findings name the group."""
        return f"{self.name}/{self.slo_level}" if self.slo_level else self.name

    def tags(self) -> dict[str, str]:
        """The fields every row of this setup carries."""
        return {"setup": self.name, **({"slo": self.slo_level} if self.slo_level else {})}

    def describe(self, cfg: PaperConfig) -> dict[str, Any]:
        """The llama8b block of the document's ``setups``."""
        return {
            "profile": self.nominal.name,
            "datasheet": self.datasheet.name,
            "target_goodput": cfg.target_goodput,
            "router": dataclasses.asdict(self.router),
            "gpus": sum(self.split),
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
            "trace_cvs": list(cfg.trace_cvs),
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
    label: str,
    seed: int,
    *,
    arm: Arm | None = None,
    router: RouterOptions | None = None,
    predictor: str = "online",
    speed_sigma: float = 0.05,
    **extra: Any,
) -> RunSpec:
    """One run on a pool of the setup's hardware; its row's ``policy`` is `label`.

    `arm` defaults to ``LABELS[label]``; `router` to the setup's. `extra` goes into the row,
    after the setup's tags.
    """
    chosen = arm or LABELS[label]
    return RunSpec(
        experiment=experiment,
        trace_name=trace_name,
        trace=tuple(trace),
        instances=tuple(
            build_pool(n_prefill, n_decode, setup.nominal, seed, speed_sigma=speed_sigma)
        ),
        slo_classes=setup.slo,
        policy=chosen.policy,
        seed=seed,
        datasheet=setup.datasheet,
        predictor=predictor,
        history=tuple(history),
        router=setup.router if router is None else router,
        options=chosen.options,
        label=label,
        extra=tuple(setup.tags().items()) + tuple(sorted(extra.items())),
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
    router: RouterOptions | None = None,
) -> SearchProblem:
    """The operating-point search of one trace on one pool: round-robin at the target goodput.

    `guess` is the analytic bottleneck capacity; the bracket is 0.2x to 2x of it. `limit`
    searches on the first `limit` requests only (the sweeps). `router` defaults to the setup's.
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
        router=router,
    )
    return SearchProblem(run, cfg.target_goodput, 0.2 * guess, 2.0 * guess, limit=limit)


def solve_searches(
    groups: Mapping[str, Sequence[SearchProblem]],
    *,
    steps: int,
    workers: int | None = None,
    progress: Progress | None = None,
) -> dict[str, list[float]]:
    """The operating rates of every group of searches, found in one lockstep search (so that all
    runs of a bisection step run in parallel); per group, in problem order."""
    flat = [p for group in groups.values() for p in group]
    found = iter(operating_rates(flat, steps=steps, workers=workers, progress=progress))
    return {name: [next(found) for _ in group] for name, group in groups.items()}


def llama8b_setup(cfg: PaperConfig) -> Setup:
    """The llama8b setup before placement: traces, SLO targets, analytic capacity.

    Its split and rates come from `placement_searches` and `placed`.
    """
    nominal = builtin_profile(cfg.profile)
    services = azure_services()
    pairs = [mixed_trace(services, k, cfg) for k in range(len(cfg.trace_cvs))]
    all_requests = [r for t, _ in pairs for r in t]
    slo = capacity.slo_targets(nominal, all_requests)
    tightest = min(c.tpot_s for c in slo.values())
    return Setup(
        name="llama8b",
        nominal=nominal,
        datasheet=builtin_profile(cfg.datasheet),
        slo=tuple(slo.values()),
        cap=capacity.pool_capacity(nominal, all_requests, tightest),
        split=(0, 0),
        rates=(),
        traces=tuple(tuple(t) for t, _ in pairs),
        histories=tuple(tuple(h) for _, h in pairs),
        router=RouterOptions(scrape_interval_s=cfg.scrape_interval_s),
    )


def placement_splits(setup: Setup, cfg: PaperConfig) -> list[int]:
    """The prefill instance counts the placement search tries (all, or those near analytic)."""
    splits = range(1, cfg.gpus)
    if cfg.split_window is None:
        return list(splits)
    centre = capacity.best_split(cfg.gpus, setup.cap)[0]
    return [p for p in splits if abs(p - centre) <= cfg.split_window]


def placement_searches(setup: Setup, cfg: PaperConfig) -> list[SearchProblem]:
    """Placement search: for every split tried, every trace's operating-point search."""
    return [
        rate_search(
            setup,
            cfg,
            trace,
            history,
            p,
            cfg.gpus - p,
            capacity.bottleneck_rps(
                p,
                cfg.gpus - p,
                capacity.pool_capacity(setup.nominal, trace, setup.tightest_tpot_s),
            ),
        )
        for p in placement_splits(setup, cfg)
        for trace, history in zip(setup.traces, setup.histories, strict=True)
    ]


def placed(setup: Setup, cfg: PaperConfig, found: Sequence[float]) -> Setup:
    """The setup with the split carrying the most traffic at the operating point and its rates.

    `found` are the rates of `placement_searches`, in its order.
    """
    n_traces = len(setup.traces)
    splits = placement_splits(setup, cfg)
    per_trace = {p: found[i * n_traces : (i + 1) * n_traces] for i, p in enumerate(splits)}
    per_split = {p: mean_or_nan(rates) for p, rates in per_trace.items()}
    best = max(per_split, key=lambda p: (round(per_split[p], 6), -p))
    return dataclasses.replace(
        setup, split=(best, cfg.gpus - best), rates=tuple(per_trace[best]), split_rates=per_split
    )


def make_setup(
    cfg: PaperConfig, *, workers: int | None = None, progress: Progress | None = None
) -> Setup:
    """The llama8b setup, placed (its placement search run on its own)."""
    setup = llama8b_setup(cfg)
    found = operating_rates(
        placement_searches(setup, cfg),
        steps=cfg.bisection_steps,
        workers=workers,
        progress=progress,
    )
    return placed(setup, cfg, found)


def decode_scaled(profile: CalibrationProfile, factor: float) -> CalibrationProfile:
    """`profile` with every decode constant `factor` times its value: a uniform error."""
    d = profile.decode
    return dataclasses.replace(
        profile,
        name=f"{profile.name}-decode-x{factor:g}",
        decode=DecodeModel(d.d0 * factor, d.d1 * factor, d.d2 * factor),
    )


def constant_error_runs(setup: Setup, cfg: PaperConfig, traces: int) -> list[RunSpec]:
    """The `constant_error` experiment of one setup: every scorer of `ERROR_ARMS` scoring every
    pool with its nominal profile, decode constants off by each of `ERROR_FACTORS` (1.0: right
    on average, blind only to the instances' spread), on the first `traces` traces at their
    operating points. Rows carry ``"error_factor"``; their ``policy`` is the scorer's name."""
    return [
        paper_run(
            dataclasses.replace(setup, datasheet=decode_scaled(setup.nominal, factor)),
            "constant_error",
            f"mixed-{k}",
            workload.rescale(t, rate),
            h,
            *setup.split,
            scorer,
            seed,
            arm=arm,
            error_factor=factor,
            rate_rps=round(rate, 4),
        )
        for k, (t, h, rate) in enumerate(
            zip(setup.traces, setup.histories, setup.rates, strict=True)
        )
        if k < traces
        for factor in ERROR_FACTORS
        for seed in cfg.seeds
        for scorer, arm in ERROR_ARMS.items()
    ]
