"""Engine-model fidelity against real vLLM: does the simulator predict a real engine under load?

The emulator's timing *is* the engine model (`disaggpool.engine`), so the demo's sim-to-real
agreement checks the real-time plumbing, never the model. This bench checks the model against
the real thing: vLLM 0.32.0 on this CPU (the real-vLLM suite's venv and tiny model, built by
`scripts/vllm_env.sh`).

1. **Engine.** One real vLLM engine (`python -m vllm.entrypoints.openai.api_server`, the tiny
   Llama of the real-vLLM suite, float32, 1 GiB of KV cache, `--max-num-seqs` and
   `--max-num-batched-tokens` given so that the profile holds the engine's own limits, prefix
   caching off: every load replays the prompts the one before left cached). Its model worker
   (the process whose OpenMP threads run the model) is bound to the last CPU
   (`VLLM_CPU_OMP_THREADS_BIND`); its API server, the engine-core process it starts (vLLM's
   scheduler, which inherits the API server's CPUs), this process and the load generator to the
   others (`taskset`): on two cores, a client sharing the worker's core made the engine's step
   times wander by 30% between runs, and the scheduler bound beside the worker made every step
   slower (the two then take turns on one core).
2. **Probe.** `disaggpool calibrate`'s probe (`run_probe`, role decode, no peer) fits the
   engine's profile, as the operator's Job does, and measures the request path outside the
   engine (requests the server rejects unprocessed: parsing, validation, the HTTP round trip).
   A `poor` fit is probed again, as the operator does by default (`calibration.reprobeOnPoor`,
   up to `maxAttempts`, 3), each attempt with its own seed; the first fit that is not poor is
   used, or the last one. Every attempt's verdict and held-out errors are recorded. Before
   every segment of a load (below) after the first the engine is probed again the same way,
   and its fit recorded with that segment.
3. **Trace.** Azure 2023 conversation lengths (clipped to 1,536 prompt and 256 output tokens,
   within the engine's 2,048-token context) in bursty Gamma arrivals (CV 3); SLO targets from the
   fitted profile (`sim.capacity.slo_targets`: TTFT x4, TPOT x2 of the p90 request unloaded).
   Loads are factors of `rate85`, the rate at which the simulator predicts 0.85 goodput for this
   engine; each load replays the first `--duration` seconds of the trace at its rate, in
   `--segments` equal stretches (3; a request belongs to the stretch it arrives in, and a
   stretch runs until its last request is answered). The loads take turns, stretch by stretch
   (x0.5's first, x1's first, ..., x0.5's second, ...), each after a probe of its own: on this
   shared machine the engine's speed moves by up to 2x within 20 minutes and within one
   6-minute load, so a load replayed whole after one probe would be predicted from a speed the
   engine no longer has, and each load would meet another speed.
4. **Measured.** `disaggpool loadgen`'s replay against the engine (token-id prompts of the exact
   length, outputs pinned by `ignore_eos`, streamed): goodput (95% bootstrap interval), TTFT and
   TPOT p50/p90/p99, requests late (TTFT) and slow (TPOT), the engine's own counters
   (preemptions, inter-token latency, steps) and how busy each CPU was.
5. **Predicted.** The simulator (`sim.runner.simulate`) on the same requests at the same arrival
   times, the fitted profile as the engine's timing, the engine prefilling every prompt itself
   (the P/D decider's local path: one instance doing both, which is what a lone vLLM engine is),
   the mean over `SIM_SEEDS` seeds of step jitter, each stretch from an idle engine as it was
   served. Twice: the engine model alone, and with the probe's request path added to each
   TTFT, which is what a client sees (the simulator models the engine only). And once more
   with each stretch predicted from the probe taken just before it, with its request path
   (`probe_before`): on a shared machine the engine's speed moves in the course of a run,
   which the first probe cannot know and a probe again, as the operator makes on drift, can;
   the first probe alone sets the rates and the SLO. The stretches' requests are pooled into
   the load's figures, measured and predicted alike.

Errors: goodput in points (measured - predicted), p50/p99 TTFT and TPOT as measured /
predicted - 1. The aim: goodput within 5 points, p50 TTFT and TPOT within 15%.
Per load also the median TPOT of the requests every load replays (the lightest load's, the first
of every trace), measured and predicted: the same requests at more load should decode no faster,
so where the measured ones move between loads and the predicted do not, the engine's speed
changed, not the batches. Per stretch, its errors from the probe just before it. And over the
whole run (`tpot_by_company`), the requests that decoded at least 8 tokens grouped by how many
others decoded while they did, with their measured / predicted TPOT (from the probe before):
a model that mispriced batches whose members join and leave, which the probe's batches never
do, would be right on lone requests and wrong on those in company.

Run: ``.venv/bin/python bench/engine_fidelity.py [--quick] [--duration S] [--loads 0.5,1,1.5]
[--segments K] [--seed N] [--json FILE]`` (after ``bash scripts/vllm_env.sh``); ``--quick``
(two loads of 30 s, whole, 20 s probes) is a smoke run; the default, three loads of 360 s in
three stretches, each after a 45 s probe (more if the fit is poor), takes about 25 minutes (at
120 s per load the lightest had 18 requests, one of them 5.6 points of goodput: the stretches
are pooled). ``--segments 1`` replays each load whole after its probe.
``--repredict FILE`` starts no engine: it predicts again for the measurements FILE recorded (its
profile, request path, seed and rates), to see what a change of the engine model does to the
agreement with the same measurement.

The real engine is `vllm_engine.py`'s, the simulator's half `fidelity_prediction.py`'s; this file
is the trace, the measured half and the comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import random
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import benchutil
from disaggpool import progress
from disaggpool.core.contracts import SLOClass
from disaggpool.core.profile import CalibrationProfile, profile_from_dict, profile_to_dict
from disaggpool.core.stats import bootstrap_share_interval
from disaggpool.formats.embedded import AZURE_2023_FILES, read_embedded_trace
from disaggpool.formats.traces import TraceRequest
from disaggpool.loadgen import LoadReport, replay
from disaggpool.sim import capacity, workload
from disaggpool.sim.metrics import latency_percentiles
from disaggpool.sim.operating_point import SearchProblem, operating_rates
from fidelity_prediction import (
    SIM_SEEDS,
    Part,
    RequestPath,
    by_company,
    one_engine_run,
    predicted,
    tpot_in_company,
)
from vllm_engine import (
    MAX_BATCHED_TOKENS,
    MAX_NUM_SEQS,
    SERVED,
    busy_shares,
    counter,
    cpu_split,
    probe_engine,
    real_engine,
    request_path,
    warm_up,
)

CLIP = (1536, 256)  # prompt, output: within MAX_MODEL_LEN
BURST_CV = 3.0
TARGET_GOODPUT = 0.85
LOADS = (0.5, 1.0, 1.5)
SEGMENTS = 3  # each load's trace in this many stretches, each after a probe of its own
QUICK_LOADS = (0.5, 1.0)
# The engine's own view of the replay: preemptions, and its inter-token gaps and steps, which
# tell an engine slower than predicted from a client that reads its stream late.
ENGINE_COUNTERS = (
    "vllm:num_preemptions_total",
    "vllm:inter_token_latency_seconds_sum",
    "vllm:inter_token_latency_seconds_count",
    "vllm:iteration_tokens_total_count",
    "vllm:iteration_tokens_total_sum",
)


# ------------------------------------------------------------------ the real engine


# ------------------------------------------------------------------ trace and prediction


def fidelity_trace(seed: int) -> list[TraceRequest]:
    """2,000 requests of Azure 2023 conversation lengths in bursty arrivals (rate 1, rescaled)."""
    rng = random.Random(f"fidelity:{seed}")
    conv = read_embedded_trace(AZURE_2023_FILES["conv"], default_class="chat")
    lengths = workload.clip_lengths(conv, *CLIP)
    start = rng.randrange(0, len(lengths) - 2000)
    picked = lengths[start : start + 2000]
    return workload.with_arrivals(picked, workload.gamma_arrivals(1.0, BURST_CV, 2000, rng))


def measured(
    url: str, trace: Sequence[TraceRequest], slo: SLOClass, seed: int, first: int = 0
) -> dict[str, Any]:
    """Replay `trace` against the engine: loadgen's figures, the engine's own counters and how
    busy each CPU was; `first`: the load's index of the trace's first request (a segment's)."""
    bar = progress.bar(total=len(trace), desc="replay", unit="req", leave=False)

    def tick(_: object) -> None:
        bar.update(1)

    before = {name: counter(url, name) for name in ENGINE_COUNTERS}
    ticks = benchutil.proc_stat_ticks()
    report: LoadReport = asyncio.run(
        replay(
            url,
            trace,
            [slo],
            model=SERVED,
            seed=seed,
            on_done=tick,
            send_default_class=False,
        )
    )
    bar.close()
    summary = report.summary()
    met = [report.met(r) for r in report.results]
    keys = [f"{m}_{q}_s" for m in ("ttft", "tpot") for q in ("p50", "p90", "p99")]
    ok = [r for r in report.results if r.ok]
    return {
        "goodput": summary["goodput"],
        "goodput_ci": list(bootstrap_share_interval(met, seed=seed)),
        "late": sum(r.ttft_s > slo.ttft_s for r in ok),
        "slow": sum(r.tpot_s > slo.tpot_s for r in ok),
        "errors": summary["errors"],
        "engine": {name: counter(url, name) - v for name, v in before.items()},
        "cpu_busy": busy_shares(ticks),
        **{k: summary[k] for k in keys},
        # per request (the load's index, TTFT, TPOT, SLO met, answered), for a look at where
        # the model and the engine part, and to pool a load's segments
        "requests": [
            [first + r.index, round(r.ttft_s, 5), round(r.tpot_s, 6), int(report.met(r)), int(r.ok)]
            for r in report.results
        ],
    }


def pooled(
    segments: Sequence[dict[str, Any]], trace: Sequence[TraceRequest], slo: SLOClass, seed: int
) -> dict[str, Any]:
    """One load's measured figures from its segments' (`measured`), as loadgen's summary
    computes them over one replay: goodput over every request, TTFT over those answered, TPOT
    over those answered with more than one output token (`trace`: the whole load's)."""
    records = [r for s in segments for r in s["requests"]]
    ok = [r for r in records if r[4]]
    ttft = [r[1] for r in ok]
    tpot = [r[2] for r in ok if trace[r[0]].output_tokens > 1]
    met = [bool(r[3]) for r in records]
    engine: dict[str, float] = {}
    for s in segments:
        for name, v in s["engine"].items():
            engine[name] = engine.get(name, 0.0) + v
    return {
        "goodput": sum(met) / len(met),
        "goodput_ci": list(bootstrap_share_interval(met, seed=seed)),
        "late": sum(s["late"] for s in segments),
        "slow": sum(s["slow"] for s in segments),
        "errors": sum(s["errors"] for s in segments),
        "engine": engine,
        **latency_percentiles(ttft, tpot, digits=None),
        "requests": records,
    }


def errors(real: dict[str, Any], sim: dict[str, Any]) -> dict[str, float]:
    """Goodput in points (measured - predicted), latencies as measured / predicted - 1."""
    out = {"goodput_points": round(100 * (real["goodput"] - sim["goodput"]), 1)}
    for m in ("ttft", "tpot"):
        for q in ("p50", "p99"):
            key = f"{m}_{q}_s"
            out[f"{m}_{q}"] = round(real[key] / sim[key] - 1, 3) if sim[key] > 0 else math.nan
    return out


# ------------------------------------------------------------------ the run


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Start the engine, probe it, replay the trace at every load: the measured half."""
    loads = (
        [float(x) for x in args.loads.split(",")]
        if args.loads
        else (QUICK_LOADS if args.quick else LOADS)
    )
    duration = args.duration or (30.0 if args.quick else 360.0)
    segments = args.segments or (1 if args.quick else SEGMENTS)
    budget = 20.0 if args.quick else 45.0
    engine_cpu, others = cpu_split()
    os.sched_setaffinity(0, others)  # the client beside the API server, off the engine's core
    with (
        tempfile.TemporaryDirectory(prefix="fidelity-") as tmp,
        real_engine(Path(tmp), engine_cpu, others) as url,
    ):
        print(f"[fidelity] engine up at {url}; probing for {budget:.0f} s", file=sys.stderr)
        warm_up(url)
        probe, attempts = probe_engine(url, budget, args.seed)
        profile = probe.profile
        search = rate_search(profile, args.seed, duration)
        rate85 = operating_rates([search], steps=14, workers=1)[0]
        print(
            f"[fidelity] profile {profile.quality}: prefill {profile.prefill}, decode "
            f"{profile.decode}; 0.85 predicted at {rate85:.2f} req/s",
            file=sys.stderr,
        )
        slo = search.run.slo_classes[0]
        traces = [search.trace_at(rate85 * factor) for factor in loads]
        rows: list[dict[str, Any]] = [
            {"load": f, "rate_rps": rate85 * f, "requests": len(t), "segments": []}
            for f, t in zip(loads, traces, strict=True)
        ]
        fresh, fresh_attempts = probe, attempts
        # Segment by segment, every load in turn: a drift of the machine's speed falls on all
        # loads alike, and each segment is predicted from the probe just before it.
        for j in range(segments):
            for k, row in enumerate(rows):
                if j or k:  # the first segment follows the probe above
                    print(
                        f"[fidelity] probing before x{row['load']}, segment {j + 1}",
                        file=sys.stderr,
                    )
                    fresh, fresh_attempts = probe_engine(
                        url, budget, args.seed + 100 * (j * len(rows) + k)
                    )
                first, part = segment(traces[k], duration, segments, j)
                row["segments"].append(
                    {
                        "start_s": j * duration / segments,
                        "first": first,
                        "requests": len(part),
                        "probe_before": {
                            "profile": profile_to_dict(fresh.profile),
                            "request_path": request_path(fresh.report),
                            "attempts": fresh_attempts,
                        },
                        "measured": measured(url, part, slo, args.seed, first),
                    }
                )
        for row, trace in zip(rows, traces, strict=True):
            row["measured"] = pooled(
                [s["measured"] for s in row["segments"]], trace, slo, args.seed
            )
    return {
        "machine": benchutil.machine_info(),
        "setup": {
            "vllm": "0.32.0 (vllm-cpu), tiny Llama (2 layers, hidden 256), float32, CPU",
            "engine_cpu": engine_cpu,
            "client_cpus": sorted(others),
            "max_num_seqs": MAX_NUM_SEQS,
            "max_num_batched_tokens": MAX_BATCHED_TOKENS,
            "seed": args.seed,
            "duration_s": duration,
            "segments": segments,
            "probe_budget_s": budget,
            "probe_attempts": attempts,
            "rate85_rps": rate85,
            "profile": profile_to_dict(profile),
            "request_path": request_path(probe.report),
        },
        "loads": rows,
    }


def segment(
    trace: Sequence[TraceRequest], duration: float, segments: int, j: int
) -> tuple[int, list[TraceRequest]]:
    """The `j`th of `segments` equal stretches of `trace`'s `duration`, its arrivals from 0,
    and the trace's index of its first request."""
    start, end = j * duration / segments, (j + 1) * duration / segments
    picked = [i for i, r in enumerate(trace) if start <= r.arrival_s < end]
    first = picked[0] if picked else len(trace)
    return first, [
        dataclasses.replace(trace[i], arrival_s=trace[i].arrival_s - start) for i in picked
    ]


def rate_search(profile: CalibrationProfile, seed: int, duration: float) -> SearchProblem:
    """The simulated 0.85 point of this engine on the first `duration` seconds of the trace;
    its run holds the trace and the SLO class, derived from the profile."""
    base = fidelity_trace(seed)
    slo = capacity.slo_targets(profile, base)["chat"]
    run = one_engine_run(profile, base, slo, 0)
    return SearchProblem(run, TARGET_GOODPUT, 0.2, 400.0, horizon_s=duration)


def compare(doc: dict[str, Any]) -> dict[str, Any]:
    """The predicted half, from what `measure` recorded (its profile, request path, trace seed
    and rates), with the errors: for the engine model alone, and with the request path."""
    setup = doc["setup"]
    profile = profile_from_dict(setup["profile"], "the recorded profile")
    path = RequestPath.recorded(setup["request_path"])
    search = rate_search(profile, setup["seed"], setup["duration_s"])
    slo = search.run.slo_classes[0]
    setup["slo"] = {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s}
    setup["sim_seeds"] = SIM_SEEDS
    # The requests every load replays (each load replays the trace's first seconds at its rate:
    # the lightest load's requests are the first of every other). The same requests under more
    # load should decode no faster; the model has them a little slower.
    shared = setup["shared_requests"] = min(row["requests"] for row in doc["loads"])
    company: list[tuple[int, float]] = []
    for i, row in enumerate(doc["loads"]):
        trace = search.trace_at(row["rate_rps"])
        if len(trace) != row["requests"]:
            raise SystemExit(f"load x{row['load']}: the trace is not the one measured")
        # The load as it was served: in segments (each from an idle engine), or whole.
        stretches = [
            (
                s["first"],
                segment(trace, setup["duration_s"], len(row["segments"]), j)[1],
                f"loads[{i}].segments[{j}].probe_before",
                s["probe_before"],
            )
            for j, s in enumerate(row.get("segments", ()))
        ] or [(0, trace, f"loads[{i}].probe_before", row.get("probe_before"))]
        first_probe = predicted(
            [Part(tuple(t), first, profile, path) for first, t, _, _ in stretches], slo, shared
        )
        prediction = first_probe.figures
        row["shared_tpot_p50_s"] = {
            "measured": statistics.median(
                r[2] for r in row["measured"]["requests"] if r[0] < shared and r[2] > 0
            ),
            "predicted": first_probe.shared_tpot,
        }
        if all(before is not None for *_, before in stretches):
            # The same requests predicted from the probe taken just before each stretch (what
            # an operator re-probing on drift would route by), next to the first probe's.
            befores = [
                Part(
                    tuple(t),
                    first,
                    profile_from_dict(before["profile"], f"{where}.profile"),
                    RequestPath.recorded(before["request_path"]),
                )
                for first, t, where, before in stretches
            ]
            fresh = predicted(befores, slo, shared)
            prediction["probe_before"] = fresh.figures["with_request_path"]
            row["shared_tpot_p50_s"]["probe_before"] = fresh.shared_tpot
            for first, t, _, _ in stretches:
                company += tpot_in_company(t, first, row["measured"]["requests"], fresh.tpot)
            for s, part in zip(row.get("segments", ()), befores, strict=False):
                # Each stretch alone against the probe just before it: how far one probe
                # carries on this machine.
                alone = predicted([part], slo, 0)
                s["error_from_probe_before"] = errors(
                    s["measured"], alone.figures["with_request_path"]
                )
        row["predicted"] = prediction
        row["error"] = {k: errors(row["measured"], p) for k, p in row["predicted"].items()}
    if company:
        doc["tpot_by_company"] = by_company(company)
    return doc


def _recorded(path: Path) -> dict[str, Any]:
    """A measurement this bench wrote, or exit naming what is wrong with the file."""
    try:
        doc = json.loads(path.read_text())
        for key in ("profile", "request_path", "seed", "duration_s"):
            if key not in doc["setup"]:
                raise KeyError(f"setup.{key}")
        for i, row in enumerate(doc["loads"]):
            for key in ("load", "rate_rps", "requests", "measured"):
                if key not in row:
                    raise KeyError(f"loads[{i}].{key}")
            befores = (
                [(f"loads[{i}].probe_before", row["probe_before"])] if "probe_before" in row else []
            )
            for j, s in enumerate(row.get("segments", ())):
                for key in ("first", "probe_before"):
                    if key not in s:
                        raise KeyError(f"loads[{i}].segments[{j}].{key}")
                befores.append((f"loads[{i}].segments[{j}].probe_before", s["probe_before"]))
            for where, before in befores:
                for key in ("profile", "request_path"):
                    if key not in before:
                        raise KeyError(f"{where}.{key}")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SystemExit(f"{path}: not a measurement of this bench: {exc}") from None
    return dict(doc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--duration", type=float, default=0.0, help="seconds of trace per load")
    ap.add_argument("--loads", default="", help="factors of the predicted 0.85 rate, e.g. 0.5,1")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--segments",
        type=int,
        default=0,
        help=f"stretches per load, each probed before (default {SEGMENTS})",
    )
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--repredict",
        metavar="FILE",
        help="no engine: predict again for the measurements FILE recorded (after a model change)",
    )
    args = ap.parse_args()
    if args.segments < 0:
        ap.error(f"--segments: must be at least 1, got {args.segments}")  # exits 2
    doc = _recorded(Path(args.repredict)) if args.repredict else measure(args)
    doc = compare(doc)
    benchutil.write_json(args.json, doc)
    for row in doc["loads"]:
        print(f"x{row['load']}: {row['requests']} requests, {json.dumps(row['error'])}")
        shared = row["shared_tpot_p50_s"]
        print(
            f"  TPOT p50 of the first {doc['setup']['shared_requests']} requests: measured "
            f"{1e3 * shared['measured']:.2f} ms, predicted {1e3 * shared['predicted']:.2f} ms"
            + (
                f" (from the probes before its stretches {1e3 * shared['probe_before']:.2f} ms)"
                if "probe_before" in shared
                else ""
            )
        )
        for j, s in enumerate(row.get("segments", ())):
            error = json.dumps(s["error_from_probe_before"])
            print(f"  stretch {j + 1} from the probe before it: {error}")
    for bucket in doc.get("tpot_by_company", ()):
        print(
            f"requests with {bucket['others_decoding']} others decoding beside them: "
            f"{bucket['requests']}, TPOT measured / predicted (from the probe before) "
            f"{bucket['tpot_measured_over_predicted_p50']:.3f} (median)"
        )


if __name__ == "__main__":
    main()
