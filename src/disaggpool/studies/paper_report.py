"""Tables and findings of the paper experiment, computed from its JSON rows (pure).

`studies.paper` produces the rows; this module aggregates them (goodput per trace and policy,
sweep tables, means with their spread), computes the findings (`findings`) and renders the text
tables the CLI prints (`tables`, laid out by `sim.table`). `studies.paper_plots` draws the same
aggregates.

Rows are grouped by setup: ``group_key`` is ``llama8b``, ``paper/tight`` or ``paper/loose``. A
policy's mean goodput is the mean of its per-trace means (each trace weighs the same); its std
"across traces" is the population std of those per-trace means; the spread of the plots' error
bars is the std over every run (traces and seeds). "The baselines" are
`paper_setup.BASELINES` (round-robin, least-loaded, length, power-of-two; random is reported but
not counted). Points are 100 x a goodput difference.

The keys of `findings` (only those whose experiment has rows):

* ``main``: group -> ``calibrated_mean``, ``calibrated_std``, ``best_baseline``,
  ``best_baseline_mean``, ``gap_points`` (calibrated minus the best baseline),
  ``traces``, ``traces_calibrated_ge_every_baseline`` (traces on which calibrated's mean is
  at least every baseline's), ``calibrated_lowest_std`` (its std across traces is at most every
  baseline's), ``means`` and ``stds`` (label -> mean, std across traces).
* ``misses``: group -> label -> the misses of the main runs by SLO term, summed over runs (the
  terms of the rows' ``misses``: TTFT only, TPOT only, both, ...).
* ``ablation``: ``means`` (variant -> mean goodput), ``points_vs_calibrated`` (variant minus the
  all-on ``calibrated`` variant), ``levers_points`` (lever -> mean(with) - mean(without), the
  pairs of `paper_study.LEVERS`).
* ``robustness``: case -> ``calibrated_mean``, ``best_baseline``, ``best_baseline_mean``,
  ``gap_points``, ``means`` (label -> mean).
* ``gpu_count``: setup -> ``round_robin_at_7``, ``calibrated_fewest_matching`` (the fewest GPUs
  at which calibrated's mean reaches round-robin's at 7; None if none), ``means`` (GPUs ->
  label -> mean).
* ``hardware_spread``: spread -> calibrated minus uncalibrated (llama8b).
* ``pool_size_gain_points``, ``heterogeneity_gain_points``: sweep point -> calibrated minus the
  best baseline run there (llama8b).
* ``scarcity``: the scarcity sweep table (load -> label -> mean goodput) (llama8b).
* ``herding``: goodput per router view (`paper.HERDING_VIEWS`) and label (llama8b).
* ``constant_error``: group -> scorer -> ``means`` (error factor -> mean goodput) and
  ``loss_points`` (error factor -> its mean minus the mean at factor 1.0).
"""

from __future__ import annotations

import io
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

from disaggpool.core.stats import mean_or_nan
from disaggpool.sim.table import render
from disaggpool.studies.paper_setup import BASELINES
from disaggpool.studies.paper_study import LEVERS

__all__ = [
    "bar_stats",
    "findings",
    "group_key",
    "groups",
    "main_table",
    "sweep_bands",
    "sweep_table",
    "tables",
]

Row = dict[str, Any]


def group_key(row: Row) -> str:
    """``llama8b``, ``paper/tight`` or ``paper/loose``: the setup (and SLO level) of a row."""
    setup = str(row.get("setup", ""))
    return f"{setup}/{row['slo']}" if row.get("slo") else setup


def groups(rows: Iterable[Row]) -> dict[str, list[Row]]:
    """Rows by `group_key`, in order of first appearance."""
    out: dict[str, list[Row]] = {}
    for r in rows:
        out.setdefault(group_key(r), []).append(r)
    return out


def _by(rows: Iterable[Row], *keys: str) -> dict[tuple[Any, ...], list[Row]]:
    out: dict[tuple[Any, ...], list[Row]] = {}
    for r in rows:
        out.setdefault(tuple(r[k] for k in keys), []).append(r)
    return out


def _std(values: Sequence[float]) -> float:
    return statistics.pstdev(values) if len(values) > 1 else 0.0


def _points(a: float, b: float) -> float:
    return round(100 * (a - b), 2)


def main_table(rows: Sequence[Row]) -> list[Row]:
    """Per policy label: mean goodput per trace, mean and std across traces, mean p99s."""
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
                "std": round(_std(values), 4),
                "ttft_p99_s": round(mean_or_nan([r["ttft_p99_s"] for r in group]), 3),
                "tpot_p99_s": round(mean_or_nan([r["tpot_p99_s"] for r in group]), 4),
            }
        )
    return table


def bar_stats(rows: Sequence[Row], key: str = "policy") -> list[Row]:
    """Per value of `key` (first-appearance order): mean goodput and its std over every run."""
    return [
        {
            key: value,
            "mean": mean_or_nan([r["goodput"] for r in g]),
            "std": _std([r["goodput"] for r in g]),
            "runs": len(g),
        }
        for (value,), g in _by(rows, key).items()
    ]


def sweep_table(rows: Sequence[Row], key: str) -> list[Row]:
    """Rows: sweep value; columns: mean goodput per policy label."""
    table = []
    for (value,), group in sorted(_by(rows, key).items()):
        entry: Row = {key: value}
        for (policy,), g in _by(group, "policy").items():
            entry[policy] = round(mean_or_nan([r["goodput"] for r in g]), 4)
        table.append(entry)
    return table


def sweep_bands(rows: Sequence[Row], key: str) -> dict[str, list[tuple[Any, float, float]]]:
    """Per policy label: (sweep value, mean goodput, std over its runs), by sweep value."""
    out: dict[str, list[tuple[Any, float, float]]] = {}
    for (policy, value), g in sorted(_by(rows, "policy", key).items(), key=lambda item: item[0][1]):
        goodput = [r["goodput"] for r in g]
        out.setdefault(policy, []).append((value, mean_or_nan(goodput), _std(goodput)))
    return out


def _versus_baselines(table: list[Row]) -> Row:
    """Calibrated against the best baseline of a `main_table`-shaped table (per-trace columns)."""
    by = {r["policy"]: r for r in table}
    cal = by.get("calibrated")
    base = [by[p] for p in BASELINES if p in by]
    if cal is None or not base:
        return {}
    best = max(base, key=lambda r: r["mean"])
    traces = [k for k in cal if k.startswith(("mixed-", "chat-"))]
    return {
        "calibrated_mean": cal["mean"],
        "calibrated_std": cal["std"],
        "best_baseline": best["policy"],
        "best_baseline_mean": best["mean"],
        "gap_points": _points(cal["mean"], best["mean"]),
        "traces": len(traces),
        "traces_calibrated_ge_every_baseline": sum(
            1 for t in traces if all(cal[t] >= b[t] for b in base)
        ),
        "calibrated_lowest_std": all(cal["std"] <= b["std"] for b in base),
        "means": {r["policy"]: r["mean"] for r in table},
        "stds": {r["policy"]: r["std"] for r in table},
    }


def _misses(rows: Sequence[Row]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for r in rows:
        total = out.setdefault(r["policy"], {})
        for term, n in r["misses"].items():
            total[term] = total.get(term, 0) + int(n)
    return out


def _ablation(rows: Sequence[Row]) -> Row:
    means = {v: mean_or_nan([r["goodput"] for r in g]) for (v,), g in _by(rows, "variant").items()}
    out: Row = {"means": {v: round(m, 4) for v, m in means.items()}}
    if "calibrated" in means:
        out["points_vs_calibrated"] = {
            v: _points(m, means["calibrated"]) for v, m in means.items() if v != "calibrated"
        }
    out["levers_points"] = {
        lever: _points(means[on], means[off])
        for lever, (on, off) in LEVERS.items()
        if on in means and off in means
    }
    return out


def _robustness(rows: Sequence[Row]) -> Row:
    out: Row = {}
    for (case,), g in _by(rows, "case").items():
        means = {
            p: mean_or_nan([r["goodput"] for r in pg]) for (p,), pg in _by(g, "policy").items()
        }
        entry: Row = {"means": {p: round(m, 4) for p, m in means.items()}}
        base = {p: means[p] for p in BASELINES if p in means}
        if "calibrated" in means and base:
            best = max(base, key=lambda p: base[p])
            entry |= {
                "calibrated_mean": round(means["calibrated"], 4),
                "best_baseline": best,
                "best_baseline_mean": round(base[best], 4),
                "gap_points": _points(means["calibrated"], base[best]),
            }
        out[case] = entry
    return out


def _gpu_count(rows: Sequence[Row]) -> Row:
    out: Row = {}
    for (setup,), g in _by(rows, "setup").items():
        table = sweep_table(g, "gpus")
        entry: Row = {
            "means": {str(r["gpus"]): {k: v for k, v in r.items() if k != "gpus"} for r in table}
        }
        rr7 = next((r["round_robin"] for r in table if r["gpus"] == 7), None)
        if rr7 is not None:
            matching = [r["gpus"] for r in table if r.get("calibrated", -1.0) >= rr7]
            entry["round_robin_at_7"] = rr7
            entry["calibrated_fewest_matching"] = min(matching) if matching else None
        out[setup] = entry
    return out


def _gain_over_baselines(table: Sequence[Row], key: str) -> dict[str, float]:
    return {
        str(r[key]): _points(r["calibrated"], max(r[p] for p in BASELINES if p in r))
        for r in table
        if "calibrated" in r and any(p in r for p in BASELINES)
    }


def findings(experiments: dict[str, list[Row]]) -> Row:
    """The findings (numbers only; docs/results/ interprets them); keys in the module docstring."""
    out: Row = {}
    main = groups(experiments.get("main", []))
    if main:
        out["main"] = {g: _versus_baselines(main_table(rows)) for g, rows in main.items()}
        out["misses"] = {g: _misses(rows) for g, rows in main.items()}
    if experiments.get("ablation"):
        out["ablation"] = _ablation(experiments["ablation"])
    if experiments.get("robustness"):
        out["robustness"] = _robustness(experiments["robustness"])
    if experiments.get("gpu_count"):
        out["gpu_count"] = _gpu_count(experiments["gpu_count"])
    if experiments.get("hardware_spread"):
        out["hardware_spread"] = {
            str(r["hardware_spread"]): _points(r["calibrated"], r["uncalibrated"])
            for r in sweep_table(experiments["hardware_spread"], "hardware_spread")
        }
    if experiments.get("pool_size"):
        out["pool_size_gain_points"] = _gain_over_baselines(
            sweep_table(experiments["pool_size"], "decode_pool"), "decode_pool"
        )
    if experiments.get("heterogeneity"):
        out["heterogeneity_gain_points"] = _gain_over_baselines(
            sweep_table(experiments["heterogeneity"], "length_sigma"), "length_sigma"
        )
    if experiments.get("scarcity"):
        out["scarcity"] = sweep_table(experiments["scarcity"], "load")
    if experiments.get("herding"):
        out["herding"] = sweep_table(experiments["herding"], "view")
    if experiments.get("constant_error"):
        out["constant_error"] = {
            g: _constant_error(rows) for g, rows in groups(experiments["constant_error"]).items()
        }
    return out


def _constant_error(rows: Sequence[Row]) -> Row:
    """Per scorer: mean goodput per error factor, and what each factor loses against 1.0."""
    out: Row = {}
    for (scorer,), g in _by(rows, "policy").items():
        means = {
            str(f): round(mean_or_nan([r["goodput"] for r in fg]), 4)
            for (f,), fg in sorted(_by(g, "error_factor").items())
        }
        ref = means.get("1.0")
        out[scorer] = {
            "means": means,
            "loss_points": {f: _points(m, ref) for f, m in means.items()} if ref else {},
        }
    return out


def _setup_line(name: str, s: Row) -> str:
    split = f"{s['split']['prefill']}P + {s['split']['decode']}D"
    if "slo_levels" in s:
        slos = "; ".join(
            f"{level}: TTFT {v['ttft_s']}s TPOT {v['tpot_s']}s, rates "
            + ", ".join(f"{r:.2f}" for r in s["rates_rps"][level])
            for level, v in s["slo_levels"].items()
        )
    else:
        slos = (
            ", ".join(
                f"{k}: TTFT {v['ttft_s']}s TPOT {v['tpot_s']}s" for k, v in s["slo_classes"].items()
            )
            + "; rates "
            + ", ".join(f"{r:.2f}" for r in s["rates_rps"])
        )
    return (
        f"{name}: {s['profile']} ({split}), router scrape {s['router']['scrape_interval_s']} s, "
        f"rates (req/s) where round-robin attains {s['target_goodput']} goodput; {slos}\n"
    )


def tables(doc: Row) -> str:
    """A plain-text rendering of the experiment document for the terminal."""
    buf = io.StringIO()
    exps = doc["experiments"]
    for name, s in doc["setups"].items():
        buf.write(_setup_line(name, s))
    buf.write("\n")
    for g, rows in groups(exps["main"]).items():
        buf.write(render(f"main [{g}]: goodput per trace (mean over seeds)", main_table(rows)))
    if exps["ablation"]:
        points = findings({"ablation": exps["ablation"]})["ablation"].get(
            "points_vs_calibrated", {}
        )
        buf.write(
            render(
                "ablation [paper/tight]: each variant of calibrated (std over traces and seeds)",
                [
                    {
                        "variant": r["variant"],
                        "goodput": round(r["mean"], 4),
                        "std": round(r["std"], 4),
                        "points_vs_calibrated": points.get(r["variant"], 0.0),
                    }
                    for r in bar_stats(exps["ablation"], "variant")
                ],
            )
        )
    if exps["robustness"]:
        buf.write(
            render(
                "robustness [paper/tight]: goodput per case (each at its own operating point)",
                sweep_table(exps["robustness"], "case"),
            )
        )
    if exps.get("herding"):
        buf.write(
            render(
                "herding [llama8b]: goodput per view of the pool between scrapes (main rate)",
                sweep_table(exps["herding"], "view"),
            )
        )
    sweeps = (
        ("pool_size", "decode_pool", "goodput vs decode instances (each at its operating point)"),
        ("heterogeneity", "length_sigma", "goodput vs log-normal length spread"),
        ("scarcity", "load", "goodput vs load (x the main rate)"),
        ("hardware_spread", "hardware_spread", "calibrated vs datasheet constants by speed spread"),
    )
    for name, key, title in sweeps:
        if exps[name]:
            buf.write(render(f"{name} [llama8b]: {title}", sweep_table(exps[name], key)))
    for g, rows in groups(exps.get("constant_error", [])).items():
        buf.write(
            render(
                f"constant_error [{g}]: goodput vs a uniform error of the decode constants",
                sweep_table(rows, "error_factor"),
            )
        )
    for setup, rows in _by(exps["gpu_count"], "setup").items():
        buf.write(
            render(
                f"gpu_count [{setup[0]}]: goodput vs total GPUs at the rate 7 GPUs carry",
                sweep_table(rows, "gpus"),
            )
        )
    buf.write("findings:\n")
    for k, v in doc["findings"].items():
        if k in ("scarcity", "herding", "constant_error"):
            continue
        if isinstance(v, dict) and all(isinstance(x, dict) for x in v.values()):
            buf.write(f"  {k}:\n")
            for sub, x in v.items():
                brief = {a: b for a, b in x.items() if a not in ("means", "stds")}
                buf.write(f"    {sub}: {brief}\n")
        else:
            buf.write(f"  {k}: {v}\n")
    return buf.getvalue()
