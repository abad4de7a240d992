"""Tables and findings of the paper experiment, computed from its JSON rows (pure).

`sim.paper` produces the rows; this module aggregates them (goodput per trace and policy, sweep
tables), checks the study's five claims against them (`findings`) and renders the text tables
the CLI prints. `sim.plots` draws the same aggregates.
"""

from __future__ import annotations

import io
import statistics
from collections.abc import Sequence
from typing import Any

from disaggpool.core.stats import mean_or_nan

__all__ = ["findings", "main_table", "render", "sweep_table", "tables"]


def _by(rows: Sequence[dict[str, Any]], *keys: str) -> dict[tuple[Any, ...], list[dict[str, Any]]]:
    out: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in rows:
        out.setdefault(tuple(r[k] for k in keys), []).append(r)
    return out


def main_table(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per policy: mean goodput per trace, mean and std across traces, mean p99s."""
    table = []
    traces = sorted({r["trace"] for r in rows})
    for (policy,), group in _by(rows, "policy").items():
        per_trace = {
            t: mean_or_nan([r["goodput"] for r in group if r["trace"] == t]) for t in traces
        }
        values = list(per_trace.values())
        table.append(
            {
                "policy": policy,
                **{t: round(v, 4) for t, v in per_trace.items()},
                "mean": round(mean_or_nan(values), 4),
                "std": round(statistics.pstdev(values), 4) if len(values) > 1 else 0.0,
                "ttft_p99_s": round(mean_or_nan([r["ttft_p99_s"] for r in group]), 3),
                "tpot_p99_s": round(mean_or_nan([r["tpot_p99_s"] for r in group]), 4),
            }
        )
    return table


def sweep_table(rows: Sequence[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    """Rows: sweep value; columns: mean goodput per policy."""
    table = []
    for (value,), group in sorted(_by(rows, key).items()):
        entry: dict[str, Any] = {key: value}
        for (policy,), g in _by(group, "policy").items():
            entry[policy] = round(mean_or_nan([r["goodput"] for r in g]), 4)
        table.append(entry)
    return table


def findings(experiments: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The study's five claims, checked against our runs (numbers only; the README interprets)."""
    main = {r["policy"]: r for r in main_table(experiments["main"])}
    out: dict[str, Any] = {}
    cal = main.get("calibrated")
    if cal:
        baselines = [p for p in ("round_robin", "least_loaded", "length") if p in main]
        traces = [k for k in cal if k.startswith("mixed-")]
        out["main_calibrated_mean"] = cal["mean"]
        out["main_baseline_means"] = {p: main[p]["mean"] for p in baselines}
        out["main_wins_per_baseline"] = {
            p: sum(1 for t in traces if cal[t] > main[p][t]) for p in baselines
        }
        out["main_lowest_std"] = all(cal["std"] <= main[p]["std"] for p in baselines)
    unc = main.get("uncalibrated")
    rr = main.get("round_robin")
    abl = sweep_table(experiments["ablation"], "hardware_spread")
    out["ablation_goodput_loss_points_by_spread"] = {
        str(r["hardware_spread"]): round(100 * (r["calibrated"] - r["uncalibrated"]), 2)
        for r in abl
    }
    if cal and unc and rr:
        out["ablation_goodput_loss_points"] = round(100 * (cal["mean"] - unc["mean"]), 2)
        gain_cal = rr["ttft_p99_s"] - cal["ttft_p99_s"]
        gain_unc = rr["ttft_p99_s"] - unc["ttft_p99_s"]
        out["ablation_ttft_p99_gain_kept"] = round(gain_unc / gain_cal, 3) if gain_cal > 0 else None
    pool = sweep_table(experiments["pool_size"], "decode_pool")
    out["pool_size_gain_points"] = {
        str(r["decode_pool"]): round(
            100 * (r["calibrated"] - max(r["round_robin"], r["least_loaded"])), 2
        )
        for r in pool
    }
    het = sweep_table(experiments["heterogeneity"], "length_sigma")
    out["heterogeneity_gain_points"] = {
        str(r["length_sigma"]): round(
            100 * (r["calibrated"] - max(r["round_robin"], r["least_loaded"])), 2
        )
        for r in het
    }
    scar = sweep_table(experiments["scarcity"], "load")
    out["scarcity"] = scar
    gpu = sweep_table(experiments["gpu_count"], "gpus")
    rr7 = next((r["round_robin"] for r in gpu if r["gpus"] == 7), None)
    if rr7 is not None:
        matching = [r["gpus"] for r in gpu if r["calibrated"] >= rr7]
        out["gpu_count_round_robin_at_7"] = rr7
        out["gpu_count_calibrated_fewest_matching"] = min(matching) if matching else None
    return out


def tables(doc: dict[str, Any]) -> str:
    """A plain-text rendering of the experiment document for the terminal."""
    buf = io.StringIO()
    exps = doc["experiments"]
    setup = doc["setup"]
    buf.write(
        f"Pool: {setup['gpus']} x {setup['profile']} ({setup['split']['prefill']}P + "
        f"{setup['split']['decode']}D) at the rates where round-robin attains "
        f"{setup['target_goodput']} "
        f"goodput ({', '.join(f'{r:.2f}' for r in setup['rates_rps'])} req/s); SLOs "
        + ", ".join(
            f"{k}: TTFT {v['ttft_s']}s TPOT {v['tpot_s']}s" for k, v in setup["slo_classes"].items()
        )
        + "\n\n"
    )
    buf.write(render("main: goodput per trace (mean over seeds)", main_table(exps["main"])))
    buf.write(
        render(
            "ablation: calibrated vs datasheet constants, by hardware speed spread (sigma)",
            sweep_table(exps["ablation"], "hardware_spread"),
        )
    )
    buf.write(
        render(
            "pool_size: goodput vs decode instances (each at its operating point)",
            sweep_table(exps["pool_size"], "decode_pool"),
        )
    )
    buf.write(
        render(
            "heterogeneity: goodput vs log-normal length spread",
            sweep_table(exps["heterogeneity"], "length_sigma"),
        )
    )
    buf.write(
        render("scarcity: goodput vs load (x the main rate)", sweep_table(exps["scarcity"], "load"))
    )
    buf.write(
        render(
            "gpu_count: goodput vs total GPUs at a fixed rate",
            sweep_table(exps["gpu_count"], "gpus"),
        )
    )
    buf.write("findings:\n")
    for k, v in doc["findings"].items():
        if k != "scarcity":
            buf.write(f"  {k}: {v}\n")
    return buf.getvalue()


def render(title: str, rows: Sequence[dict[str, Any]]) -> str:
    if not rows:
        return f"{title}\n  (no rows)\n\n"
    cols = list(dict.fromkeys(k for r in rows for k in r))
    widths = {c: max(len(c), *(len(_fmt(r.get(c, ""))) for r in rows)) for c in cols}
    lines = [title, "  " + "  ".join(c.ljust(widths[c]) for c in cols)]
    for r in rows:
        lines.append("  " + "  ".join(_fmt(r.get(c, "")).ljust(widths[c]) for c in cols))
    return "\n".join(lines) + "\n\n"


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4f}" if abs(v) < 10 else f"{v:.2f}"
    return str(v)
