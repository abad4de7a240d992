"""What `disaggpool sim autoscale` prints and draws: goodput and GPU-hours per autoscaler.

Reads only the JSON document of `studies.autoscale_study.run_autoscale`, so a saved run can be
redrawn.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

__all__ = ["tables", "write_plots"]


def tables(doc: dict[str, Any]) -> str:
    """Markdown: per traffic shape, each autoscaler's mean goodput / GPU-hours, and ours against
    the static peak pool."""
    found = doc["findings"]["autoscale"]
    names = list(dict.fromkeys(r["autoscaler"] for r in doc["experiments"]["autoscale"]))
    head = "| traffic | " + " | ".join(names) + " | ours vs static | cheapest at its goodput |"
    lines = [head, "|---|" + "---|" * (len(names) + 2)]
    for trace, f in found.items():
        cells = [f"{f['goodput'][n]:.3f} / {f['gpu_hours'][n]:.2f}" for n in names]
        vs = (
            f"{f['vs_static_points']:+.2f} pts, {100 * f['gpu_hours_saved']:.0f}% fewer GPU-h"
            if "vs_static_points" in f
            else ""
        )
        cheapest = f.get("cheaper_than_every_rival_at_equal_goodput")
        lines.append(
            f"| {trace} | "
            + " | ".join(cells)
            + f" | {vs} | {'' if cheapest is None else cheapest}"
            " |"
        )
    return "goodput / GPU-hours (all pods, prefill included)\n" + "\n".join(lines)


def write_plots(doc: dict[str, Any], directory: Path) -> list[Path]:
    """Per traffic shape: decode pods (and prefill pods, dashed, where they are scaled) over time
    for each autoscaler (first seed, lines offset slightly) under the arrival rate; and one chart
    of goodput against GPU-hours, error bars over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    rows = doc["experiments"]["autoscale"]
    traces = list(dict.fromkeys(r["trace"] for r in rows))
    names = list(dict.fromkeys(r["autoscaler"] for r in rows))
    written = []
    fig, axes = plt.subplots(len(traces), 1, figsize=(10, 2.8 * len(traces)), squeeze=False)
    for ax, trace in zip(axes[:, 0], traces, strict=True):
        first = min(r["seed"] for r in rows if r["trace"] == trace)
        rate_ax = ax.twinx()
        for k, name in enumerate(names):
            row = next(
                r for r in rows if (r["trace"], r["autoscaler"], r["seed"]) == (trace, name, first)
            )
            tl = row["timeline"]
            # Offset each line a little so that equal counts stay visible side by side.
            shift = (k - (len(names) - 1) / 2) * 0.04
            pods = [n + shift for n in tl["decode_pods"]]
            (line,) = ax.step(tl["t"], pods, where="post", label=name, linewidth=1.2)
            if "prefill_pods" in tl:  # prefill in the same colour, dashed
                prefill = [n + shift for n in tl["prefill_pods"]]
                ax.step(tl["t"], prefill, where="post", color=line.get_color(),
                        linestyle="--", linewidth=0.9)  # fmt: skip
        # Every autoscaler of a shape and seed replays the same arrivals: one rate curve.
        rate_ax.plot(tl["t"], tl["rate_rps"], color="grey", alpha=0.35, linewidth=1)
        rate_ax.set_ylabel("req/s, last 60 s (grey)")
        ax.set_ylabel("decode pods (prefill dashed)")
        ax.yaxis.get_major_locator().set_params(integer=True)
        ax.set_title(f"{trace} (seed {first})")
    axes[0, 0].legend(fontsize=7, ncol=3, loc="lower center")
    axes[-1, 0].set_xlabel("time (s)")
    fig.tight_layout()
    path = directory / "autoscale_replicas.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

    cols = min(4, len(traces))
    grid = -(-len(traces) // cols)
    fig, axes = plt.subplots(grid, cols, figsize=(3.6 * cols, 3.6 * grid), squeeze=False)
    for ax in axes.flat[len(traces) :]:
        ax.set_visible(False)
    for ax, trace in zip(axes.flat, traces, strict=False):
        for name in names:
            mine = [r for r in rows if (r["trace"], r["autoscaler"]) == (trace, name)]
            g = [r["goodput"] for r in mine]
            h = [r["gpu_hours"] for r in mine]
            ax.errorbar(
                statistics.fmean(h),
                statistics.fmean(g),
                xerr=statistics.stdev(h) if len(h) > 1 else 0,
                yerr=statistics.stdev(g) if len(g) > 1 else 0,
                fmt="o",
                label=name,
                capsize=2,
            )
        ax.set_title(trace)
        ax.set_xlabel("GPU-hours")
    for row in axes:
        row[0].set_ylabel("goodput")
    axes[0, -1].legend(fontsize=7)
    fig.tight_layout()
    path = directory / "autoscale_goodput_vs_gpu_hours.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    return written
