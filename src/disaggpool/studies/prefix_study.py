"""`disaggpool sim prefix`: prefix-cache-aware routing on traffic that reuses prompt prefixes.

One experiment, `experiments.prefix` in the JSON: every case is a trace x a prefill pool x a
cache size x a decode pool size, run at its own operating point, with every policy and seed.

* Traces: `mooncake` (the embedded Mooncake conversation trace, prompts clipped to 7,680 tokens
  and outputs to 512 so they fit the profile's 8,192-token context: 15 blocks of 512 at most,
  so only the leading part of each long conversation is shared), `sessions` (a generated
  workload: 8 tenants' 1,536-token system prompts, multi-turn sessions of mean 4 turns,
  `sim.prefix_workload`), and `azure` (the Azure 2023 conversation trace, no block ids: nothing
  to hit, what the cache term costs when there is nothing to gain).
* Pools: 8 prefill instances of `a40-llama3-8b`, `hetero` with every second one 1.6x as fast,
  or `homo`; 6 or 10 decode instances. With 6, Mooncake's long prompts fill the decode pods' KV
  first: at the operating point nearly every miss is a request that waited for room on a decode
  pod after its prefill, so the prefill pool, which this experiment is about, hardly matters
  (on the heterogeneous pool no request missed its TTFT in the prefill). With 10 the prefill
  pool limits. Both are reported: the first is where KV balance decides, the second where
  prefix placement and prefill speed do. The router scrapes every second.
* Cache sizes: `gpu`, the prefill instances' own KV capacity (190,000 tokens); `offload`, eight
  times that (a CPU/disk tier as large as LMCache-style offloading gives), applied to the
  engines and to what the router believes alike.
* Load: the rate at which the best cache-blind baseline (`least_loaded` or `length`, whichever
  carries more) attains 0.85 goodput, by the one operating-point search.
* Binding: each policy chooses the decode instance when its router does (`POLICIES`): ours
  when the prefill leg answers, the front door's default; the peers as their routers do.
* Policies: cache-blind `least_loaded`, `length` and `calibrated_blind` (our calibrated policy
  with a router that keeps no prefix index); cache-aware `cache_aware` (vLLM's router),
  `dynamo_kv` (Dynamo's KV router) and `llmd_weighted` (llm-d's weighted prefix, KV and queue
  scorers) from `core.policies.prefix_baselines`; and `calibrated`, whose
  router keeps the approximate prefix index and whose cost model credits each instance's cached
  prefix in seconds, with its P/D decider on (its default) and off (`calibrated_no_pd`). The
  engines cache prompt blocks in every run: only what the router knows differs.

Rows: ``{"trace", "pool", "cache", "cache_blocks", "decode_pods", "policy", "seed", "rate_rps",
"goodput", "prefix_hit", "ttft_p99_s", ...}`` (the runner's row plus these). Findings: per case
the mean goodput and hit share of each policy, and calibrated's gap to the best policy not
ours.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
from collections.abc import Sequence
from typing import Any

from disaggpool.core.contracts import SLOClass
from disaggpool.core.hardware import builtin_profile
from disaggpool.core.policies.registry import PolicyOptions
from disaggpool.core.profile import CalibrationProfile
from disaggpool.formats.embedded import embedded_trace
from disaggpool.formats.traces import TraceRequest
from disaggpool.sim import workload
from disaggpool.sim.cluster import InstanceSpec, RouterOptions
from disaggpool.sim.operating_point import Progress, SearchProblem, operating_rates
from disaggpool.sim.pools import perturbed
from disaggpool.sim.prefix_workload import PrefixShape, prefix_sessions
from disaggpool.sim.runner import RunSpec, run_all, staged

__all__ = ["POLICIES", "PrefixConfig", "run_prefix"]

PROFILE = "a40-llama3-8b"
SLO = (SLOClass("chat", 3.0, 0.1),)  # interactive chat on long prompts: TTFT decides
MAX_PROMPT, MAX_OUTPUT = 7680, 512
FAST = 1.6
BLIND = ("least_loaded", "length")
# Where each trace's operating point is searched (req/s): wide enough for both pool kinds.
BRACKETS = {"mooncake": (0.5, 20.0), "sessions": (2.0, 60.0), "azure": (5.0, 200.0)}

# Row label -> (policy, the router keeps a prefix index, the P/D decider is on, the decode pod is
# chosen when the prefill leg answers). Each binds as its router does: ours (and the cache-blind
# baselines, run in our front door) late, our default; Dynamo's PrefillRouter also chooses the
# decode worker after the prefill (its disaggregation design document); vllm-router chooses the
# pair up front (the request id it sends to the prefill pod names the decode pod), and so does
# llm-d's endpoint picker (one scheduling cycle picks both).
POLICIES: dict[str, tuple[str, bool, bool, bool]] = {
    "least_loaded": ("least_loaded", False, False, True),
    "length": ("length", False, False, True),
    "calibrated_blind": ("calibrated", False, True, True),
    "cache_aware": ("cache_aware", True, False, False),
    "dynamo_kv": ("dynamo_kv", True, False, True),
    "llmd_weighted": ("llmd_weighted", True, False, False),
    "calibrated": ("calibrated", True, True, True),
    "calibrated_no_pd": ("calibrated", True, False, True),
}


@dataclasses.dataclass(frozen=True)
class PrefixConfig:
    """Sizes of the experiment; `quick()` runs every case small."""

    requests: int = 4000
    seeds: tuple[int, ...] = (1, 2, 3)
    traces: tuple[str, ...] = ("mooncake", "sessions", "azure")
    pools: tuple[str, ...] = ("hetero", "homo")
    caches: tuple[str, ...] = ("gpu", "offload")
    decode_pools: tuple[int, ...] = (6, 10)
    search_steps: int = 8
    n_prefill: int = 8

    @classmethod
    def quick(cls) -> PrefixConfig:
        return cls(requests=600, seeds=(1,), search_steps=5)


def run_prefix(
    cfg: PrefixConfig, *, workers: int | None = None, progress: Progress | None = None
) -> dict[str, Any]:
    """Every case at its operating point, every policy and seed; the JSON document."""
    cases = [
        (t, p, c, d)
        for t in cfg.traces
        for p in cfg.pools
        for c in cfg.caches
        for d in cfg.decode_pools
    ]
    traces = {name: _trace(name, cfg.requests) for name in cfg.traces}
    problems = [
        SearchProblem(
            _spec(cfg, traces[t], t, p, c, d, policy, cfg.seeds[0]),
            0.85,
            low=BRACKETS[t][0],
            high=BRACKETS[t][1],
        )
        for t, p, c, d in cases
        for policy in BLIND
    ]
    rates = operating_rates(problems, steps=cfg.search_steps, workers=workers, progress=progress)
    specs = []
    for k, (t, p, c, d) in enumerate(cases):
        rate = max(rates[k * len(BLIND) : (k + 1) * len(BLIND)])
        trace = tuple(workload.rescale(traces[t], rate))
        for label in POLICIES:
            for seed in cfg.seeds:
                spec = _spec(cfg, trace, t, p, c, d, label, seed)
                specs.append(dataclasses.replace(spec, extra=(*spec.extra, ("rate_rps", rate))))
    rows = run_all(specs, workers=workers, progress=staged(progress, "runs", len(specs)))
    return {
        "config": dataclasses.asdict(cfg),
        "experiments": {"prefix": rows},
        "findings": {"prefix": findings(rows)},
    }


def findings(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per case: mean goodput and hit share by policy, and calibrated's gap to the best policy
    that is not one of ours."""
    out: dict[str, Any] = {}
    keys = sorted({(r["trace"], r["pool"], r["cache"], r["decode_pods"]) for r in rows})
    for key in keys:
        mine = [r for r in rows if (r["trace"], r["pool"], r["cache"], r["decode_pods"]) == key]
        means = {
            label: round(statistics.mean(r["goodput"] for r in mine if r["policy"] == label), 4)
            for label in POLICIES
            if any(r["policy"] == label for r in mine)
        }
        hits = {
            label: round(statistics.mean(r["prefix_hit"] for r in mine if r["policy"] == label), 4)
            for label in means
        }
        others = {k: v for k, v in means.items() if not k.startswith("calibrated")}
        best = max(others, key=lambda k: others[k])
        trace, pool, cache, decode_pods = key
        out[f"{trace}/{pool}/{cache}/{decode_pods}d"] = {
            "rate_rps": round(mine[0]["rate_rps"], 3),
            "means": means,
            "prefix_hit": hits,
            "best_other": best,
            "gap_points": round(100 * (means["calibrated"] - others[best]), 2),
        }
    return out


def _spec(
    cfg: PrefixConfig,
    trace: Sequence[TraceRequest],
    trace_name: str,
    pool: str,
    cache: str,
    decode_pods: int,
    label: str,
    seed: int,
) -> RunSpec:
    policy, index, pd_decider, late = POLICIES[label]
    scale = 8 if cache == "offload" else 1
    instances = _pool(cfg, pool, scale, decode_pods)
    capacity = instances[0].true_profile.kv_capacity_tokens
    return RunSpec(
        "prefix",
        trace_name,
        tuple(trace),
        instances,
        SLO,
        policy,
        seed,
        router=RouterOptions(scrape_interval_s=1.0, prefix_index=index, late_binding=late),
        options=PolicyOptions(pd_decider=pd_decider),
        label=label,
        prefix_caching=True,
        extra=(
            ("pool", pool),
            ("cache", cache),
            ("cache_blocks", capacity // 512),
            ("decode_pods", decode_pods),
        ),
    )


def _pool(
    cfg: PrefixConfig, kind: str, cache_scale: int, decode_pods: int
) -> tuple[InstanceSpec, ...]:
    """`cfg.n_prefill` prefill instances (every second one `FAST` times as fast in `hetero`),
    their KV capacity times `cache_scale`, and `decode_pods` decode instances; the router's
    beliefs carry the usual 3% fit error."""
    base = builtin_profile(PROFILE)
    rng = random.Random(f"prefix-pool:{kind}:{cache_scale}")
    out = []
    for i in range(cfg.n_prefill):
        speed = FAST if kind == "hetero" and i % 2 else 1.0
        true = _with_capacity(base.scaled(speed, name=f"prefill-{i}"), cache_scale)
        out.append(InstanceSpec(true.name, "prefill", true, perturbed(true, rng, 0.03)))
    for i in range(decode_pods):
        true = base.scaled(1.0, name=f"decode-{i}")
        out.append(InstanceSpec(true.name, "decode", true, perturbed(true, rng, 0.03)))
    return tuple(out)


def _with_capacity(profile: CalibrationProfile, scale: int) -> CalibrationProfile:
    return dataclasses.replace(profile, kv_capacity_tokens=profile.kv_capacity_tokens * scale)


def _trace(name: str, n: int) -> list[TraceRequest]:
    """The first `n` requests of trace `name` (module docstring), at their own arrival times."""
    if name == "mooncake":
        base = embedded_trace("mooncake-conversation")
        return workload.clip_lengths(base, MAX_PROMPT, MAX_OUTPUT)[:n]
    if name == "azure":
        base = embedded_trace("azure-conv")
        return workload.clip_lengths(base, MAX_PROMPT, MAX_OUTPUT)[:n]
    if name == "sessions":
        rng = random.Random("prefix:sessions")
        shape = PrefixShape(tenants=8, system_tokens=1536, turns_mean=4.0, think_s=10.0)
        messages = workload.lognormal_lengths(
            n, rng, prompt_mean=400, output_mean=250, sigma=1.0, slo_classes=[("", 1.0)]
        )
        starts = workload.poisson_arrivals(1.0 / shape.turns_mean, n, rng)
        trace = prefix_sessions(starts, messages, shape, rng)
        return workload.clip_lengths(trace, MAX_PROMPT, MAX_OUTPUT)
    raise ValueError(f"unknown trace {name!r}")
