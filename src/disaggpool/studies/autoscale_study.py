"""`disaggpool sim autoscale`: autoscalers side by side on time-varying traffic.

One experiment, `experiments.autoscale` in the JSON: every traffic shape of
`studies.autoscale_traffic` (`diurnal`, `ramp`, `bursts`, `shift`, `mixshift`, `flash`,
`promptramp`) x every autoscaler of `core.autoscaling_baselines.AUTOSCALERS` x seeds, on the same
pool and the same routing policy (`calibrated` with a deployed router's switches, the P/D decider
on; the router scraping every second):

* Pool: the study's configuration, Qwen2.5-3B on A40s with a 60k-token KV budget
  (`a40-qwen2.5-3b`, where chat traffic is decode-bound), 1..4 prefill pods and 1..6 decode pods;
  every autoscaler starts from the static pool (4 + 6 serving), as a deployment that turns
  autoscaling on does. Each autoscaler scales decode (`make_autoscaler`) and prefill
  (`make_prefill_autoscaler`, its prefill counterpart, sized by the tightest TTFT target).
* Traffic: each shape peaks at the rate the largest pool serves at 75% of the capacity of the
  role the shape loads (`Shape.sized_by`), for chat at the lengths of its peak: decode capacity
  by `decode_capacity` (Little's law at the TPOT target); prefill capacity by
  `sim.capacity.pool_capacity` (a saturated chunked-prefill pipeline, from the profile's prefill
  constants). So `mixshift` runs at 75% of the decode pool with outputs x10, `promptramp` ends at
  75% of the prefill pool with prompts x4 (where decode must fit too), over `duration_s`.
* SLOs: the classes of `sim.capacity.slo_targets` for the Azure chat + code mix.
* Engines: vLLM's default first-come-first-served scheduling; `priority_scheduling` runs them
  by priority, the router giving priority 1 to the requests it predicts late. `pd_decider=False`
  turns the router's P/D decider off (`router.pdDecider: false`).
* Timing: a new decode pod serves `startup_s` after it is asked for (engine load and probe);
  the autoscalers act every 5 s on a 60 s window, scale down after a 120 s stabilisation window,
  and start with the shape's previous `history_s` of traffic in their window (arrivals and
  lengths, not simulated), as autoscalers that have been running would.

Rows: ``{"trace", "autoscaler", "seed", "goodput", "gpu_hours", "decode_gpu_hours",
"prefill_gpu_hours", "scale_events" (both roles), "max_decode", "mean_decode", "max_prefill",
"mean_prefill", "misses", "requests", "timeline"}``. Findings per
trace: each autoscaler's mean goodput and GPU-hours, and ours against the static peak pool and
against every other autoscaler within half a point of its goodput or above.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
from collections.abc import Callable, Sequence
from typing import Any, Literal

from disaggpool.core.autoscaling import Bounds, decode_capacity
from disaggpool.core.autoscaling_baselines import (
    AUTOSCALERS,
    Autoscaler,
    make_autoscaler,
    make_prefill_autoscaler,
)
from disaggpool.core.contracts import SLOClass
from disaggpool.core.hardware import builtin_profile
from disaggpool.core.policies.registry import (
    CALIBRATED_FAMILY,
    PolicyOptions,
    default_options,
    make_policy,
)
from disaggpool.core.predictor import make_predictor
from disaggpool.core.profile import CalibrationProfile
from disaggpool.formats.embedded import azure_services
from disaggpool.formats.traces import TraceRequest
from disaggpool.sim.capacity import pool_capacity, slo_targets
from disaggpool.sim.cluster import InstanceSpec, RouterOptions, SimOutcome, Simulation
from disaggpool.sim.elastic import ElasticController
from disaggpool.sim.metrics import summarize
from disaggpool.sim.operating_point import Progress
from disaggpool.sim.pools import perturbed
from disaggpool.sim.runner import run_all, staged
from disaggpool.sim.scenario import Scenario
from disaggpool.studies.autoscale_traffic import SHAPES, Shape, scaled_lengths, shaped_trace

__all__ = [
    "AutoscaleConfig",
    "AutoscaleSpec",
    "autoscale_row",
    "execute_autoscale",
    "run_autoscale",
    "run_scenario",
    "simulate_autoscale",
]

PROFILE = "a40-qwen2.5-3b"
PEAK_FILL = 0.75  # the peak as a share of the largest pool's capacity
EQUAL = 0.005  # goodputs closer than half a point are not told apart


@dataclasses.dataclass(frozen=True)
class AutoscaleConfig:
    """Sizes of the experiment; `quick()` runs every shape short, one seed."""

    duration_s: float = 1800.0
    seeds: tuple[int, ...] = (1, 2, 3)
    shapes: tuple[str, ...] = tuple(SHAPES)
    autoscalers: tuple[str, ...] = AUTOSCALERS
    n_prefill: int = 4  # the largest prefill pool, serving at first
    min_prefill: int = 1
    min_decode: int = 1
    max_decode: int = 6
    startup_s: float = 60.0
    stabilization_s: float = 120.0
    target_goodput: float = 0.99  # the static peak pool's own level: the aim is to match it
    min_headroom: float = 0.0  # ours' floor over the offered load (core.autoscaling)
    history_s: float = 600.0  # traffic every autoscaler remembers from before the run
    # The engines schedule by priority and the router yields late requests (off: the study's
    # setup, and vLLM's default).
    priority_scheduling: bool = False
    pd_decider: bool = True  # ours' P/D decider (a deployed router's default)

    @classmethod
    def quick(cls) -> AutoscaleConfig:
        """A smaller pool (2 prefill, up to 3 decode, so a lower peak) for 900 s, one seed."""
        return cls(duration_s=900.0, seeds=(1,), n_prefill=2, max_decode=3)


@dataclasses.dataclass(frozen=True)
class AutoscaleSpec:
    """One run: a trace, the pool that may run (pods beyond the starting pool on standby), an
    autoscaler and its bounds; `prefill_bounds`: the prefill pool's (None: prefill fixed)."""

    trace_name: str
    trace: tuple[TraceRequest, ...]
    instances: tuple[InstanceSpec, ...]
    slo_classes: tuple[SLOClass, ...]
    autoscaler: str
    bounds: Bounds
    seed: int
    target_goodput: float = 0.9
    policy: str = "calibrated"
    scrape_interval_s: float = 1.0
    history: tuple[TraceRequest, ...] = ()  # traffic before the run, in the window only
    prefill_bounds: Bounds | None = None
    min_headroom: float = 0.0
    priority_scheduling: bool = False
    pd_decider: bool = True


def execute_autoscale(spec: AutoscaleSpec) -> dict[str, Any]:
    """Run one spec; its JSON row."""
    outcome, controller = simulate_autoscale(spec)
    return autoscale_row(spec, outcome, controller)


#: What `simulate_autoscale` passes each role's autoscaler through: ("decode" or "prefill", the
#: autoscaler) -> the one that runs (a bench's wrapper; the study runs them as they are).
Wrap = Callable[[str, Autoscaler], Autoscaler]


def simulate_autoscale(
    spec: AutoscaleSpec, *, wrap: Wrap | None = None
) -> tuple[SimOutcome, ElasticController]:
    """Run one spec: what the simulation served, and the controller that scaled it; `wrap`: a
    wrapper around each role's autoscaler (`Wrap`)."""
    classes = {c.name: c for c in spec.slo_classes}
    decode = [i for i in spec.instances if i.role == "decode"]
    prefill = [i for i in spec.instances if i.role == "prefill"]
    believed = {i.name: i.believed_profile or i.true_profile for i in spec.instances}
    tpot = min(c.tpot_s for c in spec.slo_classes)
    scaler = make_autoscaler(
        spec.autoscaler,
        spec.bounds,
        [believed[i.name] for i in decode],
        tpot,
        spec.target_goodput,
        min_headroom=spec.min_headroom,
    )
    prefill_scaler = None
    if spec.prefill_bounds is not None:
        prefill_scaler = make_prefill_autoscaler(
            spec.autoscaler,
            spec.prefill_bounds,
            [believed[i.name] for i in prefill],
            min(c.ttft_s for c in spec.slo_classes),
            spec.target_goodput,
            min_headroom=spec.min_headroom,
        )
    if wrap is not None:
        scaler = wrap("decode", scaler)
        if prefill_scaler is not None:
            prefill_scaler = wrap("prefill", prefill_scaler)
    controller = ElasticController(
        scaler,
        _in_start_order(decode),
        believed,
        classes,
        prefill_pods=len(prefill),
        startup_s=spec.bounds.startup_s,
        prefill_autoscaler=prefill_scaler,
        prefill_names=_in_start_order(prefill),
    )
    priority = spec.priority_scheduling
    # The switches a deployed router runs the policy with (the P/D decider on for ours).
    options = dataclasses.replace(
        default_options(spec.policy),
        priority_scheduling=priority,
        pd_decider=spec.pd_decider and default_options(spec.policy).pd_decider,
    )
    sim = Simulation(
        spec.instances,
        policies=[make_policy(spec.policy, options=options)],
        predictor=make_predictor("online"),
        slo_classes=classes,
        default_class=spec.slo_classes[0].name,
        seed=spec.seed,
        router=RouterOptions(scrape_interval_s=spec.scrape_interval_s),
        controller=controller,
        scheduling="priority" if priority else "fcfs",
    )
    controller.attach(sim)
    controller.remember(spec.history)
    outcome = sim.run(spec.trace)
    controller.close(outcome.end_time)
    return outcome, controller


def autoscale_row(
    spec: AutoscaleSpec, outcome: SimOutcome, controller: ElasticController
) -> dict[str, Any]:
    """One run's JSON row (module docstring)."""
    summary = summarize(outcome, {c.name: c for c in spec.slo_classes})
    tl = controller.timeline
    pods = _pods(tl.serving, tl.starting, tl.draining)
    prefill_pods = _pods(tl.prefill_serving, tl.prefill_starting, tl.prefill_draining)
    end = max(outcome.end_time, 1e-9)
    return {
        "trace": spec.trace_name,
        "autoscaler": spec.autoscaler,
        "seed": spec.seed,
        "goodput": summary["goodput"],
        "gpu_hours": round(controller.gpu_s / 3600.0, 4),
        "decode_gpu_hours": round(controller.decode_gpu_s / 3600.0, 4),
        "prefill_gpu_hours": round(controller.prefill_gpu_s / 3600.0, 4),
        "scale_events": controller.scale_events,
        "max_decode": max(pods, default=0),
        "mean_decode": round(controller.decode_gpu_s / end, 3),
        "max_prefill": max(prefill_pods, default=0),
        "mean_prefill": round(controller.prefill_gpu_s / end, 3),
        "misses": summary["misses"],
        "requests": summary["requests"],
        "timeline": {
            "t": [round(t, 1) for t in tl.t],
            "decode_pods": pods,
            "prefill_pods": prefill_pods,
            "serving": tl.serving,
            "rate_rps": [round(r, 3) for r in tl.rate_rps],
        },
    }


def _in_start_order(instances: Sequence[InstanceSpec]) -> list[str]:
    """The names of `instances`, serving ones first: the order an autoscaler starts pods in."""
    return [i.name for i in sorted(instances, key=lambda i: i.standby)]


def _pods(serving: list[int], starting: list[int], draining: list[int]) -> list[int]:
    """Pods costing GPU time at each tick."""
    return [s + st + d for s, st, d in zip(serving, starting, draining, strict=True)]


def run_autoscale(
    cfg: AutoscaleConfig,
    *,
    workers: int | None = None,
    progress: Progress | None = None,
    run: Callable[[AutoscaleSpec], dict[str, Any]] = execute_autoscale,
) -> dict[str, Any]:
    """Every shape x autoscaler x seed; the JSON document. `run` makes each spec's row (a bench
    that reads more of a run than its row passes its own, built on `simulate_autoscale`)."""
    services = azure_services()
    profile = builtin_profile(PROFILE)
    mix = [r for rs in services.values() for r in rs]
    slo = slo_targets(profile, mix)
    tpot = min(c.tpot_s for c in slo.values())
    chat = services["chat"]
    peaks = {s: shape_peak(SHAPES[s], cfg, profile, chat, tpot) for s in cfg.shapes}
    bounds = Bounds(cfg.min_decode, cfg.max_decode, cfg.startup_s, cfg.stabilization_s)
    prefill_bounds = Bounds(cfg.min_prefill, cfg.n_prefill, cfg.startup_s, cfg.stabilization_s)
    specs = []
    for shape in cfg.shapes:
        for seed in cfg.seeds:
            both = shaped_trace(
                shape,
                peaks[shape],
                cfg.duration_s,
                services,
                seed,
                history_s=cfg.history_s,
                max_context=profile.max_model_len,
            )
            history = tuple(r for r in both if r.arrival_s < 0)
            trace = tuple(r for r in both if r.arrival_s >= 0)
            for name in cfg.autoscalers:
                specs.append(
                    AutoscaleSpec(
                        shape,
                        trace,
                        _pool(cfg, seed),
                        tuple(slo.values()),
                        name,
                        bounds,
                        seed,
                        cfg.target_goodput,
                        history=history,
                        prefill_bounds=prefill_bounds,
                        min_headroom=cfg.min_headroom,
                        priority_scheduling=cfg.priority_scheduling,
                        pd_decider=cfg.pd_decider,
                    )
                )
    tick = staged(progress, "runs", len(specs))
    rows = run_all(specs, workers=workers, progress=tick, run=run)
    return {
        "config": dataclasses.asdict(cfg),
        "setup": {
            "profile": PROFILE,
            # Chat's peak at the decode pool, that of the shapes that leave the lengths alone.
            "peak_rps": round(peak_rps(cfg, profile, chat, tpot), 3),
            "shape_peak_rps": {s: round(p, 3) for s, p in peaks.items()},
            "slo": _slo_doc(slo),
        },
        "experiments": {"autoscale": rows},
        "findings": {"autoscale": findings(rows)},
    }


def shape_peak(
    shape: Shape,
    cfg: AutoscaleConfig,
    profile: CalibrationProfile,
    chat: Sequence[TraceRequest],
    tpot_s: float,
) -> float:
    """The rate at `shape`'s peak (`peak_rps` at the lengths of its peak, for its role)."""
    return peak_rps(
        cfg,
        profile,
        chat,
        tpot_s,
        prompt_x=shape.peak_prompt_x,
        output_x=shape.peak_output_x,
        sized_by=shape.sized_by,
    )


def peak_rps(
    cfg: AutoscaleConfig,
    profile: CalibrationProfile,
    chat: Sequence[TraceRequest],
    tpot_s: float,
    *,
    prompt_x: float = 1.0,
    output_x: float = 1.0,
    sized_by: Literal["decode", "prefill"] = "decode",
) -> float:
    """`PEAK_FILL` of the capacity of the largest `sized_by` pool for chat with its lengths
    times the multipliers. A prefill-sized peak must leave the largest decode pool able to
    serve it (else the shape would test decode, not prefill)."""
    lengths = [
        scaled_lengths(r.prompt_tokens, r.output_tokens, prompt_x, output_x, profile.max_model_len)
        for r in chat
    ]
    decode = decode_capacity(
        profile,
        statistics.fmean(p for p, _ in lengths),
        statistics.fmean(o for _, o in lengths),
        tpot_s,
    )
    decode_rps = cfg.max_decode * decode.rps
    if sized_by == "decode":
        return PEAK_FILL * decode_rps
    at_peak = [TraceRequest(0.0, p, o) for p, o in lengths]
    peak = PEAK_FILL * cfg.n_prefill * pool_capacity(profile, at_peak, tpot_s).prefill_rps
    if peak > decode_rps:
        raise ValueError(
            f"a prefill-sized peak of {peak:.2f} req/s is over the decode pool's {decode_rps:.2f}"
        )
    return peak


def run_scenario(
    scenario: Scenario,
    *,
    workers: int | None = None,
    progress: Progress | None = None,
    run: Callable[[AutoscaleSpec], dict[str, Any]] = execute_autoscale,
) -> dict[str, Any]:
    """The autoscalers of the file's `autoscaling:` section on its own traffic: its pool is the
    starting pool (the static one serves `max_decode` throughout), decode pods beyond it are
    drawn from its decode instances in order, repeating; its prefill pods are the most that run,
    down to `min_prefill` when the section sets it (else all run throughout); the routing policy
    is `calibrated` when the file lists it, else its first, with the file's `router.pd_decider`
    and `router.priority_scheduling` (`run`: as `run_autoscale`'s)."""
    a = scenario.autoscaling
    if a is None:
        raise ValueError("the scenario has no autoscaling: section")
    policy = "calibrated" if "calibrated" in scenario.policies else scenario.policies[0]
    switches = scenario.options if policy in CALIBRATED_FAMILY else PolicyOptions()
    bounds = Bounds(a.min_decode, a.max_decode, a.startup_s, a.stabilization_s)
    prefill = [i for i in scenario.instances if i.role == "prefill"]
    prefill_bounds = None
    if a.min_prefill is not None:
        prefill_bounds = Bounds(a.min_prefill, len(prefill), a.startup_s, a.stabilization_s)
    decode = [i for i in scenario.instances if i.role == "decode"]
    extra = []
    for k in range(len(decode), a.max_decode):
        src = decode[k % len(decode)]
        name = f"decode-{k}"
        extra.append(
            InstanceSpec(
                name,
                "decode",
                dataclasses.replace(src.true_profile, name=name),
                src.believed_profile and dataclasses.replace(src.believed_profile, name=name),
                standby=True,
            )
        )
    specs = []
    for seed in scenario.seeds:
        for name in a.autoscalers:
            standby = [dataclasses.replace(e, standby=name != "static_peak") for e in extra]
            specs.append(
                AutoscaleSpec(
                    scenario.name,
                    scenario.trace,
                    (*prefill, *decode, *standby),
                    scenario.slo_classes,
                    name,
                    bounds,
                    seed,
                    a.target_goodput,
                    policy,
                    scenario.router.scrape_interval_s or 1.0,
                    prefill_bounds=prefill_bounds,
                    priority_scheduling=switches.priority_scheduling,
                    pd_decider=switches.pd_decider,
                )
            )
    tick = staged(progress, "runs", len(specs))
    rows = run_all(specs, workers=workers, progress=tick, run=run)
    return {
        "config": {"scenario": scenario.name, **dataclasses.asdict(a), "policy": policy},
        "experiments": {"autoscale": rows},
        "findings": {"autoscale": findings(rows)},
    }


def _slo_doc(slo: dict[str, SLOClass]) -> dict[str, Any]:
    return {n: {"ttft_s": c.ttft_s, "tpot_s": c.tpot_s} for n, c in slo.items()}


def _pool(cfg: AutoscaleConfig, seed: int) -> tuple[InstanceSpec, ...]:
    """`cfg.n_prefill` prefill pods and `cfg.max_decode` decode pods, all serving at first; the
    router believes each with the usual 3% fit error."""
    base = builtin_profile(PROFILE)
    rng = random.Random(f"autoscale-pool:{seed}")
    out = []
    for i in range(cfg.n_prefill):
        true = base.scaled(1.0, name=f"prefill-{i}")
        out.append(InstanceSpec(true.name, "prefill", true, perturbed(true, rng, 0.03)))
    for i in range(cfg.max_decode):
        true = base.scaled(1.0, name=f"decode-{i}")
        believed = perturbed(true, rng, 0.03)
        out.append(InstanceSpec(true.name, "decode", true, believed))
    return tuple(out)


def findings(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per trace: mean goodput and GPU-hours per autoscaler; ours against the static peak pool
    (goodput points, GPU-hours saved) and whether it used fewer GPU-hours than every other
    autoscaler that reached its goodput or better."""
    out: dict[str, Any] = {}
    for trace in dict.fromkeys(r["trace"] for r in rows):
        mine = [r for r in rows if r["trace"] == trace]
        names = list(dict.fromkeys(r["autoscaler"] for r in mine))
        good = {n: _mean(mine, n, "goodput") for n in names}
        hours = {n: _mean(mine, n, "gpu_hours") for n in names}
        f: dict[str, Any] = {"goodput": good, "gpu_hours": hours}
        if "disaggpool" in good:
            ours_g, ours_h = good["disaggpool"], hours["disaggpool"]
            if "static_peak" in good:
                f["vs_static_points"] = round(100 * (ours_g - good["static_peak"]), 2)
                f["gpu_hours_saved"] = round(1 - ours_h / hours["static_peak"], 4)
            # Within half a point is equal goodput (noise, at these sizes).
            rivals = [n for n in names if n != "disaggpool" and good[n] >= ours_g - EQUAL]
            f["cheaper_than_every_rival_at_equal_goodput"] = all(ours_h < hours[n] for n in rivals)
        out[trace] = f
    return out


def _mean(rows: Sequence[dict[str, Any]], name: str, key: str) -> float:
    return round(statistics.fmean(r[key] for r in rows if r["autoscaler"] == name), 4)
