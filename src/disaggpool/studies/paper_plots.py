"""PNG plots of the paper experiment: every experiment, with the spread of its runs.

Bars carry error bars and sweeps carry bands of one standard deviation over the runs behind each
point (traces and seeds; `paper_report.bar_stats`, `paper_report.sweep_bands`), so that a reader
sees at a glance whether two policies differ by more than their run-to-run spread. Every policy
label has one colour in every figure. Counts (decode instances, GPUs) are ticked at integers.

Called by `disaggpool sim paper --plots DIR`; reads only the experiment document. Writes
``main_<setup>.png`` per setup run (the paper setup: one panel per SLO level), ``ablation.png``,
``robustness.png``, ``herding.png``, the llama8b sweeps (``pool_size``, ``heterogeneity``,
``scarcity``, ``hardware_spread``) and ``gpu_count.png`` (one panel per setup), each when it has
rows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from disaggpool.studies import paper_report
from disaggpool.studies.paper_setup import LABELS

__all__ = ["write_plots"]

# One colour per policy label (matplotlib's tab10 colours, then black), in `LABELS` order.
_PALETTE = (
    "#1f77b4",  # round_robin
    "#7f7f7f",  # random
    "#ff7f0e",  # least_loaded
    "#2ca02c",  # length
    "#9467bd",  # p2c
    "#bcbd22",  # length+local<512
    "#d62728",  # calibrated
    "#ff9896",  # calibrated+priority
    "#8c564b",  # calibrated_greedy
    "#e377c2",  # uncalibrated
    "#17becf",  # study_weighted
    "#000000",  # study_weighted_datasheet
    "#c49c94",  # calibrated_no_pd
)
_COLOURS = dict(zip(LABELS, _PALETTE, strict=True))
# The constant-error experiment's scorers, in the colours of the labels they stand for.
_COLOURS |= {
    "seconds": _COLOURS["uncalibrated"],
    "seconds_no_pd": _COLOURS["calibrated_greedy"],
    "weighted_sum": _COLOURS["study_weighted_datasheet"],
}

_SWEEPS = (
    ("pool_size", "decode_pool", "decode instances", "Goodput vs decode-pool size", True),
    (
        "heterogeneity",
        "length_sigma",
        "log-normal sigma of lengths",
        "Goodput vs heterogeneity",
        False,
    ),
    ("scarcity", "load", "offered load (x operating rate)", "Goodput under scarcity", False),
    (
        "hardware_spread",
        "hardware_spread",
        "per-instance speed spread (log-normal sigma)",
        "Calibrated vs datasheet constants",
        False,
    ),
)


def _colour(label: str) -> str:
    return _COLOURS.get(label, "#444444")


def write_plots(doc: dict[str, Any], directory: Path) -> list[Path]:
    """Write every figure the document has rows for into `directory`; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    directory.mkdir(parents=True, exist_ok=True)
    exps = doc["experiments"]
    written = []
    by_setup: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for key, rows in paper_report.groups(exps["main"]).items():
        setup, _, level = key.partition("/")
        by_setup.setdefault(setup, {})[level or setup] = rows
    for setup, panels in by_setup.items():
        written.append(_main(panels, setup, directory / f"main_{setup}.png"))
    if exps["ablation"]:
        written.append(_ablation(exps["ablation"], directory / "ablation.png"))
    if exps["robustness"]:
        written.append(
            _grouped(
                exps["robustness"],
                directory / "robustness.png",
                key="case",
                title="Robustness (paper setup, tight SLO): each case at its own operating point",
            )
        )
    if exps.get("herding"):
        written.append(
            _grouped(
                exps["herding"],
                directory / "herding.png",
                key="view",
                title="What the router knows between scrapes (llama8b, main rate)",
            )
        )
    for name, key, xlabel, title, integer in _SWEEPS:
        if exps[name]:
            written.append(
                _sweep(
                    {"llama8b": exps[name]},
                    key,
                    xlabel,
                    f"{title} (llama8b)",
                    integer,
                    directory / f"{name}.png",
                )
            )
    if exps.get("constant_error"):
        written.append(
            _sweep(
                paper_report.groups(exps["constant_error"]),
                "error_factor",
                "decode constants x factor (log scale)",
                "Goodput when every decode constant is off by a factor",
                False,
                directory / "constant_error.png",
                log_x=True,
            )
        )
    if exps["gpu_count"]:
        per_setup: dict[str, list[dict[str, Any]]] = {}
        for r in exps["gpu_count"]:
            per_setup.setdefault(r["setup"], []).append(r)
        written.append(
            _sweep(
                per_setup,
                "gpus",
                "total GPUs",
                "Goodput vs GPUs at the rate round-robin carries on 7",
                True,
                directory / "gpu_count.png",
            )
        )
    return written


def _main(panels: dict[str, list[dict[str, Any]]], setup: str, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.2), squeeze=False)
    for ax, (level, rows) in zip(axes[0], panels.items(), strict=True):
        stats = paper_report.bar_stats(rows)
        labels = [s["policy"] for s in stats]
        xs = range(len(stats))
        ax.bar(
            xs,
            [s["mean"] for s in stats],
            yerr=[s["std"] for s in stats],
            capsize=3,
            color=[_colour(p) for p in labels],
        )
        # The per-trace means behind each bar (mean over seeds), so a reader sees the traces too.
        for x, table_row in zip(xs, paper_report.main_table(rows), strict=True):
            traces = [v for k, v in table_row.items() if k.startswith("mixed-")]
            ax.plot([x] * len(traces), traces, "k.", markersize=4)
        ax.set_xticks(list(xs), labels, rotation=35, ha="right", fontsize=8)
        ax.set_ylim(_floor(stats), 1.0)
        ax.set_ylabel("goodput (fraction meeting both SLOs)")
        ax.set_title(f"{setup}: {level}" if level != setup else setup)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("Main: mean over traces and seeds, error bar = std over runs; dots = traces")
    return _save(fig, path)


def _ablation(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    import matplotlib.pyplot as plt

    stats = paper_report.bar_stats(rows, "variant")
    policy = {r["variant"]: r["policy"] for r in rows}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ys = list(range(len(stats)))[::-1]
    ax.barh(
        ys,
        [s["mean"] for s in stats],
        xerr=[s["std"] for s in stats],
        capsize=3,
        color=[_colour(policy[s["variant"]]) for s in stats],
    )
    ax.set_yticks(ys, [s["variant"] for s in stats], fontsize=8)
    ref = next((s["mean"] for s in stats if s["variant"] == "calibrated"), None)
    if ref is not None:
        ax.axvline(ref, color=_colour("calibrated"), linestyle="--", linewidth=1)
    ax.set_xlim(_floor(stats), 1.0)
    ax.set_xlabel("goodput (error bar = std over traces and seeds)")
    ax.set_title("Ablation (paper setup, tight SLO): one lever changed at a time")
    ax.grid(axis="x", alpha=0.3)
    return _save(fig, path)


def _grouped(
    rows: Sequence[dict[str, Any]],
    path: Path,
    *,
    key: str,
    title: str,
) -> Path:
    """Grouped bars: one group per value of `key`, one bar per policy."""
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys(r[key] for r in rows))
    labels = list(dict.fromkeys(r["policy"] for r in rows))
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(labels)
    stats = {
        c: {s["policy"]: s for s in paper_report.bar_stats([r for r in rows if r[key] == c])}
        for c in cases
    }
    for i, label in enumerate(labels):
        ax.bar(
            [c + i * width for c in range(len(cases))],
            [stats[c][label]["mean"] for c in cases],
            width,
            yerr=[stats[c][label]["std"] for c in cases],
            capsize=2,
            color=_colour(label),
            label=label,
        )
    ax.set_xticks([c + 0.4 - width / 2 for c in range(len(cases))], cases)
    ax.set_ylim(_floor([s for per_case in stats.values() for s in per_case.values()]), 1.0)
    ax.set_ylabel("goodput (error bar = std over seeds)")
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    # Below the axes: in a group whose bars fall low, a legend inside would hide them.
    ax.legend(fontsize=7, ncol=len(labels), loc="upper center", bbox_to_anchor=(0.5, -0.08))
    return _save(fig, path)


def _sweep(
    panels: dict[str, list[dict[str, Any]]],
    key: str,
    xlabel: str,
    title: str,
    integer: bool,
    path: Path,
    *,
    log_x: bool = False,
) -> Path:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, (setup, rows) in zip(axes[0], panels.items(), strict=True):
        xs_all: set[Any] = set()
        for label, points in paper_report.sweep_bands(rows, key).items():
            xs = [x for x, _, _ in points]
            means = [m for _, m, _ in points]
            stds = [s for _, _, s in points]
            xs_all.update(xs)
            ax.plot(xs, means, marker="o", color=_colour(label), label=label)
            ax.fill_between(
                xs,
                [m - s for m, s in zip(means, stds, strict=True)],
                [min(1.0, m + s) for m, s in zip(means, stds, strict=True)],
                color=_colour(label),
                alpha=0.15,
            )
        if integer:
            ax.set_xticks(sorted(xs_all))
        if log_x:
            ax.set_xscale("log")
            ax.minorticks_off()  # their labels would crowd the factors' own
            ax.set_xticks(sorted(xs_all), [f"{x:g}" for x in sorted(xs_all)])
        ax.set_xlabel(xlabel)
        ax.set_ylabel("goodput (band = std over seeds)")
        ax.set_title(setup if len(panels) > 1 else title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    if len(panels) > 1:
        fig.suptitle(title)
    return _save(fig, path)


def _floor(stats: Sequence[dict[str, Any]]) -> float:
    """A y-axis floor a little below the lowest bar's error bar (differences near 1 show)."""
    low = min((s["mean"] - s["std"] for s in stats), default=0.0)
    return max(0.0, math.floor((low - 0.02) * 10) / 10)


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
