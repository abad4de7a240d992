"""The demo's measurement: the pool started and calibrated, each policy replayed through its own
sidecar and set beside the simulator's prediction, the first policy compared with each other.

`run_demo` is the whole command after its arguments: the design (`demo.design`) chooses the pool
and the rate before any process starts; then `localpool` starts the emulated pods and probes
them, and every policy gets a fresh sidecar (`serve_policy`) in front of the same pods, emptied
of the previous policy's work (and, with prefix caching, of its cached prompts). Its result is
the document `--json` writes; `demo.output` prints it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from disaggpool import progress
from disaggpool.core.contracts import SLOClass
from disaggpool.core.hardware import builtin_profile
from disaggpool.core.profile import CalibrationProfile
from disaggpool.core.stats import bootstrap_paired_difference_interval, bootstrap_share_interval
from disaggpool.demo.design import (
    DECODE_BINDING,
    MAX_NUM_SEQS,
    SCRAPE_INTERVAL_S,
    TARGET_GOODPUT,
    DemoConfig,
    demo_trace,
    placed_pool,
    reusable_share,
    simulated_run,
)
from disaggpool.demo.output import print_table, say
from disaggpool.formats.traces import TraceRequest
from disaggpool.loadgen import LoadReport, replay
from disaggpool.localpool import pods as local_pods
from disaggpool.localpool.probe import calibrate_pods
from disaggpool.localpool.processes import free_port, processes
from disaggpool.localpool.sidecar import routed_counts, running_sidecar, static_pool
from disaggpool.sim.runner import execute

__all__ = ["run_demo", "serve_policy", "start_calibrated_pool"]

Pods = dict[str, tuple[str, CalibrationProfile]]  # pod -> (role, hidden true profile)


def start_calibrated_pool(
    cfg: DemoConfig, pods: Pods, tmp: Path, procs: list[Any]
) -> tuple[dict[str, str], dict[str, CalibrationProfile]]:
    """One emulator process per pod of `pods`, timed by its hidden true profile, then each pod
    probed by `disaggpool calibrate` into ``tmp/profiles/<pod>.yaml``: (pod -> URL, pod -> fitted
    profile). The processes go into `procs` (`localpool.processes.processes` stops them)."""
    (tmp / "profiles").mkdir(exist_ok=True)
    say(f"starting {len(pods)} emulated vLLM pods (hidden profiles)")
    # With prefix caching, vLLM's dev endpoint empties the caches between policies; without,
    # every policy replays the same prompts and would find the previous ones' cached.
    urls = local_pods.start_emulators(
        {name: true for name, (_, true) in pods.items()},
        tmp,
        procs,
        seed=cfg.seed,
        prefix_caching=cfg.prefix,
    )
    fitted = calibrate_pods(
        urls,
        {name: role for name, (role, _) in pods.items()},
        tmp / "profiles",
        budget_s=cfg.budget_s,
        max_num_seqs=MAX_NUM_SEQS,
        say=say,
    )
    return urls, fitted


def serve_policy(
    tmp: Path,
    urls: dict[str, str],
    pods: Pods,
    policy: str,
    trace: Sequence[TraceRequest],
    slo: SLOClass,
    procs: list[Any],
    prefix_index: bool = False,
) -> tuple[LoadReport, dict[str, dict[str, int]]]:
    """Replay `trace` through a fresh sidecar running `policy` (keeping its prefix index with
    `prefix_index`); the report and, per role and pod, how many requests the sidecar sent there
    (`localpool.sidecar.routed_counts`)."""
    config = {
        "policy": policy,
        "model": builtin_profile("a40-llama3-8b").model,
        "listen": {"http": f"127.0.0.1:{free_port()}", "grpc": "127.0.0.1:0"},
        "slo_classes": [{"name": slo.name, "ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s}],
        "scrape_interval_s": SCRAPE_INTERVAL_S,
        "decode_binding": DECODE_BINDING,
        "tokenizer": {"kind": "emulator"},
        "pool": static_pool(urls, {name: role for name, (role, _) in pods.items()}),
        "profiles": {"dir": str(tmp / "profiles")},
        "prefix_index": prefix_index,
    }
    with running_sidecar(config, tmp, f"sidecar-{policy}", procs) as url:
        bar = progress.bar(total=len(trace), desc=f"{policy:>13}", unit="req", leave=True)

        def tick(_: object) -> None:
            bar.update(1)

        report = asyncio.run(replay(url, trace, [slo], on_done=tick))
        bar.close()
        return report, routed_counts(url)


def _measure(
    cfg: DemoConfig,
    tmp: Path,
    urls: dict[str, str],
    pods: Pods,
    fitted: dict[str, CalibrationProfile],
    policy: str,
    trace: Sequence[TraceRequest],
    slo: SLOClass,
    procs: list[Any],
) -> tuple[dict[str, Any], list[bool]]:
    """One policy's row of the result, and which requests met the SLO (in trace order): the
    simulator's runs first (the pods are idle), then the replay on the pods."""
    sims = [
        execute(simulated_run(pods, fitted, trace, slo, policy, cfg.seed + k, cfg.prefix))
        for k in range(cfg.sim_seeds)
    ]
    sim_goodput = [r["goodput"] for r in sims]
    prefill_urls = [urls[n] for n, (role, _) in pods.items() if role == "prefill"]
    if cfg.prefix:
        local_pods.reset_caches(list(urls.values()))
    before = local_pods.cache_counts(prefill_urls)
    measured, counts = serve_policy(tmp, urls, pods, policy, trace, slo, procs, cfg.prefix)
    local_pods.wait_idle(list(urls.values()))
    after = local_pods.cache_counts(prefill_urls)
    queries, hits = after[0] - before[0], after[1] - before[1]
    summary = measured.summary()
    met = [measured.met(r) for r in measured.results]  # in trace order
    row = {
        "policy": policy,
        "goodput_measured": round(summary["goodput"], 4),
        "goodput_ci95": [round(x, 4) for x in bootstrap_share_interval(met, cfg.seed)],
        "goodput_simulated": round(statistics.fmean(sim_goodput), 4),
        "goodput_simulated_sd": round(statistics.stdev(sim_goodput), 4),
        "requests": summary["requests"],
        "errors": summary["errors"],
        "ttft_p99_s": round(summary["ttft_p99_s"], 4),
        "tpot_p99_s": round(summary["tpot_p99_s"], 4),
        "ttft_p99_s_simulated": round(statistics.fmean(r["ttft_p99_s"] for r in sims), 4),
        "tpot_p99_s_simulated": round(statistics.fmean(r["tpot_p99_s"] for r in sims), 4),
        "served_by_pod": counts["decode"],
        "prefilled_by_pod": counts["prefill"],
        "cached_share": round(hits / queries, 4) if cfg.prefix and queries else None,
        "cached_share_simulated": (
            round(statistics.fmean(r["prefix_hit"] for r in sims), 4) if cfg.prefix else None
        ),
    }
    return row, met


def run_demo(cfg: DemoConfig, json_out: str | None = None) -> dict[str, Any]:
    """The demo end to end (module docstring): its result document, printed and, with
    `json_out`, written there."""
    base_trace, slo = demo_trace(cfg.seed, cfg.trace)
    if len(cfg.placements) > 1:
        say(f"placement search: {len(cfg.placements)} ways to give the boards their roles")
    placed = placed_pool(cfg, base_trace, slo)
    pods, rate, trace = placed.pods, placed.rate, placed.trace
    with tempfile.TemporaryDirectory(prefix="disaggpool-demo-") as tmp_name, processes() as procs:
        tmp = Path(tmp_name)
        urls, fitted = start_calibrated_pool(cfg, pods, tmp, procs)
        say(
            f"trace: {len(trace)} requests over {cfg.duration_s:.0f} s at {rate:.2f} req/s "
            f"(round-robin's {TARGET_GOODPUT} goodput point); SLO TTFT {slo.ttft_s:.2f} s, "
            f"TPOT {slo.tpot_s * 1000:.0f} ms"
        )
        rows = []
        met_by_policy: list[list[bool]] = []
        for policy in cfg.policies:
            row, met = _measure(cfg, tmp, urls, pods, fitted, policy, trace, slo, procs)
            rows.append(row)
            met_by_policy.append(met)
    # The first policy's goodput minus each other one's, request by request on the same trace.
    rows[0]["vs_first_ci95"] = None
    for row, met in zip(rows[1:], met_by_policy[1:], strict=True):
        paired = bootstrap_paired_difference_interval(met_by_policy[0], met, cfg.seed)
        row["vs_first_ci95"] = [round(x, 4) for x in paired]
    result = {
        "policies": rows,
        "setup": {
            "trace": cfg.trace,
            "reusable_share": round(reusable_share(trace), 4),
            "rate_rps": round(rate, 3),
            "placement": placed.chosen,
            # every placement searched -> its rate at round-robin's TARGET_GOODPUT point
            "placements_rps": placed.searched,
            "duration_s": cfg.duration_s,
            "trace_requests": len(trace),
            "slo": dataclasses.asdict(slo),
            "pods": {
                n: {"role": r, "speed_vs_a40": round(_speed(p), 3)} for n, (r, p) in pods.items()
            },
            "fitted": {
                n: {
                    "quality": p.quality,
                    "ttft_mape": p.ttft_mape,
                    "tpot_mape": p.tpot_mape,
                    "speed_vs_a40": round(_speed(p), 3),
                }
                for n, p in fitted.items()
            },
        },
    }
    print_table(result)
    if json_out:
        Path(json_out).write_text(json.dumps(result, indent=1))
    return result


def _speed(p: CalibrationProfile) -> float:
    """Decode speed relative to the A40: the ratio of step times at a mid-sized batch (16
    sequences, 16k context tokens), so a fitted profile whose constants trade off against each
    other still compares; for a `scaled` A40 profile it is exactly the scale."""
    a40 = builtin_profile("a40-llama3-8b").decode.step(16, 16384)
    return a40 / p.decode.step(16, 16384)
