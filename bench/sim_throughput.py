"""Simulator throughput (simulated requests per wall-clock second) and peak memory of a long run.

What it measures
----------------
1. **Throughput.** The paper pool: 8 A40 GPUs running Llama-3-8B, 5 prefill + 3 decode instances
   (``build_pool(5, 3, builtin_profile("a40-llama3-8b"), seed=1)``), fed the embedded Azure 2023
   conversation + code mixed trace 0 of ``sim paper`` (``paper_traces.mixed_trace(services, 0,
   PaperConfig())``: 12 minutes of both services, real lengths clipped to 7168/1024 tokens, Gamma
   arrivals with CV 2) rescaled with ``workload.rescale`` to 16 req/s, about the rate at which
   round-robin attains 0.85 goodput (the paper operating point, 14.6-16.2 req/s). For each policy
   (round_robin, least_loaded, length, calibrated; each with its default switches, the calibrated
   one with its P/D decider; the router scraping every second, as ``sim paper`` runs them) the
   output-length predictor is warmed with the trace's 2,000-request history, as
   ``sim.runner.execute`` does, and only ``Simulation.run`` is
   timed (``time.perf_counter``), in this one process on one core. 15 repetitions (``--quick``:
   3, on the first 1,500 requests) are interleaved, the policy order rotated every repetition,
   so that load from elsewhere hits all policies alike; the table gives the median. ``x
   round_robin`` is each policy's median throughput over round-robin's measured in the same run:
   the figure to quote, since absolute speeds depend on the machine. ``cpu_share`` is CPU time
   over wall time of the timed runs (``time.process_time``): near 1.0 the process had its core
   to itself (within this machine; a busy virtual-machine host is invisible to it).
2. **Peak memory of a one-hour run.** The full embedded Azure traces (conversation + code merged:
   all 28,185 requests of the hour, real timestamps, lengths clipped as above) run with the
   calibrated policy in a fresh subprocess. A second fresh subprocess only imports the package
   and builds the same trace; its settled RSS (after ``gc.collect``) is the baseline. The
   simulation's own need is ``ru_maxrss`` (``resource.getrusage``) of the first process minus
   that baseline. Parsing the gzip CSVs peaks above the settled RSS, so the first process resets
   the kernel's peak mark (``/proc/self/clear_refs``) once the trace is loaded, making its
   ``ru_maxrss`` the peak reached while simulating. ``--quick`` uses the first 15 minutes.

Run: ``.venv/bin/python bench/sim_throughput.py [--quick] [--no-memory] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import benchutil
from disaggpool.core.contracts import SLOClass
from disaggpool.core.hardware import builtin_profile
from disaggpool.core.policies.registry import default_options, make_policy
from disaggpool.core.predictor import make_predictor
from disaggpool.formats.traces import TraceRequest
from disaggpool.sim import workload
from disaggpool.sim.cluster import RouterOptions, Simulation
from disaggpool.sim.metrics import summarize
from disaggpool.sim.pools import build_pool
from disaggpool.studies.paper_config import PaperConfig

POLICIES = ("round_robin", "least_loaded", "length", "calibrated")
RATE_RPS = 16.0
SEED = 1
N_PREFILL, N_DECODE = 5, 3


def _simulation(
    policy: str,
    slo: dict[str, SLOClass],
    history: Sequence[TraceRequest],
) -> Simulation:
    default = next(iter(slo))
    predictor = make_predictor("online")
    for r in history:  # what a running router would already have learned (as runner.execute)
        predictor.observe(r.slo_class or default, r.prompt_tokens, r.output_tokens)
    return Simulation(
        build_pool(N_PREFILL, N_DECODE, builtin_profile(benchutil.PROFILE), SEED),
        policies=[make_policy(policy, options=default_options(policy))],
        router=RouterOptions(scrape_interval_s=1.0),  # what `sim paper` runs
        predictor=predictor,
        slo_classes=slo,
        default_class=default,
        seed=SEED,
    )


# ----------------------------------------------------------------------------- throughput


def throughput(quick: bool, rate: float = RATE_RPS, reps: int | None = None) -> dict[str, Any]:
    base, history, slo, _ = benchutil.paper_inputs()
    trace = workload.rescale(base, rate)
    if quick:
        trace = trace[:1500]
    reps = reps or (3 if quick else 15)
    stats = workload.trace_stats(trace)

    for policy in POLICIES:  # warm-up: imports, caches, first-call costs
        _simulation(policy, slo, history).run(trace[:300])

    walls: dict[str, list[float]] = {p: [] for p in POLICIES}
    cpus: dict[str, list[float]] = {p: [] for p in POLICIES}
    goodput: dict[str, float] = {}
    for rep in range(reps):
        order = POLICIES[rep % len(POLICIES) :] + POLICIES[: rep % len(POLICIES)]
        for policy in order:
            sim = _simulation(policy, slo, history)
            gc.collect()
            c0 = time.process_time()
            t0 = time.perf_counter()
            outcome = sim.run(trace)
            walls[policy].append(time.perf_counter() - t0)
            cpus[policy].append(time.process_time() - c0)
            if policy not in goodput:
                goodput[policy] = summarize(outcome, slo)["goodput"]

    n = len(trace)
    rr = n / statistics.median(walls["round_robin"])
    rows = []
    for policy in POLICIES:
        med = statistics.median(walls[policy])
        rows.append(
            {
                "policy": policy,
                "requests": n,
                "wall_s_median": med,
                "req_per_s": n / med,
                "req_per_s_min": n / max(walls[policy]),
                "req_per_s_max": n / min(walls[policy]),
                "us_per_request": 1e6 * med / n,
                "x_round_robin": (n / med) / rr,
                "goodput": goodput[policy],
                "cpu_share": sum(cpus[policy]) / sum(walls[policy]),
            }
        )
    return {
        "pool": f"{N_PREFILL}P+{N_DECODE}D x {benchutil.PROFILE} (build_pool seed {SEED})",
        "trace": f"paper mixed-0 rescaled to {rate} req/s"
        + (", first 1500 requests" if quick else ""),
        "trace_requests": n,
        "trace_simulated_s": round(stats["duration_s"], 1),
        "slo_classes": {c.name: {"ttft_s": c.ttft_s, "tpot_s": c.tpot_s} for c in slo.values()},
        "repetitions": reps,
        "sched_getaffinity": sorted(os.sched_getaffinity(0)),
        "rows": rows,
        "walls_s": walls,
        "cpu_s": cpus,
    }


# ----------------------------------------------------------------------------- memory


def _hour_trace(services: dict[str, list[TraceRequest]], duration_s: float) -> list[TraceRequest]:
    cfg = PaperConfig()
    merged = workload.merge(*services.values())
    if duration_s < 3600:
        merged = workload.window(merged, 0.0, duration_s)
    return workload.clip_lengths(merged, cfg.max_prompt, cfg.max_output)


def _rss_mb() -> float:
    """Current resident set size (MB), from /proc/self/statm."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return float("nan")
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def _maxrss_mb() -> float:
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return kb / 1024 if sys.platform != "darwin" else kb / 2**20


def _reset_peak() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM, hence ru_maxrss) to the current RSS (Linux >= 4.0).

    Without it ru_maxrss would still hold the peak reached while the gzip trace was parsed.
    """
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def memory_child(mode: str, duration_s: float) -> dict[str, Any]:
    """Body of the subprocess: build the trace; in mode ``run`` also simulate it (calibrated)."""
    _, _, slo, services = benchutil.paper_inputs()
    trace = _hour_trace(services, duration_s)
    del services
    gc.collect()
    out: dict[str, Any] = {
        "mode": mode,
        "requests": len(trace),
        "load_maxrss_mb": _maxrss_mb(),
        "rss_after_load_mb": _rss_mb(),
    }
    if mode == "run":
        sim = _simulation("calibrated", slo, [])
        out["peak_reset"] = _reset_peak()
        out["rss_before_run_mb"] = _rss_mb()
        t0 = time.perf_counter()
        outcome = sim.run(trace)
        out["wall_s"] = time.perf_counter() - t0
        out["maxrss_mb"] = _maxrss_mb()
        out["rss_after_run_mb"] = _rss_mb()
        out["simulated_s"] = outcome.end_time
        out["goodput"] = summarize(outcome, slo)["goodput"]
        out["rejected"] = len(outcome.rejected)
    return out


def _spawn(mode: str, duration_s: float) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--memory-child", mode]
    cmd += ["--duration", str(duration_s)]
    proc = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def memory(quick: bool) -> dict[str, Any]:
    duration = 900.0 if quick else 3600.0
    base = _spawn("baseline", duration)
    run = _spawn("run", duration)
    return {
        "trace": f"Azure 2023 conv+code merged, first {duration / 60:.0f} min, real timestamps, "
        "lengths clipped to 7168/1024",
        "policy": "calibrated",
        "requests": run["requests"],
        "trace_rate_rps": round(run["requests"] / duration, 2),
        "wall_s": run["wall_s"],
        "req_per_s": run["requests"] / run["wall_s"],
        "simulated_s": run["simulated_s"],
        "goodput": run["goodput"],
        "baseline_load_peak_mb": base["load_maxrss_mb"],
        "baseline_rss_mb": base["rss_after_load_mb"],
        "run_maxrss_mb": run["maxrss_mb"],
        "sim_peak_mb": run["maxrss_mb"] - base["rss_after_load_mb"],
        "peak_reset": run["peak_reset"],
        "children": {"baseline": base, "run": run},
    }


# ----------------------------------------------------------------------------- driver


def run(quick: bool, *, with_memory: bool = True) -> dict[str, Any]:
    doc: dict[str, Any] = {"benchmark": "sim_throughput", "quick": quick}
    doc["throughput"] = throughput(quick)
    if with_memory:
        doc["memory"] = memory(quick)
    return doc


def render(doc: dict[str, Any]) -> str:
    tp = doc["throughput"]
    parts = [
        f"### Simulator throughput: {tp['pool']}\n\n"
        f"Trace: {tp['trace']} ({tp['trace_requests']} requests, {tp['trace_simulated_s']} s "
        f"of arrivals); median of {tp['repetitions']} interleaved repetitions, one process, "
        f"affinity {tp['sched_getaffinity']}.\n\n",
        benchutil.md_table(
            tp["rows"],
            [
                "policy",
                "requests",
                "wall_s_median",
                "req_per_s",
                "req_per_s_min",
                "req_per_s_max",
                "us_per_request",
                "x_round_robin",
                "goodput",
                "cpu_share",
            ],
        ),
    ]
    mem = doc.get("memory")
    if mem:
        parts.append(
            f"\n### Peak memory of a long run ({mem['policy']} policy, fresh subprocess)\n\n"
            f"Trace: {mem['trace']}. baseline_rss_mb: RSS of a fresh process that only imported "
            "the package and built the trace (after gc; baseline_load_peak_mb: its ru_maxrss, "
            "the transient peak of parsing the gzip CSVs). run_maxrss_mb: ru_maxrss of a second "
            "fresh process that also ran the simulation, its peak mark reset after loading "
            f"(peak_reset={mem['peak_reset']}). sim_peak_mb = run_maxrss_mb - baseline_rss_mb."
            "\n\n"
        )
        parts.append(
            benchutil.md_table(
                [mem],
                [
                    "requests",
                    "trace_rate_rps",
                    "wall_s",
                    "req_per_s",
                    "goodput",
                    "baseline_load_peak_mb",
                    "baseline_rss_mb",
                    "run_maxrss_mb",
                    "sim_peak_mb",
                ],
            )
        )
    return "".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick", action="store_true", help="1,500 requests, 3 reps, 15-min memory run"
    )
    ap.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    ap.add_argument("--no-memory", action="store_true", help="skip the memory subprocesses")
    ap.add_argument("--memory-child", choices=("baseline", "run"), help=argparse.SUPPRESS)
    ap.add_argument("--duration", type=float, default=3600.0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.memory_child:
        print(json.dumps(memory_child(args.memory_child, args.duration)))
        return 0
    benchutil.measure_and_report(
        lambda: run(args.quick, with_memory=not args.no_memory), render, args.json
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
