"""PNG plots of the paper experiment: one figure per sweep plus the main comparison.

Called by `disaggpool sim paper --plots DIR`; reads only the experiment document.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from disaggpool.sim import report

__all__ = ["write_plots"]

_SWEEPS = (
    (
        "pool_size",
        "decode_pool",
        "decode instances",
        "Goodput vs decode-pool size (each at its operating point)",
    ),
    (
        "heterogeneity",
        "length_sigma",
        "log-normal sigma of lengths",
        "Goodput vs traffic heterogeneity",
    ),
    ("scarcity", "load", "offered load (x operating rate)", "Goodput under scarcity"),
    ("gpu_count", "gpus", "total GPUs", "Goodput vs GPUs at the rate 7 GPUs carry"),
)


def write_plots(doc: dict[str, Any], directory: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    written = []
    exps = doc["experiments"]

    table = report.main_table(exps["main"])
    fig, ax = plt.subplots(figsize=(8, 4))
    traces = [k for k in table[0] if k.startswith("mixed-")]
    width = 0.8 / len(table)
    for i, row in enumerate(table):
        xs = [t + i * width for t in range(len(traces))]
        ax.bar(xs, [row[t] for t in traces], width, label=row["policy"])
    ax.set_xticks([t + 0.4 - width / 2 for t in range(len(traces))], traces)
    ax.set_ylabel("goodput (fraction meeting SLO)")
    ax.set_ylim(max(0.0, min(row[t] for row in table for t in traces) - 0.05), 1.0)
    ax.set_title("Main: 8 GPUs, three mixed bursty traces")
    ax.legend(fontsize=7, ncol=4)
    written.append(_save(fig, directory / "main.png"))

    for name, key, xlabel, title in _SWEEPS:
        rows = report.sweep_table(exps[name], key)
        fig, ax = plt.subplots(figsize=(6, 4))
        policies = [k for k in rows[0] if k != key]
        for policy in policies:
            points = [(r[key], r[policy]) for r in rows if policy in r]
            ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=policy)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("goodput")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        written.append(_save(fig, directory / f"{name}.png"))
    return written


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
