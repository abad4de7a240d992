"""`disaggpool plan`: the fewest GPUs, and their prefill/decode split, that serve a scenario's
traffic at a target goodput, per routing policy.

Capacity planning on the user's own traffic and profiles: the scenario file of `sim run`
(SCENARIOS.md) gives the trace, the SLO classes, the policies, the seeds and the hardware. Its
pool's instances are the hardware to draw from, in the order listed: a plan with p prefill
instances takes the first p of the file's prefill instances, repeating the list when it needs
more (likewise decode), so a file listing faster cards first plans with them first.

For G = 2, 3, ... GPUs (one per instance) the planner simulates the split that maximises the
smaller pool capacity for the trace's mix (`sim.capacity.best_split`, the principle the paper
experiment uses) and its two neighbours, every policy and seed; a policy's plan is the smallest
G where some split reaches the target mean goodput over the seeds (ties: the higher goodput,
then more decode). G stops at `max_gpus` (default twice the file's pool): a policy that never
reaches the target says so.

Rows: ``{"policy", "gpus", "prefill", "decode", "seed", "goodput", ...}`` for every run;
findings: per policy the plan (``gpus``, ``prefill``, ``decode``, ``goodput``) or
``{"reached": false, "best": ...}``.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

from disaggpool.sim.capacity import best_split, pool_capacity
from disaggpool.sim.cluster import InstanceSpec
from disaggpool.sim.operating_point import Progress
from disaggpool.sim.runner import RunSpec, run_all, staged
from disaggpool.sim.scenario import Scenario

__all__ = ["candidate_splits", "plan_scenario", "pool_of"]


def pool_of(scenario: Scenario, prefill: int, decode: int) -> tuple[InstanceSpec, ...]:
    """`prefill` + `decode` instances drawn from the scenario's, in order, repeating."""
    out = []
    for role, n in (("prefill", prefill), ("decode", decode)):
        listed = [i for i in scenario.instances if i.role == role]
        for k in range(n):
            src = listed[k % len(listed)]
            name = f"{role}-{k}"
            true = dataclasses.replace(src.true_profile, name=name)
            believed = src.believed_profile
            out.append(
                InstanceSpec(
                    name,
                    role,
                    true,
                    None if believed is None else dataclasses.replace(believed, name=name),
                )
            )
    return tuple(out)


def candidate_splits(scenario: Scenario, gpus: int) -> list[tuple[int, int]]:
    """The capacity-balanced split of `gpus` and its neighbours (each role at least one)."""
    first = {i.role: i.true_profile for i in reversed(scenario.instances)}
    tpot = min(c.tpot_s for c in scenario.slo_classes)
    cap = pool_capacity(first["prefill"], scenario.trace, tpot)
    cap_decode = pool_capacity(first["decode"], scenario.trace, tpot)
    cap = dataclasses.replace(cap, decode_rps=cap_decode.decode_rps)
    p, _ = best_split(gpus, cap)
    return [(q, gpus - q) for q in sorted({p - 1, p, p + 1}) if 1 <= q <= gpus - 1]


def plan_scenario(
    scenario: Scenario,
    target: float,
    *,
    max_gpus: int | None = None,
    workers: int | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Every policy's plan for `scenario` at `target` goodput; the JSON document."""
    if not 0 < target <= 1:
        raise ValueError(f"target goodput must be in (0, 1], got {target!r}")
    limit = max_gpus or 2 * len(scenario.instances)
    if limit < 2:
        raise ValueError(f"max_gpus must be at least 2, got {limit}")
    rows: list[dict[str, Any]] = []
    plans: dict[str, Any] = {}
    bases = {(s.policy, s.seed): s for s in scenario.specs()}
    for policy in scenario.policies:
        best: dict[str, Any] | None = None  # the highest goodput seen, for a plan not reached
        plan: dict[str, Any] | None = None
        for gpus in range(2, limit + 1):
            splits = candidate_splits(scenario, gpus)
            specs = [
                _spec(scenario, bases[policy, seed], p, d)
                for p, d in splits
                for seed in scenario.seeds
            ]
            tick = staged(progress, f"{policy}, {gpus} GPUs", len(specs))
            got = run_all(specs, workers=workers, progress=tick)
            rows += got
            cands = [
                {
                    "gpus": gpus,
                    "prefill": p,
                    "decode": d,
                    "goodput": round(
                        statistics.fmean(
                            r["goodput"] for r in got if (r["prefill"], r["decode"]) == (p, d)
                        ),
                        4,
                    ),
                }
                for p, d in splits
            ]
            top = max(cands, key=lambda c: (c["goodput"], c["decode"]))
            if best is None or top["goodput"] > best["goodput"]:
                best = top
            if top["goodput"] >= target:
                plan = top
                break
        assert best is not None
        plans[policy] = {"reached": True, **plan} if plan else {"reached": False, "best": best}
    return {
        "config": {"scenario": scenario.name, "target_goodput": target, "max_gpus": limit},
        "experiments": {"plan": rows},
        "findings": {"plan": plans},
    }


def _spec(scenario: Scenario, base: RunSpec, prefill: int, decode: int) -> RunSpec:
    """The scenario's run `base` (a policy and seed) on a pool of `prefill` + `decode`."""
    return dataclasses.replace(
        base,
        experiment="plan",
        instances=pool_of(scenario, prefill, decode),
        extra=(("gpus", prefill + decode), ("prefill", prefill), ("decode", decode)),
    )


def tables(doc: dict[str, Any]) -> str:
    """Markdown: each policy's plan."""
    target = doc["config"]["target_goodput"]
    lines = [
        f"fewest GPUs reaching goodput {target} ({doc['config']['scenario']})",
        "| policy | GPUs | prefill | decode | goodput |",
        "|---|---|---|---|---|",
    ]
    for policy, p in doc["findings"]["plan"].items():
        if p["reached"]:
            lines.append(
                f"| {policy} | {p['gpus']} | {p['prefill']} | {p['decode']} | {p['goodput']:.3f} |"
            )
        else:
            b = p["best"]
            lines.append(
                f"| {policy} | not within {doc['config']['max_gpus']} | | | best {b['goodput']:.3f}"
                f" ({b['prefill']}P+{b['decode']}D) |"
            )
    return "\n".join(lines)
