"""What `disaggpool sim prefix` prints and draws: a table per case, and goodput / hit-share bars.

Reads only the JSON document of `studies.prefix_study.run_prefix`, so a saved run can be redrawn.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from disaggpool.studies.prefix_study import POLICIES

__all__ = ["tables", "write_plots"]


def tables(doc: dict[str, Any]) -> str:
    """Markdown: per case, each policy's mean goodput (and hit share), calibrated's gap."""
    found = doc["findings"]["prefix"]
    head = "| case | req/s | " + " | ".join(POLICIES) + " | calibrated vs best other |"
    lines = [head, "|---|---|" + "---|" * (len(POLICIES) + 1)]
    for case, f in found.items():
        cells = [
            f"{f['means'][p]:.3f} ({f['prefix_hit'][p]:.2f})" if p in f["means"] else ""
            for p in POLICIES
        ]
        gap = f"{f['gap_points']:+.2f} ({f['best_other']})"
        lines.append(f"| {case} | {f['rate_rps']:.2f} | " + " | ".join(cells) + f" | {gap} |")
    return "goodput (prefix-cache hit share of prompt tokens)\n" + "\n".join(lines)


def write_plots(doc: dict[str, Any], directory: Path) -> list[Path]:
    """One PNG per trace: goodput and hit share per policy, a group per pool x cache x decode
    pool size, error bars over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    rows = doc["experiments"]["prefix"]
    written = []
    for trace in dict.fromkeys(r["trace"] for r in rows):
        mine = [r for r in rows if r["trace"] == trace]
        groups = list(dict.fromkeys((r["pool"], r["cache"], r["decode_pods"]) for r in mine))
        fig, axes = plt.subplots(1, 2, figsize=(14, 4.2))
        width = 0.8 / len(POLICIES)
        for k, label in enumerate(POLICIES):
            for ax, metric in zip(axes, ("goodput", "prefix_hit"), strict=True):
                means, errs = [], []
                for group in groups:
                    vals = [
                        r[metric]
                        for r in mine
                        if (r["pool"], r["cache"], r["decode_pods"], r["policy"]) == (*group, label)
                    ]
                    means.append(statistics.mean(vals) if vals else 0.0)
                    errs.append(statistics.stdev(vals) if len(vals) > 1 else 0.0)
                xs = [g + (k - (len(POLICIES) - 1) / 2) * width for g in range(len(groups))]
                ax.bar(xs, means, width, yerr=errs, label=label, capsize=2)
        for ax, title in zip(axes, ("goodput", "prefix-cache hit share"), strict=True):
            ax.set_xticks(range(len(groups)), [f"{p}\n{c}\n{d} decode" for p, c, d in groups])
            ax.set_title(f"{trace}: {title}")
            ax.set_ylim(0, 1.05)
        axes[0].legend(fontsize=7, loc="lower left")
        fig.tight_layout()
        path = directory / f"prefix_{trace}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
