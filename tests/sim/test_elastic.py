"""Autoscaling in the simulator (`sim.elastic`): pods that start late and serve, pods that drain
without losing a request, decode and prefill alike; and the `autoscaling:` section of a scenario
file (`sim.scenario`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from disaggpool.core.autoscaling import Bounds, HeterogeneityScaler, PoolState, ScaleDecision
from disaggpool.core.autoscaling_baselines import StaticPeak
from disaggpool.core.contracts import SLOClass
from disaggpool.core.demand import Demand, DemandWindow
from disaggpool.core.hardware import builtin_profile
from disaggpool.core.policies.registry import make_policy
from disaggpool.core.predictor import make_predictor
from disaggpool.engine.request import EngineRequest
from disaggpool.errors import InputError
from disaggpool.formats.traces import TraceRequest
from disaggpool.sim.cluster import InstanceSpec, Simulation
from disaggpool.sim.elastic import ElasticController
from disaggpool.sim.metrics import summarize
from disaggpool.sim.scenario import Scenario, load_scenario

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


def autoscale_scenario(tmp_path: Path, section: str) -> Scenario:
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
def test_a_bad_autoscaling_section_names_its_field(
    tmp_path: Path, section: str, field: str
) -> None:
    with pytest.raises(InputError) as err:
        autoscale_scenario(tmp_path, section)
    assert err.value.field == field, str(err.value)


# ---------------------------------------------------------------------- prefill pods that scale
class Scripted:
    """A controller that serves and drains prefill instances at set times, and writes down what
    the simulation says of them then."""

    period_s = 5.0

    def __init__(self, actions: dict[float, list[tuple[str, str]]]) -> None:
        self.actions = actions
        self.sim: Simulation | None = None
        self.bound_at_drain: dict[str, int] = {}
        self.drained_at: dict[str, float] = {}

    def arrived(self, req: EngineRequest, now: float) -> None:
        pass

    def finished(self, req: EngineRequest, now: float) -> None:
        pass

    def tick(self, now: float) -> None:
        assert self.sim is not None
        for name in self.bound_at_drain:
            if name not in self.drained_at and self.sim.drained(name):
                self.drained_at[name] = now
        for verb, name in self.actions.get(now, []):
            getattr(self.sim, verb)(name)
            if verb == "drain":
                self.bound_at_drain[name] = self.sim.bound(name)


def prefill_pool(serving: int, total: int, n_decode: int = 2) -> list[InstanceSpec]:
    out = [
        InstanceSpec(f"prefill-{i}", "prefill", QWEN, QWEN, standby=i >= serving)
        for i in range(total)
    ]
    out += [InstanceSpec(f"decode-{i}", "decode", QWEN, QWEN) for i in range(n_decode)]
    return out


def simulate(instances: list[InstanceSpec], controller: Any) -> Simulation:
    sim = Simulation(
        instances,
        policies=[make_policy("least_loaded")],
        predictor=make_predictor("online"),
        slo_classes=SLO,
        default_class="chat",
        seed=1,
        controller=controller,
    )
    controller.sim = sim
    return sim


def test_a_standby_prefill_instance_takes_prefill_only_once_served() -> None:
    controller = Scripted({20.0: [("serve", "prefill-1")]})
    sim = simulate(prefill_pool(serving=1, total=2), controller)
    outcome = sim.run(steady(8.0, 40.0))
    on_1 = [r.arrival for r in outcome.requests if r.prefill_instance == "prefill-1"]
    assert on_1 and min(on_1) >= 20.0
    assert all(r.finish >= 0 for r in outcome.requests)


def test_a_drained_prefill_instance_finishes_its_work_and_takes_no_new_prefill() -> None:
    controller = Scripted({20.0: [("drain", "prefill-0")]})
    sim = simulate(prefill_pool(serving=2, total=2), controller)
    # Long prompts; two just before the drain, so that both prefill instances hold one then.
    trace = [TraceRequest(i / 4.0, 4000, 40, "chat") for i in range(160)]
    trace += [TraceRequest(19.95, 7000, 40, "chat")] * 2
    trace.sort(key=lambda r: r.arrival_s)
    outcome = sim.run(trace)
    assert controller.bound_at_drain["prefill-0"] > 0  # it held requests when drained
    assert controller.drained_at["prefill-0"] <= 25.0  # ... and finished them at once
    assert all(r.finish >= 0 for r in outcome.requests)  # none lost
    late = {r.prefill_instance for r in outcome.requests if r.arrival >= 20.0}
    assert late == {"prefill-1"}
    assert sim.bound("prefill-0") == sim.bound("prefill-1") == 0  # every KV pulled
    with pytest.raises(ValueError, match="last serving prefill instance"):
        sim.drain("prefill-1")


class Schedule:
    """A fake autoscaler: the count of the latest entry at or before now."""

    name = "schedule"

    def __init__(self, *steps: tuple[float, int]) -> None:
        self.steps = steps

    def decide(self, demand: Demand, pool: PoolState) -> ScaleDecision:
        n = [k for t, k in self.steps if t <= demand.now][-1]
        return ScaleDecision(n, f"scheduled {n}")


def test_the_controller_scales_prefill_up_and_down_and_counts_its_gpu_time() -> None:
    instances = prefill_pool(serving=1, total=3, n_decode=1)
    controller = ElasticController(
        Schedule((0.0, 1)),  # type: ignore[arg-type]
        ["decode-0"],
        {i.name: i.true_profile for i in instances},
        SLO,
        prefill_pods=0,
        startup_s=5.0,
        window=DemandWindow(window_s=10.0, bin_s=1.0, burst_window_s=20.0, trend_s=4.0),
        prefill_autoscaler=Schedule((0.0, 1), (10.0, 3), (40.0, 1)),  # type: ignore[arg-type]
        prefill_names=["prefill-0", "prefill-1", "prefill-2"],
    )
    sim = simulate(instances, controller)
    outcome = sim.run(steady(4.0, 60.0))
    controller.close(outcome.end_time)
    # Two asked for at 10 (serving from the tick at 15), two drained at 40 (empty by 45).
    assert [(t, n) for t, n, _ in controller.reasons] == [(10.0, 3), (40.0, 1)]
    assert all(why.startswith("prefill: ") for _, _, why in controller.reasons)
    tl = controller.timeline
    at = {t: (s, st, d) for t, s, st, d in zip(
        tl.t, tl.prefill_serving, tl.prefill_starting, tl.prefill_draining, strict=True
    )}  # fmt: skip
    assert at[10.0] == (1, 0, 0) and at[15.0] == (3, 0, 0) and at[45.0] == (1, 0, 0)
    assert tl.serving == [1] * len(tl.t)  # decode untouched
    started = [r.arrival for r in outcome.requests if r.prefill_instance != "prefill-0"]
    assert started and min(started) >= 15.0
    after = {r.prefill_instance for r in outcome.requests if r.arrival >= 40.0}
    assert after == {sim.serving_prefill[0].name}  # the two others drained
    end = outcome.end_time
    assert controller.prefill_gpu_s == pytest.approx(10.0 + 3 * 35.0 + (end - 45.0))
    assert controller.decode_gpu_s == pytest.approx(end)
    assert controller.gpu_s == pytest.approx(controller.prefill_gpu_s + end)
    assert controller.scale_events == 2


def test_min_prefill_lies_within_the_scenario_prefill_pool(tmp_path: Path) -> None:
    a = autoscale_scenario(tmp_path, "autoscaling: {max_decode: 3, min_prefill: 1}").autoscaling
    assert a is not None and a.min_prefill == 1
    fixed = autoscale_scenario(tmp_path, "autoscaling: {max_decode: 3}").autoscaling
    assert fixed is not None and fixed.min_prefill is None  # prefill runs throughout
    with pytest.raises(InputError) as err:  # the pool has 2 prefill instances: the most
        autoscale_scenario(tmp_path, "autoscaling: {max_decode: 3, min_prefill: 3}")
    assert err.value.field == "autoscaling.min_prefill", str(err.value)
