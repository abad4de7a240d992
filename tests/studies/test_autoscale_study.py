"""The decode-autoscaling study (`studies.autoscale_traffic`, `studies.autoscale_study`): the
traffic shapes, the experiment's rows and findings, and a scenario file's autoscalers compared."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from disaggpool.formats.embedded import azure_services
from disaggpool.sim.scenario import load_scenario
from disaggpool.studies.autoscale_study import (
    AutoscaleConfig,
    findings,
    run_autoscale,
    run_scenario,
)
from disaggpool.studies.autoscale_traffic import shaped_trace


def test_shapes_follow_their_rate_and_the_shift_changes_the_mix() -> None:
    services = azure_services()
    diurnal = shaped_trace("diurnal", 20.0, 1000.0, services, seed=1)
    first = sum(1 for r in diurnal if r.arrival_s < 100)
    middle = sum(1 for r in diurnal if 450 <= r.arrival_s < 550)
    assert middle > 3 * first  # trough 15% of the peak, the middle at the peak
    bursts = shaped_trace("bursts", 20.0, 600.0, services, seed=1)
    in_burst = sum(1 for r in bursts if r.arrival_s % 300 >= 240)
    assert in_burst / 120 > 2 * (len(bursts) - in_burst) / 480
    shift = shaped_trace("shift", 20.0, 1000.0, services, seed=1)
    early = [r.slo_class for r in shift if r.arrival_s < 500]
    late = [r.slo_class for r in shift if r.arrival_s >= 500]
    assert set(early) == {"chat"} and 0.4 < late.count("code") / len(late) < 0.6
    assert shaped_trace("shift", 20.0, 1000.0, services, seed=1) == shift
    assert shaped_trace("shift", 20.0, 1000.0, services, seed=2) != shift  # the seed draws it
    with pytest.raises(ValueError, match="unknown traffic shape 'weekly'"):
        shaped_trace("weekly", 20.0, 100.0, services, seed=1)


def test_the_experiment_rows_and_findings() -> None:
    cfg = dataclasses.replace(
        AutoscaleConfig.quick(),
        duration_s=240.0,
        shapes=("shift",),
        autoscalers=("static_peak", "llmd_token", "disaggpool"),
    )
    doc = run_autoscale(cfg, workers=1)
    rows = doc["experiments"]["autoscale"]
    assert [r["autoscaler"] for r in rows] == ["static_peak", "llmd_token", "disaggpool"]
    for r in rows:
        assert {"trace", "seed", "goodput", "gpu_hours", "scale_events", "max_decode"} <= set(r)
        assert 0 < r["goodput"] <= 1 and r["gpu_hours"] > 0
        assert len(r["timeline"]["t"]) == len(r["timeline"]["decode_pods"])
    static = rows[0]
    assert static["scale_events"] == 0 and static["mean_decode"] == pytest.approx(3.0, abs=1e-3)
    f = doc["findings"]["autoscale"]["shift"]
    assert f["goodput"]["static_peak"] == pytest.approx(static["goodput"], abs=1e-4)
    assert f["vs_static_points"] == pytest.approx(
        100 * (rows[2]["goodput"] - static["goodput"]), abs=0.01
    )


def test_findings_say_when_ours_is_not_the_cheapest_at_its_goodput() -> None:
    rows = [
        {"trace": "t", "autoscaler": "static_peak", "goodput": 1.0, "gpu_hours": 2.0},
        {"trace": "t", "autoscaler": "llmd_token", "goodput": 0.99, "gpu_hours": 1.0},
        {"trace": "t", "autoscaler": "disaggpool", "goodput": 0.98, "gpu_hours": 1.5},
    ]
    f = findings(rows)["t"]
    assert f["vs_static_points"] == -2.0 and f["gpu_hours_saved"] == 0.25
    assert f["cheaper_than_every_rival_at_equal_goodput"] is False


def test_a_scenario_file_compares_autoscalers_from_its_own_pool(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(
        """
name: grow
pool:
  prefill: [{count: 2, profile: a40-qwen2.5-3b}]
  decode: [{count: 1, profile: a40-qwen2.5-3b}]
slo_classes: [{name: chat, ttft_s: 2.0, tpot_s: 0.05}]
trace:
  generate: {process: poisson, rate: 16, n: 2400, prompt_mean: 1000, output_mean: 200,
             sigma: 0.6, classes: {chat: 1.0}}
policies: [least_loaded, calibrated]
autoscaling: {max_decode: 3, startup_s: 20, stabilization_s: 60,
              autoscalers: [static_peak, disaggpool]}
"""
    )
    s = load_scenario(path)
    doc = run_scenario(s, workers=2)
    rows = {r["autoscaler"]: r for r in doc["experiments"]["autoscale"]}
    assert doc["config"]["policy"] == "calibrated"
    assert rows["static_peak"]["timeline"]["decode_pods"][0] == 3  # the peak pool throughout
    ours = rows["disaggpool"]
    assert ours["timeline"]["decode_pods"][0] == 1  # the file's pool is where it starts
    assert ours["max_decode"] == 3 and ours["scale_events"] >= 1  # 16 req/s needs more
    assert ours["gpu_hours"] < rows["static_peak"]["gpu_hours"]
