"""Tests of `disaggpool demo` (`disaggpool.demo`): its pieces, then one short end-to-end run.

The end-to-end run goes through every stage of the real command: emulator processes start, the
probe calibrates each of them, the operating-point search picks the rate, a sidecar process per
policy fronts the pool while `loadgen.replay` sends the trace, and the simulator predicts each
policy's goodput. It is sized down (two decode pods, a 4 s trace, a 12 s probe per pod, two
policies, two simulator seeds) to about 70 s on two cores; the probe needs about 12 s per pod to
measure enough decode runs, so that is the smallest budget that still calibrates reliably.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from disaggpool.demo.cli import config_from_args, register
from disaggpool.demo.design import (
    MOONCAKE_DECODE_SPEEDS,
    MOONCAKE_POLICIES,
    MOONCAKE_PREFILL_SPEEDS,
    TARGET_GOODPUT,
    DemoConfig,
    demo_trace,
    operating_rate,
    placed_pool,
    reusable_share,
    simulated_run,
    true_profiles,
)
from disaggpool.demo.design import (
    POLICIES as DEMO_POLICIES,
)
from disaggpool.demo.run import run_demo
from disaggpool.formats.traces import TraceRequest
from disaggpool.sim.runner import execute

DECODE_SPEEDS = (1.0, 1.25)
POLICIES = ("calibrated", "round_robin")


def test_reusable_share_is_what_one_cache_of_every_earlier_prompt_finds() -> None:
    def req(blocks: tuple[int, ...], n: int) -> TraceRequest:
        return TraceRequest(0.0, n, 8, "chat", blocks=blocks, block_tokens=512)

    trace = [req((1, 2), 1024), req((1, 2, 3), 1500), req((5,), 500)]
    assert reusable_share(trace) == pytest.approx(1024 / 3024)
    assert reusable_share([TraceRequest(0.0, 100, 8, "chat")]) == 0.0


def test_mooncake_trace_keeps_its_blocks_and_arrivals() -> None:
    trace, slo = demo_trace(seed=0, trace_name="mooncake")
    assert len(trace) == 2000 and trace[0].arrival_s == 0.0
    assert all(r.blocks and r.prompt_tokens <= 7680 and r.output_tokens <= 64 for r in trace)
    assert {r.slo_class for r in trace} == {slo.name}
    # a conversation's later turns extend an earlier prompt's blocks: the reuse a cache finds
    firsts = {r.blocks[0] for r in trace}
    assert len(firsts) < len(trace) / 2


def test_true_profiles_have_the_configured_speeds() -> None:
    pods = true_profiles((0.5, 2.0))
    assert [(name, role) for name, (role, _) in pods.items()] == [
        ("prefill-0", "prefill"),
        ("decode-0", "decode"),
        ("decode-1", "decode"),
    ]
    a40 = pods["prefill-0"][1].decode
    assert pods["decode-0"][1].decode.d0 == pytest.approx(2 * a40.d0)
    assert pods["decode-1"][1].decode.d0 == pytest.approx(a40.d0 / 2)


@pytest.mark.parametrize(
    "changes",
    [
        {"sim_seeds": 1},
        {"decode_speeds": (), "prefill_speeds": (1.0,)},
        {"decode_speeds": (1.0, 0.0), "prefill_speeds": (1.0,)},
        {"prefill_speeds": (), "decode_speeds": (1.0,)},
        {"decode_speeds": (1.0,)},  # a fixed pool names both roles
        {"boards": (1.0,)},
        {"boards": (1.0, 0.0)},
        {"trace": "sharegpt"},
    ],
)
def test_config_rejects_what_cannot_run(changes: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        DemoConfig(**changes)  # type: ignore[arg-type]


def _demo_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(["demo", *argv])


def test_demo_command_defaults_to_the_azure_pool_and_policies() -> None:
    cfg = config_from_args(_demo_args())
    assert (cfg.trace, cfg.prefix, cfg.policies) == ("azure", False, DEMO_POLICIES)
    assert cfg == DemoConfig()
    assert config_from_args(_demo_args("--min-pods-per-role", "1")).min_pods_per_role == 1


def test_trace_mooncake_brings_its_pool_policies_and_prefix_caching() -> None:
    cfg = config_from_args(_demo_args("--trace", "mooncake", "--duration", "12", "--seed", "3"))
    assert cfg.prefix
    assert cfg.prefill_speeds == MOONCAKE_PREFILL_SPEEDS
    assert cfg.decode_speeds == MOONCAKE_DECODE_SPEEDS
    assert cfg.policies == MOONCAKE_POLICIES
    assert (cfg.duration_s, cfg.seed) == (12.0, 3)
    named = config_from_args(_demo_args("--trace", "mooncake", "--policies", "calibrated,length"))
    assert named.policies == ("calibrated", "length")


def test_demo_command_refuses_an_unknown_trace(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _demo_args("--trace", "sharegpt")
    assert "--trace" in capsys.readouterr().err


def test_operating_rate_is_round_robins_target_point_on_the_true_pool() -> None:
    pods = true_profiles(DECODE_SPEEDS)
    base, slo = demo_trace(seed=0)
    rate, trace = operating_rate(pods, base, slo, 20.0, seed=0)
    assert 0.5 < rate < 40.0
    assert trace and all(r.arrival_s < 20.0 for r in trace)
    assert len(trace) == pytest.approx(20.0 * rate, rel=0.5)  # bursty, but about the rate
    assert (
        execute(simulated_run(pods, {}, trace, slo, "round_robin", 0))["goodput"] >= TARGET_GOODPUT
    )


def test_the_demo_runs_the_placement_that_carries_most_at_round_robins_point() -> None:
    """The default pool is placed as the paper run places its split: of every assignment of the
    four boards, the one with the highest rate at round-robin's 0.85 point, and the trace is at
    that rate."""
    cfg = DemoConfig(duration_s=20.0)
    base, slo = demo_trace(seed=0)
    placed = placed_pool(cfg, base, slo)
    # Every placement giving each role two boards: 4 of the 10.
    assert len(placed.searched) == len(cfg.placements) == 4
    assert all(len(p) >= 2 and len(d) >= 2 for p, d in cfg.placements)
    # With one board a role allowed, every placement is searched.
    assert len(DemoConfig(min_pods_per_role=1).placements) == 10
    with pytest.raises(ValueError, match="min_pods_per_role"):
        DemoConfig(min_pods_per_role=0)
    assert placed.rate == pytest.approx(max(placed.searched.values()), abs=1e-3)
    assert placed.searched[placed.chosen] == pytest.approx(placed.rate, abs=1e-3)
    roles = [role for role, _ in placed.pods.values()]
    assert len(roles) == len(cfg.boards) and {"prefill", "decode"} <= set(roles)
    # The rate is round-robin's point on the chosen pool, and the trace is at it.
    assert operating_rate(placed.pods, base, slo, 20.0, seed=0) == (placed.rate, placed.trace)
    # A fixed pool is not searched.
    fixed = DemoConfig(duration_s=20.0, prefill_speeds=(1.0,), decode_speeds=(1.0, 0.55, 1.25))
    assert list(placed_pool(fixed, base, slo).searched) == ["1P (1x) + 3D (1x, 0.55x, 1.25x)"]


@pytest.mark.slow
@pytest.mark.timeout(400)  # ~70 s alone; the probe and the replays run in real time
def test_demo_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = DemoConfig(
        duration_s=4.0,
        budget_s=12.0,
        policies=POLICIES,
        sim_seeds=2,
        prefill_speeds=(1.0,),
        decode_speeds=DECODE_SPEEDS,
    )
    out = tmp_path / "demo.json"
    result = run_demo(cfg, str(out))
    assert json.loads(out.read_text()) == result

    setup = result["setup"]
    assert 0.5 < setup["rate_rps"] < 40.0
    n = setup["trace_requests"]
    assert n >= 5
    # Calibration: every pod fitted, each decode pod's fitted speed near its true one.
    assert set(setup["fitted"]) == set(setup["pods"]) == {"prefill-0", "decode-0", "decode-1"}
    for name, pod in setup["pods"].items():
        fitted = setup["fitted"][name]
        assert fitted["quality"] in ("good", "fair"), (name, fitted)
        if pod["role"] == "decode":
            assert fitted["speed_vs_a40"] == pytest.approx(pod["speed_vs_a40"], rel=0.3), name

    assert [row["policy"] for row in result["policies"]] == list(POLICIES)
    for row in result["policies"]:
        # Every request of the trace was sent, answered and routed to a decode pod exactly once.
        assert row["requests"] == n, row
        assert row["errors"] == 0, row
        assert set(row["served_by_pod"]) <= {"decode-0", "decode-1"}
        assert sum(row["served_by_pod"].values()) == n, row
        assert 0.0 <= row["goodput_measured"] <= 1.0
        lo, hi = row["goodput_ci95"]  # a bootstrap interval around the measured goodput
        assert lo <= row["goodput_measured"] <= hi
        # The simulator's prediction for the same trace and policy.
        assert 0.0 <= row["goodput_simulated"] <= 1.0
        assert row["goodput_simulated_sd"] >= 0.0
        assert row["ttft_p99_s"] > 0 and row["ttft_p99_s_simulated"] > 0
        assert row["tpot_p99_s"] > 0 and row["tpot_p99_s_simulated"] > 0
    # Every prompt prefilled once: on a prefill pod, or by the decode pod itself ("local").
    for row in result["policies"]:
        assert set(row["prefilled_by_pod"]) <= {"prefill-0", "local"}, row
        assert sum(row["prefilled_by_pod"].values()) == n, row
    assert list(setup["placements_rps"]) == [setup["placement"]]  # a fixed pool: one placement
    # The first policy against each other one, paired request by request on the same trace.
    first, *others = result["policies"]
    assert first["vs_first_ci95"] is None
    for row in others:
        lo, hi = row["vs_first_ci95"]
        assert -1.0 <= lo <= hi <= 1.0
    rr = next(r for r in result["policies"] if r["policy"] == "round_robin")["served_by_pod"]
    assert max(rr.values()) - min(rr.values()) <= 1  # round-robin alternates the decode pods

    printed = capsys.readouterr().out
    assert "disaggpool demo: 1 prefill + 2 decode emulated pods" in printed
    assert all(policy in printed for policy in POLICIES)


@pytest.mark.slow
@pytest.mark.timeout(400)  # ~80 s alone
def test_demo_mooncake_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--trace mooncake`: two prefill pods caching prefixes, the sidecar's prefix index, and
    the pods' caches emptied between policies, so each policy's cached share is its own: the
    prefix rule finds prompts cached, and the simulator predicts a share for it too."""
    policies = ("dynamo_kv", "round_robin")
    cfg = DemoConfig(
        duration_s=4.0,
        budget_s=12.0,
        policies=policies,
        sim_seeds=2,
        decode_speeds=(1.0,),
        prefill_speeds=(1.0, 1.6),
        trace="mooncake",
    )
    result = run_demo(cfg, str(tmp_path / "demo.json"))
    setup = result["setup"]
    assert setup["trace"] == "mooncake"
    assert set(setup["fitted"]) == {"prefill-0", "prefill-1", "decode-0"}
    n = setup["trace_requests"]
    assert n >= 5
    rows = {row["policy"]: row for row in result["policies"]}
    assert list(rows) == list(policies)
    for row in rows.values():
        assert row["requests"] == n and row["errors"] == 0, row
        assert 0.0 <= row["cached_share"] <= 1.0 and 0.0 <= row["cached_share_simulated"] <= 1.0
    # Dynamo's rule follows the cached blocks: it finds some, measured and simulated alike.
    assert rows["dynamo_kv"]["cached_share"] > 0.0
    assert rows["dynamo_kv"]["cached_share_simulated"] > 0.0
    assert "mooncake trace" in capsys.readouterr().out


def _marked(mark: str) -> list[int]:
    """The processes whose environment carries `mark` (what the demo started inherits it)."""
    pids = []
    for env in Path("/proc").glob("[0-9]*/environ"):
        try:
            if mark.encode() in env.read_bytes():
                pids.append(int(env.parent.name))
        except OSError:
            continue  # gone, or not ours to read
    return pids


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sigterm_stops_what_the_demo_started(tmp_path: Path) -> None:
    """`disaggpool demo` ended by SIGTERM (a CI timeout, `kill`) stops its emulators, as Ctrl-C
    does, instead of leaving them running."""
    mark = f"DISAGGPOOL_DEMO_TEST_MARK={uuid.uuid4().hex}"
    key, value = mark.split("=")
    log = tmp_path / "demo.log"
    with log.open("wb") as out:
        demo = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "disaggpool",
                "demo",
                "--duration",
                "4",
                "--budget-seconds",
                "12",
            ],
            env={**os.environ, key: value},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        # Generous: on a busy two-core CI machine the pods' imports alone can take tens of seconds.
        deadline = time.monotonic() + 150
        while len(_marked(mark)) < 3 and demo.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)  # the demo + its pods
        started = len(_marked(mark))
        assert started >= 3, (
            f"{started} of the demo and its pods running (demo exit {demo.poll()}); its output:\n"
            + log.read_text(errors="replace")[-4000:]
        )
        demo.send_signal(signal.SIGTERM)
        assert demo.wait(timeout=30) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 15
        while _marked(mark) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _marked(mark) == []
    finally:
        if demo.poll() is None:
            demo.kill()
        for pid in _marked(mark):
            os.kill(pid, signal.SIGKILL)
