"""How close any autoscaler that reacts to a change can come on `sim autoscale`'s two misses.

`mixshift` (outputs ten times longer at a constant rate from 600 s to 1,200 s of 1,800) and
`flash` (seven times the rate from 720 s to 840 s) change the traffic from one minute to the
next, and a new pod serves a cold start (60 s) after it is asked for. This bench runs ours on
each, three seeds, with **foresight**: from `lead` seconds before the change until it ends, both
roles ask for every pod their bounds allow (ours still decides every tick, and rules again after
the change). With a lead of 0 that is an autoscaler that knows the change the instant it
happens, better than any that must see it in the traffic: what it loses, every reactive
autoscaler starting from the same pool loses. A lead of one cold start has the pods serving as
the change arrives. Plain ours (no foresight) runs beside, on the same traces.

Run: ``PYTHONPATH=src .venv/bin/python bench/autoscale_foresight.py [--leads 0,30,60]
[--seeds 1,2,3] [--json FILE]`` (about 75 s on 2 cores). Its output is
`bench/autoscale_foresight.json`, quoted in docs/results/autoscaling.md ("How close").
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from pathlib import Path
from typing import Any

from disaggpool.core.autoscaling import Bounds, PoolState, ScaleDecision
from disaggpool.core.autoscaling_baselines import Autoscaler
from disaggpool.core.demand import Demand
from disaggpool.studies.autoscale_study import (
    AutoscaleConfig,
    AutoscaleSpec,
    autoscale_row,
    run_autoscale,
    simulate_autoscale,
)
from disaggpool.studies.autoscale_traffic import FLASH_AT, FLASH_S

DURATION_S = AutoscaleConfig().duration_s
#: Each shape's change, (start, end) in seconds of the study's default run.
CHANGES = {
    "mixshift": (DURATION_S / 3, 2 * DURATION_S / 3),
    "flash": (FLASH_AT * DURATION_S, FLASH_AT * DURATION_S + FLASH_S),
}


class Foresight:
    """`inner`, except that from `start - lead` to `end` it asks for `bounds.max_replicas`."""

    def __init__(
        self, inner: Autoscaler, bounds: Bounds, start: float, end: float, lead: float
    ) -> None:
        self.inner, self.bounds = inner, bounds
        self.start, self.end, self.lead = start, end, lead
        self.name = f"{inner.name} with {lead:g} s of foresight"

    def decide(self, demand: Demand, pool: PoolState) -> ScaleDecision:
        own = self.inner.decide(demand, pool)  # every tick, so its windows stay current
        if self.start - self.lead <= demand.now < self.end:
            return ScaleDecision(self.bounds.max_replicas, "foresight: the change is coming")
        return own


def _wrap(spec: AutoscaleSpec, lead: float, role: str, scaler: Autoscaler) -> Autoscaler:
    bounds = spec.bounds if role == "decode" else spec.prefill_bounds
    assert bounds is not None
    start, end = CHANGES[spec.trace_name]
    return Foresight(scaler, bounds, start, end, lead)


def run(spec: AutoscaleSpec, *, lead: float | None) -> dict[str, Any]:
    """The study's row for `spec` (no timeline), ours as it is or with `lead` s of foresight."""
    wrap = None if lead is None else functools.partial(_wrap, spec, lead)
    outcome, controller = simulate_autoscale(spec, wrap=wrap)
    row = autoscale_row(spec, outcome, controller)
    del row["timeline"]
    return {"lead_s": lead, **row}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--leads", default="0,30,60", help="seconds of foresight, comma-separated")
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    started = time.time()
    seeds = tuple(int(s) for s in args.seeds.split(","))
    leads: list[float | None] = [None, *(float(x) for x in args.leads.split(","))]
    rows: list[dict[str, Any]] = []
    for lead in leads:
        # The static pool runs once, beside plain ours; foresight is ours' alone.
        names = ("static_peak", "disaggpool") if lead is None else ("disaggpool",)
        cfg = AutoscaleConfig(shapes=tuple(CHANGES), autoscalers=names, seeds=seeds)
        doc = run_autoscale(cfg, workers=args.workers, run=functools.partial(run, lead=lead))
        rows += doc["experiments"]["autoscale"]
        print(f"foresight {lead} s: done ({time.time() - started:.0f} s)", flush=True)
    table = _table(rows)
    print(table)
    if args.json:
        doc = {"command": "bench/autoscale_foresight.py", "leads": args.leads, "seeds": seeds}
        args.json.write_text(json.dumps({**doc, "table": table, "rows": rows}, indent=1) + "\n")


def _table(rows: list[dict[str, Any]]) -> str:
    """Mean goodput / GPU-hours over the seeds, a row per shape, a column per variant."""
    variants: dict[tuple[str, float | None], list[dict[str, Any]]] = {}
    for r in rows:
        variants.setdefault((r["autoscaler"], r["lead_s"]), []).append(r)
    keys = sorted(variants, key=lambda k: (k[0] != "static_peak", k[1] is not None, k[1] or 0))
    head = ["traffic"] + [
        "static peak" if a == "static_peak" else "ours" if lead is None else f"ours, {lead:g} s"
        for a, lead in keys
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for shape in CHANGES:
        cells = [shape]
        for key in keys:
            rs = [r for r in variants[key] if r["trace"] == shape]
            good = statistics.fmean(r["goodput"] for r in rs)
            hours = statistics.fmean(r["gpu_hours"] for r in rs)
            cells.append(f"{good:.3f} / {hours:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
