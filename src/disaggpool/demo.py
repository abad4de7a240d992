"""`disaggpool demo`: the whole product on one machine, no cluster, no GPU, a few minutes.

1. **Pool.** Four emulators (`disaggpool emulate`, each its own process) timed by hidden *true*
   profiles the router never sees: the built-in A40 Llama-3-8B profile on boards at different
   speeds (`BOARDS`: 1.0, 1.0, 0.55 and 1.25, two nominal boards, a throttled one and a faster
   one), 64 sequences each, prefix caching off (every policy replays the same prompts on the same
   pods; cached, the later replays would prefill nothing). Which boards prefill and which decode
   is chosen as the paper run chooses its split (`placed_pool`, `sim.placement`): for every
   assignment of the boards to the two roles, the simulator finds the rate at which round-robin
   attains 0.85 goodput on the demo's trace, and the assignment carrying the most traffic runs
   (ties to more decode pods). It is chosen on the true profiles before any pod starts, without
   looking at any other policy. (The demo's former pool, 1 prefill + 3 decode, was prefill-bound:
   on this trace it carries 2.5 times less.) `DemoConfig.prefill_speeds`/`decode_speeds` fix a
   pool instead.
   With `--trace mooncake`: two prefill pods (1.0 and 1.6) and two decode pods (1.0 and 0.55),
   prefix caching on as in vLLM, every pod's cache emptied between policies (vLLM's
   `POST /reset_prefix_cache`, the emulators started with `VLLM_SERVER_DEV_MODE=1`), and every
   sidecar keeping its prefix index (`prefix_index: true`).
2. **Calibration.** `disaggpool calibrate` probes every pod over HTTP, as the operator's Job does
   (decode pods with the prefill pod as KV peer), and writes the fitted profiles; a fit that
   comes out poor is probed again, up to `PROBE_ATTEMPTS` times, as the operator does.
3. **Operating point.** The trace is the embedded Azure 2023 conversation trace
   (`formats.embedded`; lengths clipped to 2048/256 tokens) with bursty Gamma arrivals (CV 3),
   or with `--trace mooncake` a contiguous slice of the embedded Mooncake conversation trace
   (its own arrivals and prefix blocks; prompts clipped to 7,680 tokens, outputs to 64);
   its SLO class is derived from unloaded latency (`sim.capacity.slo_targets`: TTFT x4, TPOT x2
   of the p90 request on the nominal board), and its rate is the one at which round-robin
   attains 0.85 goodput on the chosen pool in the simulator (`sim.operating_point`, the search
   `sim paper` uses): the regime where routing decisions matter.
4. **Replay.** For each policy a fresh sidecar process (`disaggpool sidecar`) fronts the pool and
   `loadgen.replay` sends the trace through its front door.
5. **Prediction.** The simulator runs the same trace, the same policies, the true profiles as the
   engines' timing and the fitted ones as the router's belief, with `DemoConfig.sim_seeds` seeds
   of the engines' step jitter; the table puts the mean (and its spread) next to the
   measurement. On a bursty trace of a few hundred requests that spread is a point or two,
   so a single measured run can only agree with the simulator within that noise.
6. **Told apart?** Each measured goodput comes with its 95% bootstrap interval over requests,
   and the first policy (calibrated) is compared with each other one request by request on the
   same trace (`core.stats.bootstrap_paired_difference_interval`); the output says which
   differences this run cannot tell from 0. `--duration 120` narrows them.

`--json FILE` writes ``{"policies": [{"policy", "goodput_measured", "goodput_ci95",
"vs_first_ci95", "goodput_simulated", "requests", "errors", "ttft_p99_s", "tpot_p99_s",
"cached_share", ...}], "setup": {...}}``: the setup holds the rate, the placements searched
(`placements_rps`), the trace, the SLO class, and per pod its true and its fitted speed;
`cached_share` is the share of prompt tokens the prefill pods found cached during the policy's
replay (`vllm:prefix_cache_hits` / `_queries`; null with prefix caching off), next to the
simulator's (`cached_share_simulated`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import random
import re
import signal
import socket
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

import yaml

from disaggpool import promtext
from disaggpool.core.contracts import SLOClass
from disaggpool.core.hardware import builtin_profile
from disaggpool.core.policies.registry import DEFAULT_DECODE_BINDING, default_options
from disaggpool.core.prefix_index import leading_hit_tokens
from disaggpool.core.profile import CalibrationProfile
from disaggpool.core.stats import bootstrap_paired_difference_interval, bootstrap_share_interval
from disaggpool.formats.embedded import AZURE_2023_FILES, embedded_trace, read_embedded_trace
from disaggpool.formats.profiles import load_profile, save_profile
from disaggpool.formats.traces import TraceRequest
from disaggpool.loadgen import LoadReport, replay
from disaggpool.operator.spec import DEFAULT_MAX_PROBE_ATTEMPTS
from disaggpool.sim import capacity, workload
from disaggpool.sim.cluster import InstanceSpec, RouterOptions
from disaggpool.sim.operating_point import SearchProblem, operating_rates
from disaggpool.sim.placement import Placement, best_placement, describe, placements
from disaggpool.sim.runner import RunSpec, execute

__all__ = [
    "DemoConfig",
    "PlacedPool",
    "config_from_args",
    "demo_trace",
    "free_port",
    "operating_rate",
    "placed_pool",
    "processes",
    "register",
    "reusable_share",
    "run_demo",
    "simulated_run",
    "stderr_messages",
    "true_profiles",
    "wait_http",
]

POLICIES = ("calibrated", "round_robin", "least_loaded", "length")
# The demo's four boards, as speeds relative to the A40: two nominal, a throttled one and a
# faster one. Which of them prefill and which decode is the placement search's choice.
BOARDS = (1.0, 1.0, 0.55, 1.25)
DECODE_SPEEDS = (1.0, 0.55, 1.25)  # the decode boards of a fixed 1 + 3 pool (the peers bench)
TRACES = ("azure", "mooncake")
# --trace mooncake: the pool (prefix placement needs two prefill pods, one faster) and the
# policies (the cache-blind baselines and two peers' prefix rules beside ours).
MOONCAKE_PREFILL_SPEEDS = (1.0, 1.6)
MOONCAKE_DECODE_SPEEDS = (1.0, 0.55)
MOONCAKE_POLICIES = ("calibrated", "round_robin", "least_loaded", "cache_aware", "dynamo_kv")
MOONCAKE_CLIP = (7680, 64)  # prompt, output: within the profile's 8,192-token context
MAX_NUM_SEQS = 64
PROBE_ATTEMPTS = DEFAULT_MAX_PROBE_ATTEMPTS  # a poor fit probed again, as the operator does
TARGET_GOODPUT = 0.85
JITTER = 0.03  # the emulator's default step jitter, used by the simulator too
SIM_SEEDS = 10
SCRAPE_INTERVAL_S = 0.5  # the sidecars' scrape interval, which the simulator plays too
# The sidecar's default, named here so the simulated side binds as the real one does.
DECODE_BINDING = DEFAULT_DECODE_BINDING
SEARCH_BRACKET = (0.5, 40.0)  # req/s: the operating-point search's bracket
SEARCH_STEPS = 14  # bisection steps: the bracket narrowed to 2.4 milli-req/s


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    duration_s: float = 30.0  # trace length
    budget_s: float = 20.0  # probe budget per pod
    policies: tuple[str, ...] = POLICIES
    seed: int = 0
    # Simulator runs per policy (seeds of the engines' step jitter) behind the predicted goodput
    # and its spread; at least 2. Fewer only make the prediction noisier (the tests use 2).
    sim_seeds: int = SIM_SEEDS
    # The boards the placement search assigns to the two roles (`sim.placement`), or, with
    # both `prefill_speeds` and `decode_speeds` set, a fixed pool: one pod per entry, at that
    # speed relative to the A40 (the tests use small fixed pools, which calibrate sooner).
    boards: tuple[float, ...] = BOARDS
    prefill_speeds: tuple[float, ...] | None = None
    decode_speeds: tuple[float, ...] | None = None
    trace: str = "azure"  # or "mooncake": prefix caching on, prefix index in every sidecar

    def __post_init__(self) -> None:
        if (self.prefill_speeds is None) != (self.decode_speeds is None):
            raise ValueError("a fixed pool needs both prefill_speeds and decode_speeds")
        for field in ("boards", "decode_speeds", "prefill_speeds"):
            speeds = getattr(self, field)
            if speeds is not None and (not speeds or min(speeds) <= 0):
                raise ValueError(f"{field} must be positive, got {speeds}")
        if len(self.boards) < 2:
            raise ValueError(f"boards: a pool needs at least two, got {self.boards}")
        if self.trace not in TRACES:
            raise ValueError(f"trace must be one of {', '.join(TRACES)}, got {self.trace!r}")
        if self.sim_seeds < 2:
            raise ValueError(
                f"sim_seeds must be >= 2 (a spread needs two runs), got {self.sim_seeds}"
            )

    @property
    def placements(self) -> list[Placement]:
        """The pools to choose from: the fixed one, or every placement of the boards."""
        if self.prefill_speeds is not None and self.decode_speeds is not None:
            return [(self.prefill_speeds, self.decode_speeds)]
        return placements(self.boards)

    @property
    def prefix(self) -> bool:
        """Whether the pods cache prefixes (and so every router keeps a prefix index)."""
        return self.trace == "mooncake"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _say(msg: str) -> None:
    print(f"[demo] {msg}", file=sys.stderr, flush=True)


def true_profiles(
    decode_speeds: Sequence[float] = DECODE_SPEEDS, prefill_speeds: Sequence[float] = (1.0,)
) -> dict[str, tuple[str, CalibrationProfile]]:
    """pod name -> (role, hidden true profile): one prefill pod per speed, then one decode pod
    per speed."""
    base = dataclasses.replace(builtin_profile("a40-llama3-8b"), max_num_seqs=MAX_NUM_SEQS)
    pods: dict[str, tuple[str, CalibrationProfile]] = {}
    for i, speed in enumerate(prefill_speeds):
        name = f"prefill-{i}"
        pods[name] = ("prefill", base.scaled(speed, name=name))
    for i, speed in enumerate(decode_speeds):
        name = f"decode-{i}"
        pods[name] = ("decode", base.scaled(speed, name=name))
    return pods


def demo_trace(seed: int, trace_name: str = "azure") -> tuple[list[TraceRequest], SLOClass]:
    """2,000 requests of one class (arrivals rescaled later): Azure conversation lengths in bursty
    arrivals, or a contiguous slice of the Mooncake conversation trace, its own arrivals from 0
    and its prefix blocks (conversations reuse their prefixes only within a slice)."""
    rng = random.Random(f"demo:{seed}")
    if trace_name == "mooncake":
        reqs = workload.clip_lengths(embedded_trace("mooncake-conversation"), *MOONCAKE_CLIP)
        start = rng.randrange(0, max(1, len(reqs) - 2000))
        picked = reqs[start : start + 2000]
        t0 = picked[0].arrival_s
        trace = [
            dataclasses.replace(r, arrival_s=r.arrival_s - t0, slo_class="chat") for r in picked
        ]
    else:
        conv = read_embedded_trace(AZURE_2023_FILES["conv"], default_class="chat")
        lengths = workload.clip_lengths(conv, 2048, 256)
        start = rng.randrange(0, max(1, len(lengths) - 2000))
        picked = lengths[start : start + 2000]
        arrivals = workload.gamma_arrivals(1.0, 3.0, len(picked), rng)
        trace = workload.with_arrivals(picked, arrivals)
    nominal = builtin_profile("a40-llama3-8b")
    slo = capacity.slo_targets(nominal, trace)["chat"]
    return trace, slo


def reusable_share(trace: Sequence[TraceRequest]) -> float:
    """The share of the trace's prompt tokens one cache holding every earlier prompt would find
    (vLLM's lookup rule): the most any routing could hit. 0 for a trace without blocks."""
    seen: set[int] = set()
    hits = total = 0
    for r in trace:
        total += r.prompt_tokens
        if r.blocks:
            hits += leading_hit_tokens(r.blocks, r.prompt_tokens, r.block_tokens, seen)
            seen.update(r.blocks)
    return hits / total if total else 0.0


def simulated_run(
    pods: dict[str, tuple[str, CalibrationProfile]],
    believed: dict[str, CalibrationProfile],
    trace: Sequence[TraceRequest],
    slo: SLOClass,
    policy: str,
    seed: int,
    prefix: bool = False,
) -> RunSpec:
    """One simulator run of the demo pool: engines timed by the true profiles with the
    emulator's step jitter, the router believing `believed` (the fitted profiles; a pod missing
    from it has no profile, as before calibration); with `prefix`, the engines cache prefixes and
    the router keeps its prefix index."""
    instances = tuple(
        InstanceSpec(name, role, true, believed.get(name)) for name, (role, true) in pods.items()
    )
    return RunSpec(
        experiment="demo",
        trace_name="demo",
        trace=tuple(trace),
        history=(),
        instances=instances,
        policy=policy,
        predictor="online",
        slo_classes=(slo,),
        seed=seed,
        jitter=JITTER,
        # what the sidecar below runs: its scrape interval and the policy's default switches
        router=RouterOptions(
            scrape_interval_s=SCRAPE_INTERVAL_S,
            prefix_index=prefix,
            late_binding=DECODE_BINDING == "late",
        ),
        options=default_options(policy),
        prefix_caching=prefix,
    )


def _rate_search(
    pods: dict[str, tuple[str, CalibrationProfile]],
    trace: Sequence[TraceRequest],
    slo: SLOClass,
    duration_s: float,
    seed: int,
    prefix: bool,
) -> SearchProblem:
    """Round-robin's TARGET_GOODPUT point on the first `duration_s` seconds of `trace`, on the
    true pool `pods`."""
    run = simulated_run(pods, {}, trace, slo, "round_robin", seed, prefix)
    return SearchProblem(run, TARGET_GOODPUT, *SEARCH_BRACKET, horizon_s=duration_s)


def operating_rate(
    pods: dict[str, tuple[str, CalibrationProfile]],
    trace: Sequence[TraceRequest],
    slo: SLOClass,
    duration_s: float,
    seed: int,
    prefix: bool = False,
) -> tuple[float, list[TraceRequest]]:
    """The highest rate at which round-robin attains TARGET_GOODPUT on the first `duration_s`
    seconds of `trace`, and the trace at that rate (`sim.operating_point`, on the true pool)."""
    problem = _rate_search(pods, trace, slo, duration_s, seed, prefix)
    (rate,) = operating_rates([problem], steps=SEARCH_STEPS, workers=1)
    return rate, problem.trace_at(rate)


@dataclasses.dataclass(frozen=True)
class PlacedPool:
    """The pool the demo runs and how it was chosen."""

    pods: dict[str, tuple[str, CalibrationProfile]]
    rate: float  # round-robin's TARGET_GOODPUT point on it
    trace: list[TraceRequest]  # the demo's trace at that rate
    chosen: str  # `placement.describe` of it
    searched: dict[str, float]  # every placement searched -> its rate


def placed_pool(cfg: DemoConfig, trace: Sequence[TraceRequest], slo: SLOClass) -> PlacedPool:
    """The pool the demo runs, chosen as the paper run chooses its split: of `cfg.placements`,
    the one carrying the most traffic at round-robin's TARGET_GOODPUT point in the simulator
    (`sim.placement`)."""
    options = cfg.placements
    problems = [
        _rate_search(true_profiles(d, p), trace, slo, cfg.duration_s, cfg.seed, cfg.prefix)
        for p, d in options
    ]
    # Before any pod starts: the machine's cores are the search's.
    rates = operating_rates(problems, steps=SEARCH_STEPS, workers=None if len(options) > 1 else 1)
    best = best_placement(options, rates)
    prefill, decode = options[best]
    return PlacedPool(
        pods=true_profiles(decode, prefill),
        rate=rates[best],
        trace=problems[best].trace_at(rates[best]),
        chosen=describe(options[best]),
        searched={describe(o): round(r, 3) for o, r in zip(options, rates, strict=True)},
    )


@contextlib.contextmanager
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    """A list to put child processes in; every one is stopped on leaving (the benches use it)."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not ready after {timeout:.0f} s")


def stderr_messages(stderr: str) -> list[str]:
    """The lines of a subcommand's stderr without its progress bars, which redraw in place
    (carriage returns, cursor-up escapes) and so share lines with the messages."""
    parts = (part.strip() for line in stderr.splitlines() for part in _REDRAW.split(line))
    return [part for part in parts if part and not _PROGRESS.search(part)]


_REDRAW = re.compile(r"\r|\x1b\[[0-9;]*[A-Za-z]")
_PROGRESS = re.compile(r"\|\s*\d+/\d+\s*\[")  # a tqdm bar: "|███  | 8/360 [00:02<..."


def _running(url: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    names = ["vllm:num_requests_running", "vllm:num_requests_waiting"]
    return sum(s.value for s in promtext.parse(text, names))


def wait_idle(urls: Sequence[str], timeout: float = 120.0) -> None:
    """Until no pod at `urls` runs or queues a request (at most `timeout` seconds)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if all(_running(u) == 0 for u in urls):
            return
        time.sleep(0.5)


def _cache_counts(urls: Sequence[str]) -> tuple[float, float]:
    """Prompt tokens looked up and found cached, summed over the pods at `urls`."""
    names = ["vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"]
    queries = hits = 0.0
    for url in urls:
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
            fams = promtext.parse(resp.read().decode(), names)
        queries += promtext.total(fams, names[0])
        hits += promtext.total(fams, names[1])
    return queries, hits


def _reset_caches(urls: Sequence[str], timeout: float = 60.0) -> None:
    """Empty every pod's prefix cache (vLLM's dev endpoint), so that no policy finds the previous
    one's prompts; a pod refuses while KV is still lent (a lease not yet returned): retried."""
    end = time.monotonic() + timeout
    for url in urls:
        while True:
            req = urllib.request.Request(f"{url}/reset_prefix_cache", data=b"", method="POST")
            with urllib.request.urlopen(req, timeout=5) as resp:
                if json.loads(resp.read()).get("success"):
                    break
            if time.monotonic() > end:
                raise RuntimeError(f"{url}: the prefix cache could not be reset")
            time.sleep(0.5)


def start_calibrated_pool(
    cfg: DemoConfig,
    pods: dict[str, tuple[str, CalibrationProfile]],
    tmp: Path,
    procs: list[subprocess.Popen[bytes]],
) -> tuple[dict[str, str], dict[str, CalibrationProfile]]:
    """One emulator process per pod of `pods`, timed by its hidden true profile, then each pod
    probed by `disaggpool calibrate` into ``tmp/profiles/<pod>.yaml``: (pod -> URL, pod -> fitted
    profile). The processes go into `procs` (`processes` stops them)."""
    exe = [sys.executable, "-m", "disaggpool"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    (tmp / "profiles").mkdir(exist_ok=True)
    urls: dict[str, str] = {}
    started: list[subprocess.Popen[bytes]] = []
    # With prefix caching, vLLM's dev endpoint empties the caches between policies; without,
    # every policy replays the same prompts and would find the previous ones' cached.
    caching = ["--enable-prefix-caching"] if cfg.prefix else ["--no-enable-prefix-caching"]
    _say(f"starting {len(pods)} emulated vLLM pods (hidden profiles)")
    for name, (_, true) in pods.items():
        path = tmp / f"true-{name}.yaml"
        save_profile(true, path)
        port = free_port()
        urls[name] = f"http://127.0.0.1:{port}"
        pod_env = {**env, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
        if cfg.prefix:
            pod_env["VLLM_SERVER_DEV_MODE"] = "1"
        log = (tmp / f"{name}.log").open("wb")
        started.append(
            subprocess.Popen(
                [*exe, "emulate", "--profile", str(path), "--port", str(port),
                 "--seed", str(cfg.seed + len(started)), *caching],
                env=pod_env, stdout=log, stderr=subprocess.STDOUT,
            )
        )  # fmt: skip
        procs.append(started[-1])
    for name, proc in zip(pods, started, strict=True):
        wait_http(f"{urls[name]}/health", proc)

    prefill_url = next(urls[n] for n, (role, _) in pods.items() if role == "prefill")
    for name, (role, _) in pods.items():
        _say(f"calibrating {name} ({role}, {cfg.budget_s:.0f} s probe)")
        out = str(tmp / "profiles" / f"{name}.yaml")
        cmd = [*exe, "calibrate", "--endpoint", urls[name], "--role", role, "--name", name,
               "--out", out, "--budget-seconds", str(cfg.budget_s),
               "--max-num-seqs", str(MAX_NUM_SEQS)]  # fmt: skip
        if role == "decode":
            cmd += ["--peer", prefill_url]
        # A poor fit (exit 3, a machine busy while it probed) is probed again, as the operator
        # does by default (`calibration.reprobeOnPoor`, `maxAttempts`); the last one is kept.
        for attempt in range(1, PROBE_ATTEMPTS + 1):
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            said = stderr_messages(done.stderr)
            if done.returncode not in (0, 3):
                detail = "\n".join(said[-10:]) or done.stderr[-2000:]
                raise RuntimeError(f"calibrating {name} failed (exit {done.returncode}):\n{detail}")
            _say("  " + (said or ["?"])[-1])
            if done.returncode == 0 or attempt == PROBE_ATTEMPTS:
                break
            _say(f"  {name}: the fit is poor, probing again ({attempt + 1} of {PROBE_ATTEMPTS})")
    return urls, {name: load_profile(tmp / "profiles" / f"{name}.yaml") for name in pods}


def run_demo(cfg: DemoConfig, json_out: str | None = None) -> dict[str, Any]:
    exe = [sys.executable, "-m", "disaggpool"]
    base_trace, slo = demo_trace(cfg.seed, cfg.trace)
    if len(cfg.placements) > 1:
        _say(f"placement search: {len(cfg.placements)} ways to give the boards their roles")
    placed = placed_pool(cfg, base_trace, slo)
    pods, rate, trace = placed.pods, placed.rate, placed.trace
    with tempfile.TemporaryDirectory(prefix="disaggpool-demo-") as tmp_name, processes() as procs:
        tmp = Path(tmp_name)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        urls, fitted = start_calibrated_pool(cfg, pods, tmp, procs)
        _say(
            f"trace: {len(trace)} requests over {cfg.duration_s:.0f} s at {rate:.2f} req/s "
            f"(round-robin's {TARGET_GOODPUT} goodput point); SLO TTFT {slo.ttft_s:.2f} s, "
            f"TPOT {slo.tpot_s * 1000:.0f} ms"
        )
        prefill_urls = [urls[n] for n, (role, _) in pods.items() if role == "prefill"]
        rows = []
        met_by_policy: list[list[bool]] = []
        for policy in cfg.policies:
            sims = [
                execute(simulated_run(pods, fitted, trace, slo, policy, cfg.seed + k, cfg.prefix))
                for k in range(cfg.sim_seeds)
            ]
            sim_goodput = [r["goodput"] for r in sims]
            if cfg.prefix:
                _reset_caches(list(urls.values()))
            before = _cache_counts(prefill_urls)
            measured, counts = serve_policy(
                exe, env, tmp, urls, pods, policy, trace, slo, procs, cfg.prefix
            )
            wait_idle(list(urls.values()))
            after = _cache_counts(prefill_urls)
            queries, hits = after[0] - before[0], after[1] - before[1]
            summary = measured.summary()
            met = [measured.met(r) for r in measured.results]  # in trace order
            met_by_policy.append(met)
            rows.append(
                {
                    "policy": policy,
                    "goodput_measured": round(summary["goodput"], 4),
                    "goodput_ci95": [round(x, 4) for x in bootstrap_share_interval(met, cfg.seed)],
                    "goodput_simulated": round(statistics.fmean(sim_goodput), 4),
                    "goodput_simulated_sd": round(statistics.stdev(sim_goodput), 4),
                    "requests": summary["requests"],
                    "errors": summary["errors"],
                    "ttft_p99_s": round(summary["ttft_p99_s"], 4),
                    "tpot_p99_s": round(summary["tpot_p99_s"], 4),
                    "ttft_p99_s_simulated": round(
                        statistics.fmean(r["ttft_p99_s"] for r in sims), 4
                    ),
                    "tpot_p99_s_simulated": round(
                        statistics.fmean(r["tpot_p99_s"] for r in sims), 4
                    ),
                    "served_by_pod": counts["decode"],
                    "prefilled_by_pod": counts["prefill"],
                    "cached_share": round(hits / queries, 4) if cfg.prefix and queries else None,
                    "cached_share_simulated": (
                        round(statistics.fmean(r["prefix_hit"] for r in sims), 4)
                        if cfg.prefix
                        else None
                    ),
                }
            )
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
                    n: {"role": r, "speed_vs_a40": round(_speed(p), 3)}
                    for n, (r, p) in pods.items()
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
    _print_table(result)
    if json_out:
        Path(json_out).write_text(json.dumps(result, indent=1))
    return result


def _speed(p: CalibrationProfile) -> float:
    """Decode speed relative to the A40: the ratio of step times at a mid-sized batch (16
    sequences, 16k context tokens), so a fitted profile whose constants trade off against each
    other still compares; for a `scaled` A40 profile it is exactly the scale."""
    a40 = builtin_profile("a40-llama3-8b").decode.step(16, 16384)
    return a40 / p.decode.step(16, 16384)


def serve_policy(
    exe: list[str],
    env: dict[str, str],
    tmp: Path,
    urls: dict[str, str],
    pods: dict[str, tuple[str, CalibrationProfile]],
    policy: str,
    trace: Sequence[TraceRequest],
    slo: SLOClass,
    procs: list[subprocess.Popen[bytes]],
    prefix_index: bool = False,
) -> tuple[LoadReport, dict[str, dict[str, int]]]:
    """Replay `trace` through a fresh sidecar running `policy` (keeping its prefix index with
    `prefix_index`); the report and, per role and pod, how many requests the sidecar sent there
    (read from its metrics; under "prefill", "local" counts the prompts the P/D decider had a
    decode pod prefill itself)."""
    port = free_port()
    config = {
        "policy": policy,
        "model": builtin_profile("a40-llama3-8b").model,
        "listen": {"http": f"127.0.0.1:{port}", "grpc": "127.0.0.1:0"},
        "slo_classes": [{"name": slo.name, "ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s}],
        "scrape_interval_s": SCRAPE_INTERVAL_S,
        "decode_binding": DECODE_BINDING,
        "tokenizer": {"kind": "emulator"},
        "pool": {
            "static": {
                role: [{"name": n, "url": urls[n]} for n, (r, _) in pods.items() if r == role]
                for role in ("prefill", "decode")
            }
        },
        "profiles": {"dir": str(tmp / "profiles")},
        "prefix_index": prefix_index,
    }
    path = tmp / f"sidecar-{policy}.yaml"
    path.write_text(yaml.safe_dump(config))
    log = (tmp / f"sidecar-{policy}.log").open("wb")
    proc = subprocess.Popen(
        [*exe, "sidecar", "--config", str(path)], env=env, stdout=log, stderr=subprocess.STDOUT
    )
    procs.append(proc)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/health", proc)
        time.sleep(1.0)  # one scrape interval and a profile-directory pass
        from tqdm import tqdm

        bar = tqdm(total=len(trace), desc=f"{policy:>13}", unit="req", leave=True)

        def tick(_: object) -> None:
            bar.update(1)

        report = asyncio.run(replay(url, trace, [slo], on_done=tick))
        bar.close()
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
            metrics = resp.read().decode()
        counts: dict[str, dict[str, int]] = {"prefill": {}, "decode": {}}
        names = ["disaggpool_route_decisions_total", "disaggpool_local_prefills_total"]
        for sample in promtext.parse(metrics, names):
            local = sample.name == "disaggpool_local_prefills_total"
            role = "prefill" if local else sample.labels.get("role", "")
            pod = "local" if local else sample.labels["pod"]
            if role in counts:
                counts[role][pod] = counts[role].get(pod, 0) + int(sample.value)
        return report, {role: dict(sorted(c.items())) for role, c in counts.items()}
    finally:
        proc.terminate()
        proc.wait(10)


def _print_table(result: dict[str, Any]) -> None:
    setup = result["setup"]
    roles = [pod["role"] for pod in setup["pods"].values()]
    print(
        f"\ndisaggpool demo: {roles.count('prefill')} prefill + {roles.count('decode')} decode "
        f"emulated pods, {setup['trace']} trace, {setup['rate_rps']} req/s for "
        f"{setup['duration_s']:.0f} s; SLO TTFT <= {setup['slo']['ttft_s']:.2f} s, "
        f"TPOT <= {setup['slo']['tpot_s'] * 1000:.0f} ms"
    )
    if len(setup["placements_rps"]) > 1:
        print(
            "placement: the one carrying the most traffic at round-robin's "
            f"{TARGET_GOODPUT} goodput point in the simulator, of "
            + ", ".join(
                f"{name} {rate:.2f}{' (chosen)' if name == setup['placement'] else ''}"
                for name, rate in sorted(setup["placements_rps"].items(), key=lambda kv: -kv[1])
            )
            + " req/s"
        )
    cached = setup["trace"] == "mooncake"
    # With one decode pod, routing decides where each prompt is prefilled: show that instead.
    one_decode = roles.count("decode") == 1
    head = (f"{'policy':<14}{'goodput':>9}{'95% interval':>15}{'simulated (sd)':>16}{'errors':>8}"
            f"{'TTFT p99':>10}"
            f"{'TPOT p99':>10}{'   cached (sim)' if cached else ''}"
            f"  {'prefills per pod' if one_decode else 'decode requests per pod'}")  # fmt: skip
    print(head)
    for r in result["policies"]:
        pools = r["prefilled_by_pod"] if one_decode else r["served_by_pod"]
        served = " ".join(f"{k}={v}" for k, v in pools.items())
        share = (
            f"{r['cached_share'] or 0.0:>9.3f} ({r['cached_share_simulated']:.3f})"
            if cached
            else ""
        )
        print(
            f"{r['policy']:<14}{r['goodput_measured']:>9.3f}"
            f"{r['goodput_ci95'][0]:>9.3f}-{r['goodput_ci95'][1]:.3f}"
            f"{r['goodput_simulated']:>9.3f} "
            f"({r['goodput_simulated_sd']:.3f})"
            f"{r['errors']:>8}{r['ttft_p99_s']:>9.2f}s{r['tpot_p99_s'] * 1000:>8.0f}ms"
            f"{share}  {served}"
        )
    first, *others = result["policies"]
    for r in others:
        lo, hi = r["vs_first_ci95"]
        gap = first["goodput_measured"] - r["goodput_measured"]
        print(
            f"{first['policy']} - {r['policy']}: {100 * gap:+.1f} points "
            f"(95% interval {100 * lo:+.1f} to {100 * hi:+.1f}, paired over the same requests)"
        )
    tied = [r["policy"] for r in others if r["vs_first_ci95"][0] <= 0 <= r["vs_first_ci95"][1]]
    if tied:
        print(
            f"{first['policy']} is not told apart from {', '.join(tied)} by this run: the 95% "
            "interval of the difference includes 0; a longer --duration narrows it."
        )


def config_from_args(args: argparse.Namespace) -> DemoConfig:
    """The `demo` command's arguments as a config: `--trace mooncake` brings its own pool and
    policies unless `--policies` names others."""
    mooncake = args.trace == "mooncake"
    default = MOONCAKE_POLICIES if mooncake else POLICIES
    policies = tuple(args.policies.split(",")) if args.policies else default
    pool: dict[str, Any] = (
        {"prefill_speeds": MOONCAKE_PREFILL_SPEEDS, "decode_speeds": MOONCAKE_DECODE_SPEEDS}
        if mooncake
        else {}
    )
    return DemoConfig(
        duration_s=args.duration,
        budget_s=args.budget_seconds,
        policies=policies,
        seed=args.seed,
        trace=args.trace,
        **pool,
    )


def _stop(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def _run(args: argparse.Namespace) -> int:
    # SIGTERM unwinds like Ctrl-C does, so `processes` stops the emulators and sidecars it started
    # (Python's default for SIGTERM is to die on the spot and leave them running).
    signal.signal(signal.SIGTERM, _stop)
    run_demo(config_from_args(args), args.json)
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("demo", help="emulated pool + probe + sidecar + replay, per policy")
    p.add_argument("--duration", type=float, default=30.0, help="trace seconds (default 30)")
    p.add_argument("--budget-seconds", type=float, default=20.0, help="probe budget per pod")
    p.add_argument(
        "--trace",
        choices=TRACES,
        default="azure",
        help="azure (default: four boards, placed by the split search, no prefix caching) or "
        "mooncake (2 + 2 pods, prefix caching, every sidecar with its prefix index)",
    )
    p.add_argument(
        "--policies",
        help=f"comma-separated (default {','.join(POLICIES)}; "
        f"with --trace mooncake {','.join(MOONCAKE_POLICIES)})",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")
    p.set_defaults(func=_run)
