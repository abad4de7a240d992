"""Router replicas with and without shared books: `sim paper`'s herding experiment on its own.

What it runs
------------
The ``llama8b`` setup of `disaggpool sim paper` (Llama-3-8B on 8 GPUs, derived SLOs), placed by
the quick configuration's placement search (five bisection steps on 2-minute traces: it lands on
the same 5P+3D split and rate as the full search, at a fraction of its time), then the herding
experiment of the full configuration: trace mixed-0 (12-minute window) at that rate, 4,000
requests, 1 s scrapes, every view of `studies.paper.HERDING_VIEWS` (one router; 4 and 16
replicas each with its own books; 4 and 16 sharing their books over a 5 ms bus) for the labels
asked for. Deterministic: a rerun gives the same rows.

Run: ``PYTHONPATH=src:bench .venv/bin/python bench/herding.py [--labels a,b] [--seeds 1,2,3]
[--requests N] [--json FILE]``. The figures in docs/results/routing-quality.md ("Shared books")
are its output with the defaults (`bench/herding.json`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from disaggpool.sim.runner import run_all
from disaggpool.studies import paper
from disaggpool.studies.paper_config import PaperConfig
from disaggpool.studies.paper_setup import (
    llama8b_setup,
    placed,
    placement_searches,
    solve_searches,
)

LABELS = ("calibrated", "calibrated_no_pd", "least_loaded", "round_robin")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--labels", default=",".join(LABELS))
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--requests", type=int, default=PaperConfig().sweep_requests)
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    labels = set(args.labels.split(","))
    started = time.time()
    search = dataclasses.replace(PaperConfig.quick(), setups=("llama8b",), window_minutes=12.0)
    setup = llama8b_setup(search)
    rates = solve_searches(
        {"llama8b": placement_searches(setup, search)},
        steps=search.bisection_steps,
        workers=args.workers,
    )
    setup = placed(setup, search, rates["llama8b"])
    cfg = dataclasses.replace(
        search,
        sweep_requests=args.requests,
        seeds=tuple(int(s) for s in args.seeds.split(",")),
    )
    specs = [s for s in paper._Experiments(cfg, setup)._herding() if s.label in labels]
    print(f"split {setup.split}, {len(specs)} runs", flush=True)
    rows = run_all(specs, workers=args.workers)
    table = _table(rows)
    print(table)
    print(f"({time.time() - started:.0f} s)")
    if args.json:
        doc = {"split": list(setup.split), "rows": rows, "table": table}
        args.json.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")


def _table(rows: list[dict[str, Any]]) -> str:
    """Mean goodput per view and label (per seed in brackets)."""
    cells: dict[tuple[str, str], list[float]] = defaultdict(list)
    for r in sorted(rows, key=lambda r: r["seed"]):
        cells[(r["view"], r["policy"])].append(r["goodput"])
    views = list(dict.fromkeys(r["view"] for r in rows))
    labels = list(dict.fromkeys(r["policy"] for r in rows))
    lines = ["| view | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
    for v in views:
        out = []
        for lab in labels:
            g = cells[(v, lab)]
            seeds = ", ".join(f"{x:.3f}" for x in g)
            out.append(f"{statistics.fmean(g):.3f} ({seeds})")
        lines.append(f"| {v} | " + " | ".join(out) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
