"""What the demo runs: its pool, its trace, its policies, and the simulator runs that choose them.

Everything here is decided before any process starts (`disaggpool.demo` says why each choice is
what it is): the boards' hidden true profiles (`true_profiles`), the trace and its SLO class
(`demo_trace`), the simulator run that plays a policy on the pool (`simulated_run`), the rate of
round-robin's goodput point (`operating_rate`) and the placement of the boards that carries the
most traffic there (`placed_pool`). Pure apart from the simulator's worker processes.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence

from disaggpool.core.contracts import SLOClass
from disaggpool.core.hardware import builtin_profile
from disaggpool.core.policies.registry import DEFAULT_DECODE_BINDING, default_options
from disaggpool.core.prefix_index import leading_hit_tokens
from disaggpool.core.profile import CalibrationProfile
from disaggpool.formats.embedded import AZURE_2023_FILES, embedded_trace, read_embedded_trace
from disaggpool.formats.traces import TraceRequest
from disaggpool.sim import capacity, workload
from disaggpool.sim.cluster import InstanceSpec, RouterOptions
from disaggpool.sim.operating_point import SearchProblem, operating_rates
from disaggpool.sim.placement import Placement, best_placement, describe, placements
from disaggpool.sim.runner import RunSpec

__all__ = [
    "BOARDS",
    "DECODE_SPEEDS",
    "MIN_PODS_PER_ROLE",
    "MOONCAKE_DECODE_SPEEDS",
    "MOONCAKE_POLICIES",
    "MOONCAKE_PREFILL_SPEEDS",
    "POLICIES",
    "TARGET_GOODPUT",
    "TRACES",
    "DemoConfig",
    "PlacedPool",
    "demo_trace",
    "operating_rate",
    "placed_pool",
    "reusable_share",
    "simulated_run",
    "true_profiles",
]

POLICIES = ("calibrated", "round_robin", "least_loaded", "length")
# The demo's four boards, as speeds relative to the A40: two nominal, a throttled one and a
# faster one. Which of them prefill and which decode is the placement search's choice.
BOARDS = (1.0, 1.0, 0.55, 1.25)
# The fewest boards the placement search gives either role. The demo compares routing, and a
# role with one pod has no routing decision to make: on the search's unrestricted pick (3
# prefill + 1 decode) only the prefill leg is routed, and ten fresh 30 s runs told no policy
# apart (docs/results/demo.md). 1 searches every placement.
MIN_PODS_PER_ROLE = 2
DECODE_SPEEDS = (1.0, 0.55, 1.25)  # the decode boards of a fixed 1 + 3 pool (the peers bench)
TRACES = ("azure", "mooncake")
# --trace mooncake: the pool (prefix placement needs two prefill pods, one faster) and the
# policies (the cache-blind baselines and two peers' prefix rules beside ours).
MOONCAKE_PREFILL_SPEEDS = (1.0, 1.6)
MOONCAKE_DECODE_SPEEDS = (1.0, 0.55)
MOONCAKE_POLICIES = ("calibrated", "round_robin", "least_loaded", "cache_aware", "dynamo_kv")
MOONCAKE_CLIP = (7680, 64)  # prompt, output: within the profile's 8,192-token context
MAX_NUM_SEQS = 64
TARGET_GOODPUT = 0.85
JITTER = 0.03  # the emulator's default step jitter, used by the simulator too
SIM_SEEDS = 10
SCRAPE_INTERVAL_S = 0.5  # the sidecars' scrape interval, which the simulator plays too
# The sidecar's default, named here so the simulated side binds as the real one does.
DECODE_BINDING = DEFAULT_DECODE_BINDING
SEARCH_BRACKET = (0.5, 40.0)  # req/s: the operating-point search's bracket
SEARCH_STEPS = 14  # bisection steps: the bracket narrowed to 2.4 milli-req/s


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    duration_s: float = 30.0  # trace length
    budget_s: float = 20.0  # probe budget per pod
    policies: tuple[str, ...] = POLICIES
    seed: int = 0
    # Simulator runs per policy (seeds of the engines' step jitter) behind the predicted goodput
    # and its spread; at least 2. Fewer only make the prediction noisier (the tests use 2).
    sim_seeds: int = SIM_SEEDS
    # The boards the placement search assigns to the two roles (`sim.placement`), or, with
    # both `prefill_speeds` and `decode_speeds` set, a fixed pool: one pod per entry, at that
    # speed relative to the A40 (the tests use small fixed pools, which calibrate sooner).
    boards: tuple[float, ...] = BOARDS
    prefill_speeds: tuple[float, ...] | None = None
    decode_speeds: tuple[float, ...] | None = None
    trace: str = "azure"  # or "mooncake": prefix caching on, prefix index in every sidecar
    # The fewest boards the placement search gives either role (at most half the boards).
    min_pods_per_role: int = MIN_PODS_PER_ROLE

    def __post_init__(self) -> None:
        if (self.prefill_speeds is None) != (self.decode_speeds is None):
            raise ValueError("a fixed pool needs both prefill_speeds and decode_speeds")
        for field in ("boards", "decode_speeds", "prefill_speeds"):
            speeds = getattr(self, field)
            if speeds is not None and (not speeds or min(speeds) <= 0):
                raise ValueError(f"{field} must be positive, got {speeds}")
        if len(self.boards) < 2:
            raise ValueError(f"boards: a pool needs at least two, got {self.boards}")
        if self.min_pods_per_role < 1:
            raise ValueError(f"min_pods_per_role must be >= 1, got {self.min_pods_per_role}")
        if self.trace not in TRACES:
            raise ValueError(f"trace must be one of {', '.join(TRACES)}, got {self.trace!r}")
        if self.sim_seeds < 2:
            raise ValueError(
                f"sim_seeds must be >= 2 (a spread needs two runs), got {self.sim_seeds}"
            )

    @property
    def placements(self) -> list[Placement]:
        """The pools to choose from: the fixed one, or every placement of the boards that gives
        each role at least `min_pods_per_role` of them (or half of them, if there are fewer)."""
        if self.prefill_speeds is not None and self.decode_speeds is not None:
            return [(self.prefill_speeds, self.decode_speeds)]
        least = min(self.min_pods_per_role, len(self.boards) // 2)
        return [
            (prefill, decode)
            for prefill, decode in placements(self.boards)
            if min(len(prefill), len(decode)) >= least
        ]

    @property
    def prefix(self) -> bool:
        """Whether the pods cache prefixes (and so every router keeps a prefix index)."""
        return self.trace == "mooncake"


def true_profiles(
    decode_speeds: Sequence[float] = DECODE_SPEEDS, prefill_speeds: Sequence[float] = (1.0,)
) -> dict[str, tuple[str, CalibrationProfile]]:
    """pod name -> (role, hidden true profile): one prefill pod per speed, then one decode pod
    per speed."""
    base = dataclasses.replace(builtin_profile("a40-llama3-8b"), max_num_seqs=MAX_NUM_SEQS)
    pods: dict[str, tuple[str, CalibrationProfile]] = {}
    for i, speed in enumerate(prefill_speeds):
        name = f"prefill-{i}"
        pods[name] = ("prefill", base.scaled(speed, name=name))
    for i, speed in enumerate(decode_speeds):
        name = f"decode-{i}"
        pods[name] = ("decode", base.scaled(speed, name=name))
    return pods


def demo_trace(seed: int, trace_name: str = "azure") -> tuple[list[TraceRequest], SLOClass]:
    """2,000 requests of one class (arrivals rescaled later): Azure conversation lengths in bursty
    arrivals, or a contiguous slice of the Mooncake conversation trace, its own arrivals from 0
    and its prefix blocks (conversations reuse their prefixes only within a slice)."""
    rng = random.Random(f"demo:{seed}")
    if trace_name == "mooncake":
        reqs = workload.clip_lengths(embedded_trace("mooncake-conversation"), *MOONCAKE_CLIP)
        start = rng.randrange(0, max(1, len(reqs) - 2000))
        picked = reqs[start : start + 2000]
        t0 = picked[0].arrival_s
        trace = [
            dataclasses.replace(r, arrival_s=r.arrival_s - t0, slo_class="chat") for r in picked
        ]
    else:
        conv = read_embedded_trace(AZURE_2023_FILES["conv"], default_class="chat")
        lengths = workload.clip_lengths(conv, 2048, 256)
        start = rng.randrange(0, max(1, len(lengths) - 2000))
        picked = lengths[start : start + 2000]
        arrivals = workload.gamma_arrivals(1.0, 3.0, len(picked), rng)
        trace = workload.with_arrivals(picked, arrivals)
    nominal = builtin_profile("a40-llama3-8b")
    slo = capacity.slo_targets(nominal, trace)["chat"]
    return trace, slo


def reusable_share(trace: Sequence[TraceRequest]) -> float:
    """The share of the trace's prompt tokens one cache holding every earlier prompt would find
    (vLLM's lookup rule): the most any routing could hit. 0 for a trace without blocks."""
    seen: set[int] = set()
    hits = total = 0
    for r in trace:
        total += r.prompt_tokens
        if r.blocks:
            hits += leading_hit_tokens(r.blocks, r.prompt_tokens, r.block_tokens, seen)
            seen.update(r.blocks)
    return hits / total if total else 0.0


def simulated_run(
    pods: dict[str, tuple[str, CalibrationProfile]],
    believed: dict[str, CalibrationProfile],
    trace: Sequence[TraceRequest],
    slo: SLOClass,
    policy: str,
    seed: int,
    prefix: bool = False,
) -> RunSpec:
    """One simulator run of the demo pool: engines timed by the true profiles with the
    emulator's step jitter, the router believing `believed` (the fitted profiles; a pod missing
    from it has no profile, as before calibration); with `prefix`, the engines cache prefixes and
    the router keeps its prefix index."""
    instances = tuple(
        InstanceSpec(name, role, true, believed.get(name)) for name, (role, true) in pods.items()
    )
    return RunSpec(
        experiment="demo",
        trace_name="demo",
        trace=tuple(trace),
        history=(),
        instances=instances,
        policy=policy,
        predictor="online",
        slo_classes=(slo,),
        seed=seed,
        jitter=JITTER,
        # what the sidecar below runs: its scrape interval and the policy's default switches
        router=RouterOptions(
            scrape_interval_s=SCRAPE_INTERVAL_S,
            prefix_index=prefix,
            late_binding=DECODE_BINDING == "late",
        ),
        options=default_options(policy),
        prefix_caching=prefix,
    )


def _rate_search(
    pods: dict[str, tuple[str, CalibrationProfile]],
    trace: Sequence[TraceRequest],
    slo: SLOClass,
    duration_s: float,
    seed: int,
    prefix: bool,
) -> SearchProblem:
    """Round-robin's TARGET_GOODPUT point on the first `duration_s` seconds of `trace`, on the
    true pool `pods`."""
    run = simulated_run(pods, {}, trace, slo, "round_robin", seed, prefix)
    return SearchProblem(run, TARGET_GOODPUT, *SEARCH_BRACKET, horizon_s=duration_s)


def operating_rate(
    pods: dict[str, tuple[str, CalibrationProfile]],
    trace: Sequence[TraceRequest],
    slo: SLOClass,
    duration_s: float,
    seed: int,
    prefix: bool = False,
) -> tuple[float, list[TraceRequest]]:
    """The highest rate at which round-robin attains TARGET_GOODPUT on the first `duration_s`
    seconds of `trace`, and the trace at that rate (`sim.operating_point`, on the true pool)."""
    problem = _rate_search(pods, trace, slo, duration_s, seed, prefix)
    (rate,) = operating_rates([problem], steps=SEARCH_STEPS, workers=1)
    return rate, problem.trace_at(rate)


@dataclasses.dataclass(frozen=True)
class PlacedPool:
    """The pool the demo runs and how it was chosen."""

    pods: dict[str, tuple[str, CalibrationProfile]]
    rate: float  # round-robin's TARGET_GOODPUT point on it
    trace: list[TraceRequest]  # the demo's trace at that rate
    chosen: str  # `placement.describe` of it
    searched: dict[str, float]  # every placement searched -> its rate


def placed_pool(cfg: DemoConfig, trace: Sequence[TraceRequest], slo: SLOClass) -> PlacedPool:
    """The pool the demo runs, chosen as the paper run chooses its split: of `cfg.placements`,
    the one carrying the most traffic at round-robin's TARGET_GOODPUT point in the simulator
    (`sim.placement`)."""
    options = cfg.placements
    problems = [
        _rate_search(true_profiles(d, p), trace, slo, cfg.duration_s, cfg.seed, cfg.prefix)
        for p, d in options
    ]
    # Before any pod starts: the machine's cores are the search's.
    rates = operating_rates(problems, steps=SEARCH_STEPS, workers=None if len(options) > 1 else 1)
    best = best_placement(options, rates)
    prefill, decode = options[best]
    return PlacedPool(
        pods=true_profiles(decode, prefill),
        rate=rates[best],
        trace=problems[best].trace_at(rates[best]),
        chosen=describe(options[best]),
        searched={describe(o): round(r, 3) for o, r in zip(options, rates, strict=True)},
    )
