"""How much of the prefill pool's KV cache may hold KV parked for decode: `PARKED_KV_SHARE`.

The prefill autoscaler (`core.prefill_scaling`) keeps the pods that hold the prefill pool's KV in
use at a share of their cache, because a prefill pod keeps each prompt's KV until its decode pod
pulls it. This runs `disaggpool sim autoscale`'s full-size study, ours only, on the shape that
parks KV (`mixshift`: outputs ten times longer at a constant rate, decode short until its new
pods serve) and on one that does not and pays for every pod held (`diurnal`), for each share and
without the floor, three seeds each. A lower share holds more prefill pods: the figure to read is
goodput on `mixshift` against GPU-hours on both.

The share is a constant of the autoscaler, not a knob a user sets; this bench sets the module's
constant before each sweep (the runs fork from this process, so they see it).

Run: ``PYTHONPATH=src .venv/bin/python bench/parked_kv_share.py [--shares 0.2,0.25,0.3,0.5]
[--no-pd-decider] [--json FILE]``. Its outputs with the defaults, and with the router's P/D
decider off, are `bench/parked_kv_share.json` and `bench/parked_kv_share_no_pd.json`, quoted in
docs/results/autoscaling.md ("Prefill").
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

from disaggpool.core import prefill_scaling
from disaggpool.studies.autoscale_study import AutoscaleConfig, run_autoscale

SHAPES = ("mixshift", "diurnal")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--shares", default="0.2,0.25,0.3,0.5")
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument(
        "--no-pd-decider", action="store_true", help="the router's P/D decider off (default on)"
    )
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    started = time.time()
    shares: list[float] = [math.inf, *(float(s) for s in args.shares.split(","))]
    cfg = AutoscaleConfig(
        shapes=SHAPES, autoscalers=("disaggpool",), pd_decider=not args.no_pd_decider
    )
    rows: list[dict[str, Any]] = []
    for share in shares:
        prefill_scaling.PARKED_KV_SHARE = share
        doc = run_autoscale(cfg, workers=args.workers)
        for r in doc["experiments"]["autoscale"]:
            r.pop("timeline", None)
            rows.append({"share": None if math.isinf(share) else share, **r})
        print(f"share {share}: done ({time.time() - started:.0f} s)", flush=True)
    table = _table(rows)
    print(table)
    if args.json:
        config = {"shapes": SHAPES, "seeds": list(cfg.seeds), "pd_decider": cfg.pd_decider}
        out = {"config": config, "rows": rows, "table": table}
        args.json.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")


def _table(rows: list[dict[str, Any]]) -> str:
    """Mean goodput / GPU-hours over the seeds, per share and shape."""
    lines = ["| parked KV share | " + " | ".join(SHAPES) + " |", "|---|" + "---|" * len(SHAPES)]
    for share in dict.fromkeys(r["share"] for r in rows):
        cells = []
        for shape in SHAPES:
            got = [r for r in rows if r["share"] == share and r["trace"] == shape]
            goodput = statistics.fmean(r["goodput"] for r in got)
            hours = statistics.fmean(r["gpu_hours"] for r in got)
            cells.append(f"{goodput:.3f} / {hours:.2f}")
        name = "no floor" if share is None else f"{share:g}"
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
