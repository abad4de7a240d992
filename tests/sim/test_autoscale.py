"""Autoscaling in the simulator: pods that start late, serve, drain without losing a request; the
traffic shapes; the experiment's rows (sim.elastic, sim.autoscale_traffic, sim.autoscale_study)."""

from __future__ import annotations

import dataclasses

import pytest

from disaggpool.core.autoscaling import Bounds, HeterogeneityScaler
from disaggpool.core.autoscaling_baselines import StaticPeak
from disaggpool.core.contracts import SLOClass
from disaggpool.core.demand import DemandWindow
from disaggpool.core.hardware import builtin_profile
from disaggpool.core.policies.registry import make_policy
from disaggpool.core.predictor import make_predictor
from disaggpool.formats.embedded import azure_services
from disaggpool.formats.traces import TraceRequest
from disaggpool.sim.autoscale_study import AutoscaleConfig, findings, run_autoscale
from disaggpool.sim.autoscale_traffic import shaped_trace
from disaggpool.sim.cluster import InstanceSpec, Simulation
from disaggpool.sim.elastic import ElasticController
from disaggpool.sim.metrics import summarize

QWEN = builtin_profile("a40-qwen2.5-3b")
SLO = {"chat": SLOClass("chat", 2.0, 0.05)}


def pool(serving: int, total: int) -> list[InstanceSpec]:
    out = [InstanceSpec("prefill-0", "prefill", QWEN, QWEN)]
    for i in range(total):
        out.append(InstanceSpec(f"decode-{i}", "decode", QWEN, QWEN, standby=i >= serving))
    return out


def steady(rate: float, seconds: float) -> list[TraceRequest]:
    n = int(rate * seconds)
    return [TraceRequest(i / rate, 600, 120, "chat") for i in range(n)]


def run(instances, scaler, trace, *, startup_s: float, window: DemandWindow | None = None):  # type: ignore[no-untyped-def]
    decode = [i for i in instances if i.role == "decode"]
    controller = ElasticController(
        scaler,
        [i.name for i in decode],
        {i.name: i.true_profile for i in instances},
        SLO,
        prefill_pods=1,
        startup_s=startup_s,
        window=window or DemandWindow(window_s=10.0, bin_s=1.0, burst_window_s=20.0, trend_s=4.0),
    )
    sim = Simulation(
        instances,
        policies=[make_policy("least_loaded")],
        predictor=make_predictor("online"),
        slo_classes=SLO,
        default_class="chat",
        seed=1,
        controller=controller,
    )
    controller.attach(sim)
    outcome = sim.run(trace)
    controller.close(outcome.end_time)
    return outcome, controller


def test_pods_asked_for_serve_after_their_cold_start_and_count_from_the_ask() -> None:
    instances = pool(serving=1, total=3)
    trace = steady(4.0, 60.0)
    outcome, c = run(instances, StaticPeak(Bounds(1, 3, 30.0)), trace, startup_s=30.0)
    # The scaler first acts when the 10 s window is full: two pods asked at t=10, serving at 40.
    assert c.reasons[0][:2] == (10.0, 3)
    late = [r for r in outcome.requests if r.decode_instance != "decode-0"]
    assert late and min(r.arrival for r in late) >= 40.0
    assert {r.decode_instance for r in late} == {"decode-1", "decode-2"}
    # GPU time: prefill and decode-0 the whole run, two more decode pods from t=10.
    end = outcome.end_time
    assert c.decode_gpu_s == pytest.approx(end + 2 * (end - 10.0))
    assert c.gpu_s == pytest.approx(c.decode_gpu_s + end)
    assert all(r.finish >= 0 for r in outcome.requests)


def test_a_drained_pod_finishes_its_requests_and_stops_counting() -> None:
    instances = pool(serving=3, total=3)
    scaler = HeterogeneityScaler(Bounds(1, 3, 5.0, 5.0), [QWEN], SLO["chat"].tpot_s, 0.9)
    outcome, c = run(instances, scaler, steady(2.0, 120.0), startup_s=5.0)
    assert all(r.finish >= 0 for r in outcome.requests)  # nothing lost while draining
    assert summarize(outcome, SLO)["completed"] == len(outcome.requests)
    # 2 req/s of 120-token outputs needs one pod: the pool shrinks to it, one pod at a time.
    assert [n for _, n, _ in c.reasons] == [2, 1]
    assert c.timeline.serving[-1] == 1
    assert c.decode_gpu_s < 3 * outcome.end_time
    drained = {r.decode_instance for r in outcome.requests if r.arrival > 60.0}
    assert len(drained) == 1


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


def autoscale_scenario(tmp_path, section: str) -> object:  # type: ignore[no-untyped-def]
    from disaggpool.sim.scenario import load_scenario

    path = tmp_path / "s.yaml"
    path.write_text(
        f"""
name: grow
pool:
  prefill: [{{count: 2, profile: a40-qwen2.5-3b}}]
  decode: [{{count: 1, profile: a40-qwen2.5-3b}}]
slo_classes: [{{name: chat, ttft_s: 2.0, tpot_s: 0.05}}]
trace:
  generate: {{process: poisson, rate: 16, n: 2400, prompt_mean: 1000, output_mean: 200,
             sigma: 0.6, classes: {{chat: 1.0}}}}
policies: [least_loaded, calibrated]
{section}
"""
    )
    return load_scenario(path)


def test_a_scenario_file_compares_autoscalers_from_its_own_pool(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from disaggpool.sim.autoscale_study import run_scenario

    s = autoscale_scenario(
        tmp_path,
        "autoscaling: {max_decode: 3, startup_s: 20, stabilization_s: 60,"
        " autoscalers: [static_peak, disaggpool]}",
    )
    doc = run_scenario(s, workers=2)  # type: ignore[arg-type]
    rows = {r["autoscaler"]: r for r in doc["experiments"]["autoscale"]}
    assert doc["config"]["policy"] == "calibrated"
    assert rows["static_peak"]["timeline"]["decode_pods"][0] == 3  # the peak pool throughout
    ours = rows["disaggpool"]
    assert ours["timeline"]["decode_pods"][0] == 1  # the file's pool is where it starts
    assert ours["max_decode"] == 3 and ours["scale_events"] >= 1  # 16 req/s needs more
    assert ours["gpu_hours"] < rows["static_peak"]["gpu_hours"]


@pytest.mark.parametrize(
    ("section", "field"),
    [
        ("autoscaling: {min_decode: 1}", "autoscaling.max_decode"),
        ("autoscaling: {min_decode: 2, max_decode: 3}", "autoscaling.max_decode"),
        ("autoscaling: {max_decode: 3, autoscalers: [hpa]}", "autoscaling.autoscalers[0]"),
        ("autoscaling: {max_decode: 3, target_goodput: 1}", "autoscaling.target_goodput"),
        ("autoscaling: {max_decode: 3, colour: red}", "autoscaling.colour"),
    ],
)
def test_a_bad_autoscaling_section_names_its_field(tmp_path, section: str, field: str) -> None:  # type: ignore[no-untyped-def]
    from disaggpool.errors import InputError

    with pytest.raises(InputError) as err:
        autoscale_scenario(tmp_path, section)
    assert err.value.field == field, str(err.value)
