"""The autoscaling study (`studies.autoscale_traffic`, `studies.autoscale_study`): the traffic
shapes and their peaks, the experiment's rows and findings, and a scenario file's autoscalers
compared."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from disaggpool.core.autoscaling import PoolState, ScaleDecision
from disaggpool.core.autoscaling_baselines import Autoscaler
from disaggpool.core.demand import Demand
from disaggpool.core.hardware import builtin_profile
from disaggpool.engine.request import EngineRequest
from disaggpool.formats.embedded import azure_services
from disaggpool.formats.traces import TraceRequest
from disaggpool.sim.capacity import pool_capacity
from disaggpool.sim.scenario import load_scenario
from disaggpool.studies.autoscale_study import (
    PROFILE,
    AutoscaleConfig,
    AutoscaleSpec,
    autoscale_row,
    findings,
    peak_rps,
    run_autoscale,
    run_scenario,
    shape_peak,
    simulate_autoscale,
)
from disaggpool.studies.autoscale_traffic import SHAPES, scaled_lengths, shaped_trace

#: One request length per service: a shape's multipliers then show exactly in each request.
FLAT = {"chat": [TraceRequest(0.0, 1000, 100, "chat")], "code": [TraceRequest(0.0, 50, 20)]}


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


def test_a_scenario_file_routes_with_its_own_switches(tmp_path: Path) -> None:
    """`router.pd_decider` and `router.priority_scheduling` of the file reach the runs."""
    served: list[list[EngineRequest]] = []
    keep = _keeping(served)

    for router in ("{}", "{pd_decider: false, priority_scheduling: true}"):
        path = tmp_path / "s.yaml"
        path.write_text(
            f"""
name: crowd
pool:
  prefill: [{{count: 1, profile: a40-qwen2.5-3b}}]
  decode: [{{count: 2, profile: a40-qwen2.5-3b}}]
slo_classes: [{{name: chat, ttft_s: 0.5, tpot_s: 0.05}}]
trace:
  generate: {{process: poisson, rate: 30, n: 900, prompt_mean: 1500, output_mean: 50,
             sigma: 0.6, classes: {{chat: 1.0}}}}
policies: [calibrated]
router: {router}
autoscaling: {{max_decode: 2, startup_s: 20, autoscalers: [static_peak]}}
"""
        )
        run_scenario(load_scenario(path), workers=1, run=keep)
    default, switched = ([r for r in requests if r.first_token >= 0] for requests in served)
    assert any(not r.prefill_instance for r in default)  # the decider on, the file's default
    assert {r.priority for r in default} == {0}
    assert all(r.prefill_instance for r in switched) and {r.priority for r in switched} == {0, 1}


def test_mixshift_makes_outputs_ten_times_longer_in_the_middle_third_in_whole_minutes() -> None:
    flat = shaped_trace("mixshift", 5.0, 1000.0, FLAT, seed=1)
    # Thirds of 1000 s rounded down to minutes: 300 s and 660 s.
    assert {r.output_tokens for r in flat if 300.0 <= r.arrival_s < 660.0} == {1000}
    assert {r.output_tokens for r in flat if not 300.0 <= r.arrival_s < 660.0} == {100}
    assert {r.prompt_tokens for r in flat} == {1000} and {r.slo_class for r in flat} == {"chat"}
    real = shaped_trace("mixshift", 5.0, 900.0, azure_services(), seed=1, max_context=8192)
    first, middle, last = (
        [r for r in real if k * 300.0 <= r.arrival_s < (k + 1) * 300.0] for k in range(3)
    )
    mean = [statistics.fmean(r.output_tokens for r in part) for part in (first, middle, last)]
    assert 8.5 < mean[1] / mean[0] < 11.0 and 0.8 < mean[2] / mean[0] < 1.25
    assert all(r.prompt_tokens + r.output_tokens <= 8192 for r in middle if r.output_tokens > 1000)
    assert 0.85 < len(middle) / len(first) < 1.15  # the rate is constant


def test_flash_is_seven_times_the_base_rate_for_two_minutes() -> None:
    trace = shaped_trace("flash", 14.0, 1000.0, FLAT, seed=1)
    inside = sum(1 for r in trace if 400.0 <= r.arrival_s < 520.0)
    outside = len(trace) - inside
    assert 5.5 < (inside / 120.0) / (outside / 880.0) < 8.5
    assert 11.0 < inside / 120.0 < 17.0  # the flash is the peak


def test_promptramp_grows_prompts_from_one_to_four_times() -> None:
    flat = shaped_trace("promptramp", 5.0, 1000.0, FLAT, seed=1)
    assert all(r.prompt_tokens == round(1000 * (1 + 3 * r.arrival_s / 1000)) for r in flat)
    assert {r.output_tokens for r in flat} == {100}
    real = shaped_trace("promptramp", 5.0, 1000.0, azure_services(), seed=1)
    first = statistics.fmean(r.prompt_tokens for r in real if r.arrival_s < 100.0)
    last = statistics.fmean(r.prompt_tokens for r in real if r.arrival_s >= 900.0)
    assert 2.8 < last / first < 4.2  # 3.85x over 1.15x of the prompts, on average


@pytest.mark.parametrize("shape", ["mixshift", "flash", "promptramp"])
def test_new_shapes_are_deterministic_in_their_seed_and_history_is_unscaled(shape: str) -> None:
    trace = shaped_trace(shape, 5.0, 600.0, FLAT, seed=1, history_s=120.0)
    assert shaped_trace(shape, 5.0, 600.0, FLAT, seed=1, history_s=120.0) == trace
    assert shaped_trace(shape, 5.0, 600.0, FLAT, seed=2, history_s=120.0) != trace
    before = [r for r in trace if r.arrival_s < 0]
    assert before and {(r.prompt_tokens, r.output_tokens) for r in before} == {(1000, 100)}


def test_the_first_shapes_leave_lengths_alone_whatever_the_context() -> None:
    services = azure_services()
    for shape in ("diurnal", "ramp", "bursts", "shift"):
        plain = shaped_trace(shape, 10.0, 300.0, services, seed=1)
        assert shaped_trace(shape, 10.0, 300.0, services, seed=1, max_context=8192) == plain


def test_scaled_lengths_stay_within_the_context() -> None:
    assert scaled_lengths(1000, 500, 1.0, 10.0, 4096) == (1000, 3096)
    assert scaled_lengths(1000, 500, 1.0, 10.0, None) == (1000, 5000)
    assert scaled_lengths(3000, 100, 4.0, 1.0, 8192) == (8092, 100)
    assert scaled_lengths(9000, 10, 4.0, 10.0, 8192) == (9000, 10)  # over already: as it was


def test_each_shape_peaks_at_its_role_share_of_the_largest_pool() -> None:
    cfg = AutoscaleConfig()
    profile = builtin_profile(PROFILE)
    chat = azure_services()["chat"]
    tpot = 0.03
    chat_peak = peak_rps(cfg, profile, chat, tpot)
    for name in ("diurnal", "ramp", "bursts", "shift", "flash"):
        assert shape_peak(SHAPES[name], cfg, profile, chat, tpot) == chat_peak
    # Ten times the output: each request holds its slot about ten times as long.
    mixshift = shape_peak(SHAPES["mixshift"], cfg, profile, chat, tpot)
    assert chat_peak / 30 < mixshift < chat_peak / 8
    ramp = shape_peak(SHAPES["promptramp"], cfg, profile, chat, tpot)
    at_end = [TraceRequest(0.0, *scaled_lengths(r.prompt_tokens, r.output_tokens, 4.0, 1.0,
                                                profile.max_model_len)) for r in chat]  # fmt: skip
    prefill = pool_capacity(profile, at_end, tpot).prefill_rps
    assert ramp == pytest.approx(0.75 * cfg.n_prefill * prefill)
    one_decode = dataclasses.replace(cfg, max_decode=1)
    with pytest.raises(ValueError, match="over the decode pool"):  # one pod cannot keep up
        shape_peak(SHAPES["promptramp"], one_decode, profile, chat, tpot)


def test_a_run_reports_its_prefill_pods_and_their_gpu_hours() -> None:
    cfg = dataclasses.replace(
        AutoscaleConfig.quick(), duration_s=240.0, shapes=("flash",), autoscalers=("static_peak",)
    )
    doc = run_autoscale(cfg, workers=1)
    (row,) = doc["experiments"]["autoscale"]
    assert doc["setup"]["shape_peak_rps"]["flash"] == doc["setup"]["peak_rps"]
    # The prefill counterpart of static_peak holds the 2 prefill pods throughout.
    assert row["max_prefill"] == 2 and row["mean_prefill"] == pytest.approx(2.0, abs=1e-3)
    assert set(row["timeline"]["prefill_pods"]) == {2}
    assert row["gpu_hours"] == pytest.approx(
        row["decode_gpu_hours"] + row["prefill_gpu_hours"], abs=2e-4
    )


def test_the_router_runs_as_deployed_and_priority_scheduling_reaches_the_engines() -> None:
    """Every autoscaler's pool is routed as a deployed router routes it (the P/D decider on:
    decode pods prefill some prompts themselves in a crowd; `pd_decider=False` turns it off),
    and `priority_scheduling` turns on both halves: the router's priorities and engines that
    honour them."""
    served: list[list[EngineRequest]] = []
    keep = _keeping(served)

    cfg = dataclasses.replace(
        AutoscaleConfig.quick(), duration_s=300.0, shapes=("flash",), autoscalers=("keda_queue",)
    )
    run_autoscale(cfg, workers=1, run=keep)
    run_autoscale(dataclasses.replace(cfg, priority_scheduling=True), workers=1, run=keep)
    run_autoscale(dataclasses.replace(cfg, pd_decider=False), workers=1, run=keep)
    fcfs, priority, no_decider = served
    assert any(r.prefill_instance == "" and r.first_token >= 0 for r in fcfs)  # prefilled locally
    assert all(r.prefill_instance for r in no_decider if r.first_token >= 0)
    assert {r.priority for r in fcfs} == {0}
    assert {r.priority for r in priority} == {0, 1}


def _keeping(served: list[list[EngineRequest]]) -> Callable[[AutoscaleSpec], dict[str, Any]]:
    """A `run=` for the studies that keeps each run's requests in `served`, in run order."""

    def keep(spec: AutoscaleSpec) -> dict[str, Any]:
        outcome, controller = simulate_autoscale(spec)
        served.append(outcome.requests)
        return autoscale_row(spec, outcome, controller)

    return keep


def test_wrap_puts_each_roles_autoscaler_behind_a_wrapper() -> None:
    """`simulate_autoscale(wrap=)` passes each role's autoscaler through the wrapper, whose
    decisions are the ones the pool follows (what `bench/autoscale_foresight.py` relies on)."""
    wrapped: list[str] = []

    class OnePod:
        """Asks for one pod, whatever the autoscaler inside (still consulted) asks for."""

        def __init__(self, inner: Autoscaler) -> None:
            self.inner, self.name = inner, inner.name

        def decide(self, demand: Demand, pool: PoolState) -> ScaleDecision:
            self.inner.decide(demand, pool)
            return ScaleDecision(1, "one pod")

    def wrap(role: str, scaler: Autoscaler) -> Autoscaler:
        wrapped.append(role)
        return OnePod(scaler)

    def run(spec: AutoscaleSpec) -> dict[str, Any]:
        return autoscale_row(spec, *simulate_autoscale(spec, wrap=wrap))

    cfg = dataclasses.replace(
        AutoscaleConfig.quick(), duration_s=300.0, shapes=("flash",), autoscalers=("static_peak",)
    )
    (row,) = run_autoscale(cfg, workers=1, run=run)["experiments"]["autoscale"]
    assert wrapped == ["decode", "prefill"]
    # The static pool asks for every pod; behind the wrapper both roles drain to one.
    assert row["timeline"]["decode_pods"][-1] == 1
    assert row["timeline"]["prefill_pods"][-1] == 1
