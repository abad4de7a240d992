"""`disaggpool sim paper`: the "Calibrate, Then Route" experiments, reproduced in our simulator.

Setup (every constant is chosen here once, from the principles in `sim.capacity` and
`sim.pools`, and recorded in the output's ``setup`` block):

* Hardware: Llama-3-8B on A40 (`a40-llama3-8b`), per-instance speed spread 5%, probe fit error 3%.
* Traffic: three *mixed bursty* traces. Trace k takes the requests of the Azure 2023
  conversation and code services in the same wall-clock window (minute 20k to 20k+W of each
  one-hour trace), interleaved in their real order with their real lengths (prompts clipped to the
  8k context); conversation requests are class ``chat``, code requests class ``code``. Arrival
  times come from a Gamma renewal process with inter-arrival CV 2, 3 and 4 for k = 0, 1, 2,
  rescaled to the target rate. Why not the real timestamps: the code service alone has an
  inter-arrival CV of 13 with 25 idle gaps of over 30 s; rescaled to a mean load, its bursts reach
  10-26x the pool's capacity, a regime in which no placement matters (the scarcity sweep covers
  overload explicitly). The output-length predictor is first fed 2,000 requests of the same
  services from outside the window (the history a running router has).
* Operating point: the paper reports baselines at 0.835-0.847 goodput, i.e. a pool run hot. We
  put every trace at *the rate at which round-robin attains 0.85 goodput* on it (found by
  bisection in the simulator). The policy used to find it knows nothing, so the operating point
  favours none of the policies compared, and traces with different length mixes are equally hot.
* Pool: 8 GPUs. The prefill/decode split is found the way DistServe places instances: for every
  split, the rate at which round-robin attains 0.85 goodput (averaged over the three traces); the
  split carrying the most traffic wins (ties to more decode instances). The analytic bottleneck
  (`capacity.best_split`) is only the bracket of that search.
* SLO targets: multiples of unloaded latency (`sim.capacity`).

Experiments: ``main`` (all policies x 3 traces x seeds), ``ablation`` (calibrated vs the same
scorer on datasheet constants, on pools with growing hardware speed spread), ``pool_size`` (3..16
decode instances, each pool at its own operating point),
``heterogeneity`` (log-normal length spread and SLO mix, each at its own operating point),
``scarcity`` (up to 3x the operating rate), ``gpu_count`` (4..8 GPUs at the rate 7 GPUs carry).
"""

from __future__ import annotations

import dataclasses
import gzip
import importlib.resources
import random
import statistics
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from disaggpool.core.contracts import SLOClass
from disaggpool.core.hardware import builtin_profile
from disaggpool.core.profile import CalibrationProfile
from disaggpool.formats.traces import TraceRequest, read_trace
from disaggpool.sim import capacity, report, workload
from disaggpool.sim.pools import build_pool
from disaggpool.sim.runner import RunSpec, run_all

__all__ = ["PaperConfig", "build_specs", "run_paper"]

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
TRACE_CVS = (2.0, 3.0, 4.0)
ABLATION_POLICIES = ("least_loaded", "uncalibrated", "calibrated")


@dataclasses.dataclass(frozen=True)
class PaperConfig:
    """Sizes of the experiment; `quick()` is the under-a-minute variant."""

    window_minutes: float = 12.0
    seeds: tuple[int, ...] = (1, 2, 3)
    target_goodput: float = 0.85
    bisection_steps: int = 8
    gpus: int = 8
    profile: str = "a40-llama3-8b"
    datasheet: str = "a40-llama3-8b-datasheet"
    max_prompt: int = 7168
    max_output: int = 1024
    history: int = 2000
    pool_sizes: tuple[int, ...] = (3, 4, 6, 8, 12, 16)
    heterogeneity: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5)
    scarcity_loads: tuple[float, ...] = (0.75, 1.0, 1.25, 1.5, 2.0, 3.0)
    gpu_counts: tuple[int, ...] = (4, 5, 6, 7, 8)
    sweep_requests: int = 4000
    hardware_spread: tuple[float, ...] = (0.05, 0.15, 0.3)

    @classmethod
    def quick(cls) -> PaperConfig:
        return cls(
            window_minutes=3.0,
            seeds=(1,),
            pool_sizes=(3, 6, 12),
            heterogeneity=(0.0, 1.0),
            hardware_spread=(0.05, 0.3),
            scarcity_loads=(1.0, 1.5, 3.0),
            gpu_counts=(5, 6, 7),
            sweep_requests=900,
            bisection_steps=6,
        )


# ----------------------------------------------------------------------------- traces


def _embedded(name: str) -> list[TraceRequest]:
    data = importlib.resources.files("disaggpool.data").joinpath(name).read_bytes()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / name.removesuffix(".gz")
        path.write_bytes(gzip.decompress(data))
        return read_trace(path)


def azure_services() -> dict[str, list[TraceRequest]]:
    """The embedded Azure 2023 traces, labelled with our SLO classes."""
    return {
        "chat": [
            dataclasses.replace(r, slo_class="chat") for r in _embedded("azure2023_conv.csv.gz")
        ],
        "code": [
            dataclasses.replace(r, slo_class="code") for r in _embedded("azure2023_code.csv.gz")
        ],
    }


def mixed_trace(
    services: dict[str, list[TraceRequest]], k: int, cfg: PaperConfig
) -> tuple[list[TraceRequest], list[TraceRequest]]:
    """Mixed trace k (window starting at minute 20k) and the predictor's warm-up history."""
    start = 20.0 * 60.0 * k
    duration = cfg.window_minutes * 60.0
    parts = [workload.window(reqs, start, duration) for reqs in services.values()]
    mixed = workload.clip_lengths(workload.merge(*parts), cfg.max_prompt, cfg.max_output)
    arrivals = workload.gamma_arrivals(1.0, TRACE_CVS[k], len(mixed), random.Random(f"mixed:{k}"))
    mixed = workload.with_arrivals(mixed, arrivals)
    outside = [
        r for reqs in services.values() for r in reqs if not start <= r.arrival_s < start + duration
    ]
    outside.sort(key=lambda r: r.arrival_s)
    history = workload.clip_lengths(outside[: cfg.history], cfg.max_prompt, cfg.max_output)
    return mixed, history


# ----------------------------------------------------------------------------- setup


@dataclasses.dataclass(frozen=True)
class Setup:
    nominal: CalibrationProfile
    datasheet: CalibrationProfile
    slo: tuple[SLOClass, ...]
    cap: capacity.PoolCapacity
    split: tuple[int, int]
    rates: tuple[float, ...]  # per trace: the rate at which round-robin attains the target goodput
    split_rates: dict[int, float]  # prefill instances -> mean such rate over the traces
    traces: tuple[tuple[TraceRequest, ...], ...]
    histories: tuple[tuple[TraceRequest, ...], ...]

    def describe(self, cfg: PaperConfig) -> dict[str, Any]:
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


def _spec(
    setup: Setup,
    cfg: PaperConfig,
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


def _scaled(trace: Sequence[TraceRequest], rate: float) -> list[TraceRequest]:
    return workload.rescale(trace, rate)


@dataclasses.dataclass(frozen=True)
class _Problem:
    """Find the rate at which round-robin attains the target goodput on one trace and pool."""

    trace: tuple[TraceRequest, ...]
    history: tuple[TraceRequest, ...]
    n_prefill: int
    n_decode: int
    guess: float  # analytic bottleneck capacity, brackets the search
    limit: int | None = None  # search on the first `limit` requests only (sweeps)
    speed_sigma: float = 0.05


Progress = Callable[[str, int, int], None]
"""progress(stage, done, total): called as a long run advances."""


def operating_rates(
    setup: Setup,
    cfg: PaperConfig,
    problems: Sequence[_Problem],
    *,
    workers: int | None = None,
    progress: Progress | None = None,
) -> list[float]:
    """Bisection, all problems in lockstep so every step runs in parallel.

    The rate of a problem is the highest rate found at which round-robin, the policy that knows
    nothing, still attains `cfg.target_goodput`: the pool's goodput capacity in DistServe's
    sense, measured with a neutral policy so that it favours none of the policies compared.
    """
    lo = [0.2 * p.guess for p in problems]
    hi = [2.0 * p.guess for p in problems]
    for step in range(cfg.bisection_steps):
        if progress:
            progress(f"operating points ({len(problems)} pools)", step, cfg.bisection_steps)
        mids = [(a + b) / 2 for a, b in zip(lo, hi, strict=True)]
        specs = [
            _spec(
                setup,
                cfg,
                "operating_point",
                "search",
                _head(_scaled(p.trace, m), p.limit or len(p.trace)),
                p.history,
                p.n_prefill,
                p.n_decode,
                "round_robin",
                cfg.seeds[0],
                speed_sigma=p.speed_sigma,
            )
            for p, m in zip(problems, mids, strict=True)
        ]
        for i, row in enumerate(run_all(specs, workers=workers)):
            if row["goodput"] >= cfg.target_goodput:
                lo[i] = mids[i]
            else:
                hi[i] = mids[i]
    if progress:
        progress(
            f"operating points ({len(problems)} pools)", cfg.bisection_steps, cfg.bisection_steps
        )
    return lo


def make_setup(
    cfg: PaperConfig, *, workers: int | None = None, progress: Progress | None = None
) -> Setup:
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
    # Placement search: every split, every trace; keep the split with the highest goodput capacity.
    problems = [
        _Problem(
            setup.traces[k],
            setup.histories[k],
            p,
            cfg.gpus - p,
            capacity.bottleneck_rps(
                p, cfg.gpus - p, capacity.pool_capacity(nominal, setup.traces[k], tightest)
            ),
        )
        for p in range(1, cfg.gpus)
        for k in range(3)
    ]
    found = operating_rates(setup, cfg, problems, workers=workers, progress=progress)
    per_split = {p: _mean(found[(p - 1) * 3 : p * 3]) for p in range(1, cfg.gpus)}
    best = max(per_split, key=lambda p: (round(per_split[p], 6), -p))
    rates = tuple(found[(best - 1) * 3 : best * 3])
    return dataclasses.replace(
        setup, split=(best, cfg.gpus - best), rates=rates, split_rates=per_split
    )


# ----------------------------------------------------------------------------- experiments


def build_specs(
    cfg: PaperConfig, setup: Setup, *, workers: int | None = None, progress: Progress | None = None
) -> dict[str, list[RunSpec]]:
    n_p, n_d = setup.split
    specs: dict[str, list[RunSpec]] = {}
    specs["main"] = [
        _spec(
            setup,
            cfg,
            "main",
            f"mixed-{k}",
            _scaled(t, setup.rates[k]),
            h,
            n_p,
            n_d,
            policy,
            seed,
            rate_rps=round(setup.rates[k], 4),
        )
        for k, (t, h) in enumerate(zip(setup.traces, setup.histories, strict=True))
        for seed in cfg.seeds
        for policy in ALL_POLICIES
    ]

    base, base_history = setup.traces[0], setup.histories[0]
    base_rate = setup.rates[0]
    seed0 = cfg.seeds[0]

    # Calibration matters most where instances differ: the same comparison on pools whose boards
    # spread more in speed (mixed clocks, thermal limits, degraded links).
    spread_rates = operating_rates(
        setup,
        cfg,
        [
            _Problem(base, base_history, n_p, n_d, base_rate, cfg.sweep_requests, speed_sigma=sigma)
            for sigma in cfg.hardware_spread
        ],
        workers=workers,
        progress=progress,
    )
    specs["ablation"] = [
        _spec(
            setup,
            cfg,
            "ablation",
            "mixed-0",
            _head(_scaled(base, rate), cfg.sweep_requests),
            base_history,
            n_p,
            n_d,
            policy,
            seed,
            speed_sigma=sigma,
            hardware_spread=sigma,
        )
        for sigma, rate in zip(cfg.hardware_spread, spread_rates, strict=True)
        for seed in cfg.seeds
        for policy in ABLATION_POLICIES
    ]

    # Each pool size at its own operating point, so that every size is compared equally hot.
    sizes = [(max(1, round(d * n_p / n_d)), d) for d in cfg.pool_sizes]
    pool_rates = operating_rates(
        setup,
        cfg,
        [
            _Problem(
                base,
                base_history,
                p,
                d,
                capacity.bottleneck_rps(p, d, setup.cap),
                cfg.sweep_requests * d // n_d,
            )
            for p, d in sizes
        ],
        workers=workers,
        progress=progress,
    )
    specs["pool_size"] = [
        _spec(
            setup,
            cfg,
            "pool_size",
            "mixed-0",
            _head(_scaled(base, rate), cfg.sweep_requests * d // n_d),
            base_history,
            p,
            d,
            policy,
            seed0,
            decode_pool=d,
        )
        for (p, d), rate in zip(sizes, pool_rates, strict=True)
        for policy in SWEEP_POLICIES
    ]

    synthetic = [_synthetic(base, sigma, cfg, seed0) for sigma in cfg.heterogeneity]
    tightest = min(c.tpot_s for c in setup.slo)
    het_rates = operating_rates(
        setup,
        cfg,
        [
            _Problem(
                tuple(t),
                tuple(h),
                n_p,
                n_d,
                capacity.bottleneck_rps(
                    n_p, n_d, capacity.pool_capacity(setup.nominal, t, tightest)
                ),
                cfg.sweep_requests,
            )
            for t, h in synthetic
        ],
        workers=workers,
        progress=progress,
    )
    specs["heterogeneity"] = [
        _spec(
            setup,
            cfg,
            "heterogeneity",
            f"lognormal-{sigma}",
            _scaled(t, rate),
            h,
            n_p,
            n_d,
            policy,
            seed0,
            length_sigma=sigma,
        )
        for sigma, (t, h), rate in zip(cfg.heterogeneity, synthetic, het_rates, strict=True)
        for policy in SWEEP_POLICIES
    ]

    specs["scarcity"] = [
        _spec(
            setup,
            cfg,
            "scarcity",
            "mixed-0",
            _head(_scaled(base, base_rate * load), cfg.sweep_requests),
            base_history,
            n_p,
            n_d,
            policy,
            seed0,
            load=load,
        )
        for load in cfg.scarcity_loads
        for policy in SCARCITY_POLICIES
    ]

    # The rate 7 GPUs carry at the operating point; each GPU count at its best split for that rate.
    p7, d7 = _near_split(7, n_p, n_d)[1]
    (rate7,) = operating_rates(
        setup,
        cfg,
        [
            _Problem(
                base,
                base_history,
                p7,
                d7,
                capacity.bottleneck_rps(p7, d7, setup.cap),
                cfg.sweep_requests,
            )
        ],
        workers=workers,
        progress=progress,
    )
    trace = _head(_scaled(base, rate7), cfg.sweep_requests)
    candidates = {g: _near_split(g, n_p, n_d) for g in cfg.gpu_counts}
    probe = [
        _spec(setup, cfg, "split", "mixed-0", trace, base_history, p, d, "round_robin", seed0)
        for g in cfg.gpu_counts
        for p, d in candidates[g]
    ]
    goodput = iter(r["goodput"] for r in run_all(probe, workers=workers))
    specs["gpu_count"] = []
    for gpus in cfg.gpu_counts:
        scored = [(next(goodput), -p, (p, d)) for p, d in candidates[gpus]]
        p, d = max(scored)[2]
        specs["gpu_count"] += [
            _spec(
                setup,
                cfg,
                "gpu_count",
                "mixed-0",
                trace,
                base_history,
                p,
                d,
                policy,
                seed0,
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


def _mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def _head(trace: Sequence[TraceRequest], n: int) -> list[TraceRequest]:
    return list(trace[: max(1, n)])


def _synthetic(
    base: Sequence[TraceRequest], sigma: float, cfg: PaperConfig, seed: int
) -> tuple[list[TraceRequest], list[TraceRequest]]:
    """Same means and arrival pattern as `base`, lengths log-normal with spread `sigma`.

    sigma = 0 is the homogeneous extreme: one request shape and one SLO class (chat); otherwise the
    SLO mix is half chat, half code.
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


# ----------------------------------------------------------------------------- driver


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
    experiments: dict[str, list[dict[str, Any]]] = {}
    for spec, row in zip(flat, rows, strict=True):
        experiments.setdefault(spec.experiment, []).append(row)
    order = ("main", "ablation", "pool_size", "heterogeneity", "scarcity", "gpu_count")
    ordered = {name: experiments[name] for name in order}
    return {
        "setup": setup.describe(cfg),
        "experiments": ordered,
        "findings": report.findings(ordered),
    }
