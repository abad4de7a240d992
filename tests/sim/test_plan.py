"""`disaggpool plan`: the fewest GPUs reaching a goodput, on scenarios whose answer is known."""

from __future__ import annotations

from pathlib import Path

import pytest

from disaggpool.sim.plan import candidate_splits, plan_scenario, pool_of
from disaggpool.sim.scenario import load_scenario


def scenario(tmp_path: Path, rate: float, ttft_s: float = 2.0) -> Path:
    path = tmp_path / "s.yaml"
    path.write_text(
        f"""
name: plan-test
pool:
  prefill: [{{count: 1, profile: a40-llama3-8b}}]
  decode:
    - {{count: 1, profile: a40-llama3-8b, speed: 1.5}}
    - {{count: 1, profile: a40-llama3-8b}}
slo_classes: [{{name: chat, ttft_s: {ttft_s}, tpot_s: 0.1}}]
trace:
  generate: {{process: poisson, rate: {rate}, n: 300, prompt_mean: 800, output_mean: 120,
             sigma: 0.5, classes: {{chat: 1.0}}}}
policies: [round_robin, calibrated]
seeds: [1]
"""
    )
    return path


def test_light_traffic_needs_the_smallest_pool(tmp_path: Path) -> None:
    doc = plan_scenario(load_scenario(scenario(tmp_path, rate=0.5)), 0.95, workers=1)
    for plan in doc["findings"]["plan"].values():
        assert plan == {"reached": True, "gpus": 2, "prefill": 1, "decode": 1,
                        "goodput": plan["goodput"]} and plan["goodput"] >= 0.95  # fmt: skip


def test_the_plan_is_the_first_gpu_count_that_reaches_the_target(tmp_path: Path) -> None:
    doc = plan_scenario(load_scenario(scenario(tmp_path, rate=12.0)), 0.9, workers=2)
    rows = doc["experiments"]["plan"]
    for policy, plan in doc["findings"]["plan"].items():
        assert plan["reached"] and plan["gpus"] > 2
        assert plan["prefill"] + plan["decode"] == plan["gpus"]
        smaller = [r["goodput"] for r in rows if r["policy"] == policy and r["gpus"] < plan["gpus"]]
        assert smaller and max(smaller) < 0.9  # no smaller pool tried reached it


def test_an_unreachable_target_says_so_with_the_best_found(tmp_path: Path) -> None:
    # A TTFT target below the prefill of most prompts: no pool size meets it.
    doc = plan_scenario(load_scenario(scenario(tmp_path, 0.5, ttft_s=0.01)), 0.9, max_gpus=3)
    for plan in doc["findings"]["plan"].values():
        assert plan["reached"] is False and plan["best"]["goodput"] < 0.9


def test_pools_draw_the_files_instances_in_order(tmp_path: Path) -> None:
    s = load_scenario(scenario(tmp_path, rate=1.0))
    pool = pool_of(s, 2, 3)
    decode = [i for i in pool if i.role == "decode"]
    fast = s.instances[1].true_profile.decode.d0
    assert [i.true_profile.decode.d0 == fast for i in decode] == [True, False, True]
    assert [i.name for i in pool] == ["prefill-0", "prefill-1", "decode-0", "decode-1", "decode-2"]
    assert all(1 <= p <= 7 for p, _ in candidate_splits(s, 8))
    with pytest.raises(ValueError, match="target goodput"):
        plan_scenario(s, 1.5)
