"""`disaggpool sim paper --quick` end to end: every experiment present, rows well formed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from disaggpool.cli import main

ROW_KEYS = {
    "trace",
    "policy",
    "seed",
    "goodput",
    "ttft_p99_s",
    "tpot_p99_s",
    "requests",
    "prefill_instances",
    "decode_instances",
}
SWEEP_KEYS = {
    "pool_size": "decode_pool",
    "heterogeneity": "length_sigma",
    "scarcity": "load",
    "gpu_count": "gpus",
    "ablation": "hardware_spread",
}


@pytest.mark.slow
def test_quick_paper_covers_every_experiment(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "paper.json"
    assert (
        main(["sim", "paper", "--quick", "--json", str(out), "--plots", str(tmp_path / "plots")])
        == 0
    )
    doc = json.loads(out.read_text())
    exps = doc["experiments"]
    assert set(exps) == {"main", "ablation", "pool_size", "heterogeneity", "scarcity", "gpu_count"}
    for name, rows in exps.items():
        assert rows, name
        for row in rows:
            assert set(row) >= ROW_KEYS, (name, row.keys())
            assert 0.0 <= row["goodput"] <= 1.0
            if name in SWEEP_KEYS:
                assert SWEEP_KEYS[name] in row
    main_policies = {r["policy"] for r in exps["main"]}
    assert {
        "round_robin",
        "least_loaded",
        "length",
        "random",
        "p2c",
        "calibrated",
        "uncalibrated",
    } <= main_policies
    assert {r["trace"] for r in exps["main"]} == {"mixed-0", "mixed-1", "mixed-2"}
    # overload must hurt: the scarcity sweep's heaviest load is worse than its lightest
    by_load = {r["load"]: r["goodput"] for r in exps["scarcity"] if r["policy"] == "round_robin"}
    assert by_load[max(by_load)] < by_load[min(by_load)]
    assert doc["setup"]["split"]["prefill"] + doc["setup"]["split"]["decode"] == 8
    assert len(list((tmp_path / "plots").glob("*.png"))) == 5
    printed = capsys.readouterr().out
    assert "main: goodput per trace" in printed and "findings:" in printed
