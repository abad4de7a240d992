"""How many GPU-hours `sim autoscale`'s rate shapes need at least: a yardstick for issue #39's 25%.

The aim is 25% fewer GPU-hours than the static peak pool (4 prefill + 6 decode pods), counting
every pod, on `diurnal` and `ramp`. Is that within reach? This bench measures the smallest
static pool that serves each constant rate as well as the static peak pool does (within half a
point of its goodput, the issue's own tolerance), then prices a pool that holds exactly that at
every instant of a shape: the **need**. No real autoscaler does as well (a new pod serves a cold
start after it is asked for, the rate is not known ahead, and scaling down waits out bursts), so
the need is a floor to measure ours against, not a target.

Each rate is a fraction of the shapes' peak (chat only, the study's trace; the rate shapes keep
the lengths), on a grid; a shape's rate between two grid points is priced at the higher one.
Decode pods are swept with the full prefill pool, prefill pods with the full decode pool, each
run `--duration` seconds with the study's pool, SLOs and router. Ours and the static pool run
the shapes beside it, as `sim autoscale` runs them.

Run: ``PYTHONPATH=src .venv/bin/python bench/autoscale_need.py [--seeds 1,2] [--json FILE]``
(about 10 minutes on 2 cores). Its output is `bench/autoscale_need.json`, quoted in
docs/results/autoscaling.md ("The aims of issue #39").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

from disaggpool import progress
from disaggpool.core.autoscaling import Bounds
from disaggpool.core.hardware import builtin_profile
from disaggpool.formats.embedded import azure_services
from disaggpool.formats.traces import TraceRequest
from disaggpool.sim.capacity import slo_targets
from disaggpool.sim.runner import run_all
from disaggpool.studies.autoscale_study import (
    PROFILE,
    AutoscaleConfig,
    AutoscaleSpec,
    _pool,
    execute_autoscale,
    run_autoscale,
    shape_peak,
)
from disaggpool.studies.autoscale_traffic import SHAPES, scaled_lengths

FRACTIONS = (0.15, 0.25, 0.35, 0.45, 0.55, 0.65, 0.75, 0.85, 0.95, 1.0)
SHAPES_PRICED = ("diurnal", "ramp")
TOLERANCE = 0.005  # half a point of goodput


def _steady_trace(rate: float, duration_s: float, seed: int) -> tuple[TraceRequest, ...]:
    """Chat at a constant `rate`: Poisson arrivals, lengths drawn from the study's chat trace."""
    profile = builtin_profile(PROFILE)
    chat = azure_services()["chat"]
    rng = random.Random(f"autoscale-need:{rate:.4f}:{seed}")
    out, t = [], 0.0
    while (t := t + rng.expovariate(rate)) < duration_s:
        r = rng.choice(chat)
        prompt, output = scaled_lengths(
            r.prompt_tokens, r.output_tokens, 1.0, 1.0, profile.max_model_len
        )
        out.append(TraceRequest(t, prompt, output, slo_class="chat"))
    return tuple(out)


def _specs(fractions: tuple[float, ...], seeds: tuple[int, ...], duration_s: float) -> list[Any]:
    """A static pool of (prefill, decode) pods per grid point: decode swept with 4 prefill pods,
    prefill with 6 decode pods (4 + 6 being the static peak pool)."""
    cfg = AutoscaleConfig()
    profile = builtin_profile(PROFILE)
    services = azure_services()
    slo = slo_targets(profile, [r for rs in services.values() for r in rs])
    tpot = min(c.tpot_s for c in slo.values())
    peak = shape_peak(SHAPES["ramp"], cfg, profile, services["chat"], tpot)
    pools = [(cfg.n_prefill, d) for d in range(1, cfg.max_decode + 1)]
    pools += [(p, cfg.max_decode) for p in range(1, cfg.n_prefill)]
    specs = []
    for f in fractions:
        for seed in seeds:
            trace = _steady_trace(f * peak, duration_s, seed)
            for p, d in pools:
                sized = dataclasses.replace(cfg, n_prefill=p, max_decode=d)
                specs.append(
                    AutoscaleSpec(
                        f"{f:g}/{p}/{d}",
                        trace,
                        _pool(sized, seed),
                        tuple(slo.values()),
                        "static_peak",
                        Bounds(d, d, cfg.startup_s, cfg.stabilization_s),
                        seed,
                        cfg.target_goodput,
                        prefill_bounds=Bounds(p, p, cfg.startup_s, cfg.stabilization_s),
                    )
                )
    return specs


def _needs(rows: list[dict[str, Any]]) -> dict[float, dict[str, Any]]:
    """Per fraction: the goodput of each pool (mean over seeds) and the fewest decode and
    prefill pods within `TOLERANCE` of the static peak pool's goodput at that rate."""
    good: dict[tuple[float, int, int], list[float]] = {}
    for r in rows:
        f, p, d = r["trace"].split("/")
        good.setdefault((float(f), int(p), int(d)), []).append(r["goodput"])
    mean = {k: statistics.fmean(v) for k, v in good.items()}
    top_p = max(p for _, p, _ in mean)
    top_d = max(d for _, _, d in mean)
    out: dict[float, dict[str, Any]] = {}
    for f in sorted({f for f, _, _ in mean}):
        ref = mean[(f, top_p, top_d)]
        decode = min(
            d for (g, p, d), v in mean.items() if g == f and p == top_p and v >= ref - TOLERANCE
        )
        prefill = min(
            p for (g, p, d), v in mean.items() if g == f and d == top_d and v >= ref - TOLERANCE
        )
        pools = {f"{p}+{d}": round(v, 4) for (g, p, d), v in sorted(mean.items()) if g == f}
        out[f] = {
            "static_peak_goodput": round(ref, 4),
            "decode": decode,
            "prefill": prefill,
            "goodput": pools,
        }
    return out


def _need_hours(
    shape: str, needs: dict[float, dict[str, Any]], duration_s: float
) -> dict[str, float]:
    """GPU-hours of a pool that holds the need at every second of `shape`."""
    grid = sorted(needs)
    decode = prefill = 0.0
    for t in range(int(duration_s)):
        rate = SHAPES[shape].rate(t + 0.5, duration_s)
        at = next((g for g in grid if g >= rate - 1e-9), grid[-1])
        decode += needs[at]["decode"]
        prefill += needs[at]["prefill"]
    return {
        "gpu_hours": round((decode + prefill) / 3600.0, 3),
        "decode_gpu_hours": round(decode / 3600.0, 3),
        "prefill_gpu_hours": round(prefill / 3600.0, 3),
    }


def _mean(rows: list[dict[str, Any]], shape: str, name: str, key: str) -> float:
    return statistics.fmean(r[key] for r in rows if r["trace"] == shape and r["autoscaler"] == name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--seeds", default="1,2", help="seeds of the constant-rate runs")
    ap.add_argument("--duration", type=float, default=300.0, help="seconds per constant rate")
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    started = time.time()
    seeds = tuple(int(s) for s in args.seeds.split(","))
    specs = _specs(FRACTIONS, seeds, args.duration)
    with progress.bar(total=len(specs), desc="constant rates", unit="run") as bar:
        rows = run_all(specs, workers=args.workers, progress=bar.update, run=execute_autoscale)
    for r in rows:
        del r["timeline"]
    needs = _needs(rows)
    cfg = AutoscaleConfig(shapes=SHAPES_PRICED, autoscalers=("static_peak", "disaggpool"))
    shapes = run_autoscale(cfg, workers=args.workers)["experiments"]["autoscale"]
    lines = [
        "| traffic | static peak | ours | the need | ours above the need |",
        "|---|---|---|---|---|",
    ]
    priced: dict[str, Any] = {}
    for shape in SHAPES_PRICED:
        need = _need_hours(shape, needs, cfg.duration_s)
        static = _mean(shapes, shape, "static_peak", "gpu_hours")
        ours = _mean(shapes, shape, "disaggpool", "gpu_hours")
        ours_good = _mean(shapes, shape, "disaggpool", "goodput")
        priced[shape] = {
            "need": need,
            "static_peak": static,
            "ours": ours,
            "ours_goodput": ours_good,
        }
        lines.append(
            f"| {shape} | {static:.2f} | {ours:.2f} ({1 - ours / static:.1%} fewer), goodput "
            f"{ours_good:.3f} | {need['gpu_hours']:.2f} ({1 - need['gpu_hours'] / static:.1%} "
            f"fewer): decode {need['decode_gpu_hours']:.2f}, prefill "
            f"{need['prefill_gpu_hours']:.2f} | {ours - need['gpu_hours']:+.2f} |"
        )
    table = "\n".join(lines)
    print(f"{table}\n({time.time() - started:.0f} s)")
    if args.json:
        doc = {
            "command": "bench/autoscale_need.py",
            "seeds": seeds,
            "duration_s": args.duration,
            "tolerance": TOLERANCE,
            "table": table,
            "needs": needs,
            "shapes": priced,
        }
        args.json.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
