"""`disaggpool sim paper --quick` end to end: both setups, every experiment, rows well formed.

One quick run (module fixture, through the CLI) feeds every test here.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest

from disaggpool.cli import main
from disaggpool.studies import paper, paper_setup, paper_study
from disaggpool.studies.paper_setup import BASELINES

ROW_KEYS = {
    "setup",
    "trace",
    "policy",
    "seed",
    "goodput",
    "misses",
    "ttft_p99_s",
    "tpot_p99_s",
    "requests",
    "prefill_instances",
    "decode_instances",
    "options",
    "router",
    "predictor",
}
# The key each experiment's rows carry, and which setup runs it (None: both).
EXPERIMENT_KEYS: dict[str, tuple[str, str | None]] = {
    "main": ("rate_rps", None),
    "ablation": ("variant", "paper"),
    "robustness": ("case", "paper"),
    "pool_size": ("decode_pool", "llama8b"),
    "heterogeneity": ("length_sigma", "llama8b"),
    "scarcity": ("load", "llama8b"),
    "herding": ("view", "llama8b"),
    "hardware_spread": ("hardware_spread", "llama8b"),
    "gpu_count": ("gpus", None),
    "constant_error": ("error_factor", None),
}
SWEEP_LABELS = {"round_robin", "least_loaded", "length", "calibrated"}

Doc = dict[str, Any]


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[Doc, str, Path]:
    out = tmp_path_factory.mktemp("paper")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(
            ["sim", "paper", "--quick", "--json", str(out / "paper.json"), "--plots", str(out)]
        )
    assert code == 0
    return json.loads((out / "paper.json").read_text()), printed.getvalue(), out


def _rows(doc: Doc, experiment: str, **match: Any) -> list[Doc]:
    return [
        r for r in doc["experiments"][experiment] if all(r.get(k) == v for k, v in match.items())
    ]


def _labels(rows: list[Doc]) -> set[str]:
    return {r["policy"] for r in rows}


@pytest.mark.slow
@pytest.mark.timeout(300)  # one quick run of both setups (under a minute alone, more when busy)
def test_both_setups_and_every_experiment(quick: tuple[Doc, str, Path]) -> None:
    doc, _, _ = quick
    assert list(doc["experiments"]) == list(paper.EXPERIMENTS)
    assert set(doc["setups"]) == {"llama8b", "paper"}
    llama, study = doc["setups"]["llama8b"], doc["setups"]["paper"]
    assert llama["split"]["prefill"] + llama["split"]["decode"] == 8
    assert study["split"] == {"prefill": 2, "decode": 4}
    assert study["slo_levels"]["tight"] == {"ttft_s": 0.175, "tpot_s": 0.0397}
    assert study["slo_levels"]["loose"]["ttft_s"] == pytest.approx(3 * 0.175)
    for name, (key, setup) in EXPERIMENT_KEYS.items():
        rows = doc["experiments"][name]
        assert rows, name
        assert {r["setup"] for r in rows} == ({setup} if setup else {"llama8b", "paper"}), name
        for row in rows:
            assert set(row) >= ROW_KEYS | {key}, (name, sorted(row))
            assert 0.0 <= row["goodput"] <= 1.0
            # Every request that did not meet its SLO is counted once, under one term.
            good = round(row["goodput"] * row["requests"])
            assert sum(row["misses"].values()) == row["requests"] - good, (name, row["misses"])
            if row["setup"] == "paper":
                assert row["slo"] in ("tight", "loose")
            else:
                assert "slo" not in row


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_each_experiment_runs_its_policies(quick: tuple[Doc, str, Path]) -> None:
    doc, _, _ = quick
    llama_main = _rows(doc, "main", setup="llama8b")
    assert _labels(llama_main) == set(paper.LLAMA8B_LABELS)
    assert {r["trace"] for r in llama_main} == {"mixed-0", "mixed-1", "mixed-2"}
    for level in paper_study.SLO_LEVELS:
        rows = _rows(doc, "main", setup="paper", slo=level)
        assert _labels(rows) == set(paper_study.MAIN_LABELS), level
        assert {r["trace"] for r in rows} == {"mixed-0", "mixed-1", "mixed-2"}
    # What the router knows: scraped every second, unless the experiment varies it.
    assert {r["router"]["scrape_interval_s"] for r in doc["experiments"]["main"]} == {1.0}
    cal = _rows(doc, "main", policy="calibrated")
    assert all(r["options"]["pd_decider"] for r in cal)
    local = _rows(doc, "main", policy="length+local<512")
    assert all(r["options"]["local_prefill_below"] == 512 for r in local)
    for name in ("pool_size", "heterogeneity", "gpu_count"):
        assert _labels(doc["experiments"][name]) == SWEEP_LABELS, name
    assert _labels(doc["experiments"]["scarcity"]) == {
        "round_robin",
        "random",
        "calibrated_greedy",
        "calibrated",
    }
    assert _labels(doc["experiments"]["hardware_spread"]) == {
        "least_loaded",
        "uncalibrated",
        "calibrated",
    }
    herding = doc["experiments"]["herding"]
    assert _labels(herding) == set(paper.HERDING_LABELS)
    views = {r["view"]: r["router"] for r in herding}
    assert set(views) == set(paper.HERDING_VIEWS)
    assert (views["16_replicas"]["replicas"], views["no_books"]["own_books"]) == (16, False)
    assert (views["own_books"]["replicas"], views["own_books"]["own_books"]) == (1, True)
    shared = views["16_replicas_shared"]
    assert (shared["replicas"], shared["shared_books"], shared["bus_delay_s"]) == (16, True, 0.005)
    assert not views["16_replicas"]["shared_books"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ablation_and_robustness_rows(quick: tuple[Doc, str, Path]) -> None:
    doc, _, _ = quick
    ablation = doc["experiments"]["ablation"]
    assert {r["slo"] for r in ablation} == {"tight"}
    variants = {r["variant"]: r for r in ablation}
    assert list(variants) == list(paper_study.VARIANTS)
    assert variants["no_pd_decider"]["options"]["pd_decider"] is False
    assert variants["late_binding"]["router"]["late_binding"] is True
    assert variants["fresh_state"]["router"]["scrape_interval_s"] == 0.0
    assert variants["oracle_predictor"]["predictor"] == "oracle"
    assert variants["no_guard"]["policy"] == "calibrated_greedy"
    assert variants["datasheet_no_pd"]["policy"] == "uncalibrated"
    assert variants["priority_scheduling"]["options"]["priority_scheduling"] is True
    assert variants["calibrated"]["options"]["priority_scheduling"] is False
    errors = doc["experiments"]["constant_error"]
    assert {r["slo"] for r in errors if r["setup"] == "paper"} == {"tight"}
    assert _labels(errors) == set(paper_setup.ERROR_ARMS)
    assert {r["error_factor"] for r in errors} == set(paper_setup.ERROR_FACTORS)
    found = doc["findings"]["constant_error"]
    assert set(found) == {"llama8b", "paper/tight"}
    for group in found.values():
        assert set(group) == set(paper_setup.ERROR_ARMS)
        assert group["seconds"]["loss_points"]["1.0"] == 0.0
    robustness = doc["experiments"]["robustness"]
    assert {r["slo"] for r in robustness} == {"tight"}
    for case in paper_study.CASES:
        rows = _rows(doc, "robustness", case=case)
        assert _labels(rows) == set(paper_study.ROBUSTNESS_LABELS), case
    split = {
        r["case"]: (r["prefill_instances"], r["decode_instances"], r["router"]["replicas"])
        for r in robustness
    }
    assert split == {
        "homogeneous_chat": (2, 4, 1),
        "scarce_1p2d": (1, 2, 1),
        "decode3": (2, 3, 1),
        "stale_replicas": (2, 4, 4),
    }
    chat = _rows(doc, "robustness", case="homogeneous_chat")
    assert set(chat[0]["summary"]["classes"]) == {"chat"}
    for r in _rows(doc, "gpu_count", setup="paper"):
        assert (r["prefill_instances"], r["decode_instances"]) == paper_study.study_split(r["gpus"])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_findings_tables_and_plots(quick: tuple[Doc, str, Path]) -> None:
    doc, printed, out = quick
    findings = doc["findings"]
    assert set(findings["main"]) == {"llama8b", "paper/tight", "paper/loose"}
    for group in findings["main"].values():
        assert group["best_baseline"] in BASELINES
        assert 0 <= group["traces_calibrated_ge_every_baseline"] <= group["traces"] == 3
        assert group["gap_points"] == pytest.approx(
            100 * (group["calibrated_mean"] - group["best_baseline_mean"]), abs=0.02
        )
    assert set(findings["misses"]["paper/tight"]) == set(paper_study.MAIN_LABELS)
    assert set(findings["ablation"]["levers_points"]) == set(paper_study.LEVERS)
    assert set(findings["robustness"]) == set(paper_study.CASES)
    assert set(findings["gpu_count"]) == {"llama8b", "paper"}
    # Overload must hurt: the scarcity sweep's heaviest load is worse than its lightest.
    by_load = {r["load"]: r["goodput"] for r in _rows(doc, "scarcity", policy="round_robin")}
    assert by_load[max(by_load)] < by_load[min(by_load)]
    assert {p.name for p in out.glob("*.png")} == {
        "main_llama8b.png",
        "main_paper.png",
        "ablation.png",
        "robustness.png",
        "pool_size.png",
        "heterogeneity.png",
        "scarcity.png",
        "herding.png",
        "hardware_spread.png",
        "gpu_count.png",
        "constant_error.png",
    }
    for title in (
        "main [llama8b]",
        "main [paper/tight]",
        "ablation [",
        "robustness [",
        "findings:",
    ):
        assert title in printed
