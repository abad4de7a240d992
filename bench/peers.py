"""Side by side with vLLM's own router: goodput on a heterogeneous pool, and each router's overhead.

Goodput
-------
A fixed pool of the demo's boards (`disaggpool.demo.design`, `DECODE_SPEEDS`): 1 prefill + 3 decode
emulator processes of Llama-3-8B on an A40, the decode boards at 1.0x, 0.55x and 1.25x speed,
timed by hidden true profiles, where the routers differ in where each request decodes. Or, with
`--pool placed`, the demo's four boards placed by its split search over every placement (the one
that carries the most traffic at round-robin's 0.85 point, 3 prefill + 1 decode on this trace; the
demo itself gives each role two boards), where they differ in which prefill pod takes each
prompt. Every pod calibrated by the probe (`disaggpool calibrate`), as the operator's Jobs do. The
demo's bursty
trace (Azure 2023 conversation lengths, Gamma CV 3 arrivals) at the rate where round-robin
attains 0.85 goodput in the simulator, `--duration` seconds of it, replayed by `disaggpool
loadgen` through (a) `disaggpool sidecar` with each of our policies, (b) `vllm-router` (PyPI,
pinned `VLLM_ROUTER`, installed by `prefix_emulated.vllm_router` into its own virtual
environment; skipped with a message when it cannot be) in its P/D mode with each of its
policies that apply here: round_robin, random, power_of_two, cache_aware. (kv_aware needs KV
events from prefix-caching pods, consistent_hash and sticky_least_loaded a session key; this
trace has neither: bench/prefix_emulated.py runs kv_aware on a Mooncake slice.) Every router
replays the same trace on the same pods, one after the other, the pods idle in between.
Per row: goodput with its 95% bootstrap interval over requests, TTFT and TPOT p50/p99, errors,
the requests each pod served (the pods' own `vllm:request_success_total`), and how many prompts
the decode pods prefilled themselves (the P/D decider's local path: the requests the prefill
pods did not serve).

Overhead
--------
One prefill and one decode emulator in one process with zero jitter (20x an A40, so the engine's
own time is small), the same request (a 15-word prompt, 2 output tokens, not streamed) sent one
at a time (a) as the two legs by the client itself (`benchutil.two_legs`), (b) through our front
door (`calibrated`), (c) through vllm-router (`round_robin`), in interleaved blocks so drift hits
all alike. Each router process on CPU 0, the emulators and this client on CPU 1 (where there are
two). Overhead = the router's percentile - the direct percentile, at p50 and p99. Then an
open-loop rate ladder (25 to 800 req/s, each rung one unrecorded second then at least 400
requests, each path in turn): a router's p99 overhead over the direct p99 at the same rate, and
the highest rung of its unbroken run under 5 ms without errors. The ladder stops where the direct
path itself saturates (its p99 over 50 ms, or an error): beyond, the client and emulators' one
core, not the router, would be measured.

Run: ``.venv/bin/python bench/peers.py [--quick] [--duration S] [--part goodput|overhead|all]
[--pool fixed|placed] [--json FILE]``; ``--quick`` (a 20 s trace, two policies each, 60 overhead
samples) takes about 6 minutes, the default about 22.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import yaml

import benchutil
from disaggpool import progress, promtext
from disaggpool.core.contracts import SLOClass
from disaggpool.core.hardware import builtin_profile
from disaggpool.core.stats import (
    bootstrap_paired_difference_interval,
    bootstrap_share_interval,
    percentile,
)
from disaggpool.demo.design import (
    DECODE_SPEEDS,
    DemoConfig,
    demo_trace,
    operating_rate,
    placed_pool,
    true_profiles,
)
from disaggpool.demo.run import serve_policy, start_calibrated_pool
from disaggpool.formats.profiles import save_profile
from disaggpool.formats.traces import TraceRequest
from disaggpool.loadgen import LoadReport, replay
from disaggpool.localpool.pods import wait_idle
from disaggpool.localpool.processes import free_port, processes, wait_http
from disaggpool.sim.placement import describe
from prefix_emulated import VLLM_ROUTER, start_vllm_router, vllm_router

OURS = ("calibrated", "least_loaded", "length", "round_robin")
THEIRS = ("round_robin", "random", "power_of_two", "cache_aware")
QUICK_OURS = ("calibrated", "round_robin")
QUICK_THEIRS = ("round_robin", "cache_aware")
OVERHEAD_POLICY = {"disaggpool": "calibrated", "vllm-router": "round_robin"}
RATES = (25, 50, 100, 200, 400, 800)  # req/s, the open-loop ladder of the overhead part
LADDER_SAMPLES = 400  # requests per rung at least, so its p99 rests on four
HARNESS_LIMIT_S = 0.05  # a direct p99 above this: the client's own core is saturated
MODEL = "bench/model"
T = TypeVar("T")
A40 = builtin_profile("a40-llama3-8b")
CPUS = ("0", "1") if (os.cpu_count() or 1) >= 2 else ("", "")  # routers, everything else


def _successes(url: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    name = "vllm:request_success_total"
    return promtext.total(promtext.parse(text, [name]), name)


def _row(
    router: str,
    policy: str,
    report: LoadReport,
    served: dict[str, int],
    decode: Sequence[str],
    prefilled_here: int,
    seed: int,
) -> dict[str, Any]:
    """One router and policy's JSON row; `served`: requests per pod, `decode` the decode pods."""
    met = [report.met(r) for r in report.results]
    summary = report.summary()
    return {
        "router": router,
        "policy": policy,
        "requests": summary["requests"],
        "goodput": round(summary["goodput"], 4),
        "goodput_ci": [round(x, 4) for x in bootstrap_share_interval(met, seed)],
        **{key: round(summary[key], 4) for key in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s")},
        "tpot_p99_s": round(summary["tpot_p99_s"], 4),
        "errors": summary["errors"],
        "served_by_pod": {n: v for n, v in served.items() if n in decode},
        "served_by_prefill_pod": {n: v for n, v in served.items() if n not in decode},
        "prefilled_by_decode_pods": prefilled_here,
        "overhead_p50_ms": None,
        "overhead_p99_ms": None,
        "sustained_rps": None,
    }


def measure_goodput(
    cfg: DemoConfig, ours: Sequence[str], theirs: Sequence[str], router: Path | None
) -> dict[str, Any]:
    """The goodput part on `cfg`'s fixed pool, or on the pool its placement search chooses."""
    base, slo = demo_trace(cfg.seed, cfg.trace)
    if cfg.prefill_speeds is not None and cfg.decode_speeds is not None:
        pods = true_profiles(cfg.decode_speeds, cfg.prefill_speeds)
        rate, trace = operating_rate(pods, base, slo, cfg.duration_s, cfg.seed)
        chosen = describe((cfg.prefill_speeds, cfg.decode_speeds))
    else:  # before any pod starts: the search has the machine's cores
        placed = placed_pool(cfg, base, slo)
        pods, rate, trace, chosen = placed.pods, placed.rate, placed.trace, placed.chosen
    rows = []
    with tempfile.TemporaryDirectory(prefix="dp-peers-") as tmp_name, processes() as procs:
        tmp = Path(tmp_name)
        urls, fitted = start_calibrated_pool(cfg, pods, tmp, procs)
        decode = [n for n, (role, _) in pods.items() if role == "decode"]
        members = {
            role: [{"name": n, "url": urls[n]} for n, (r, _) in pods.items() if r == role]
            for role in ("prefill", "decode")
        }
        runs = [("disaggpool", p) for p in ours]
        runs += [("vllm-router", p) for p in theirs] if router is not None else []
        met_by_run: list[list[bool]] = []
        for who, policy in runs:
            before = {n: _successes(u) for n, u in urls.items()}
            if who == "disaggpool":
                report, _ = serve_policy(tmp, urls, pods, policy, trace, slo, procs)
            else:
                assert router is not None
                report = _through_vllm_router(router, tmp, members, policy, trace, slo)
            wait_idle(list(urls.values()))
            served = {n: int(_successes(u) - before[n]) for n, u in urls.items()}
            by_prefill_pods = sum(v for n, v in served.items() if n not in decode)
            local = len(trace) - by_prefill_pods
            rows.append(_row(who, policy, report, served, decode, local, cfg.seed))
            met_by_run.append([report.met(r) for r in report.results])
    # The first row's goodput (ours, calibrated) minus each other's, request by request on the
    # same trace: what the runs share cancels, so this tells apart what overlapping intervals
    # cannot.
    for row, met in zip(rows, met_by_run, strict=True):
        paired = bootstrap_paired_difference_interval(met_by_run[0], met, cfg.seed)
        row["first_minus_this_ci"] = None if row is rows[0] else [round(x, 4) for x in paired]
    return {
        "pool": f"{chosen} A40 boards, Llama-3-8B, emulated",
        "rate_rps": round(rate, 3),
        "duration_s": cfg.duration_s,
        "requests": len(trace),
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s},
        "fitted_quality": {n: p.quality for n, p in fitted.items()},
        "rows": rows,
    }


def _through_vllm_router(
    router: Path,
    tmp: Path,
    members: dict[str, list[dict[str, str]]],
    policy: str,
    trace: Sequence[TraceRequest],
    slo: SLOClass,
) -> LoadReport:
    with processes() as procs:
        url = start_vllm_router(procs, tmp, router, members, policy)
        bar = progress.bar(total=len(trace), desc=f"vllm-router {policy:>13}", unit="req")
        report = asyncio.run(replay(url, trace, [slo], on_done=lambda _: bar.update(1)))
        bar.close()
    return report


def start_fast_pair(tmp: Path) -> tuple[subprocess.Popen[str], dict[str, str]]:
    """1 prefill + 1 decode emulator, zero jitter, 20x an A40, in one process on CPU 1."""
    code = f"""
import json, time
from disaggpool.core.hardware import builtin_profile
from disaggpool.emulator.config import EmulatorConfig
from disaggpool.emulator.harness import EmulatorThread
fast = builtin_profile("a40-llama3-8b").scaled(20.0)
urls = {{}}
for name in ("p0", "d0"):
    emu = EmulatorThread(EmulatorConfig(fast, port=0, side_channel_port=0, jitter=0.0,
                                        model="{MODEL}", side_channel_host="127.0.0.1")).start()
    urls[name] = emu.url
print(json.dumps(urls), flush=True)
time.sleep(3600)
"""
    cmd = [sys.executable, "-c", code]
    if CPUS[1]:
        cmd = ["taskset", "-c", CPUS[1], *cmd]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    urls: dict[str, str] = json.loads(proc.stdout.readline())
    (tmp / "profiles").mkdir(exist_ok=True)
    for name in urls:  # the router is told the truth: a perfect probe
        save_profile(A40.scaled(20.0, name=name), tmp / "profiles" / f"{name}.yaml")
    return proc, urls


def start_pair_sidecar(
    tmp: Path,
    urls: dict[str, str],
    procs: list[Any],
    command: Sequence[str] = (sys.executable, "-m", "disaggpool", "sidecar", "--config"),
    name: str = "sidecar",
    grpc_port: int = 0,
) -> str:
    """Our router (`calibrated`) in front of `start_fast_pair`'s pods, on CPU 0: `command`
    followed by its config file's path starts it; its gRPC server on `grpc_port` (0: any). Its
    URL."""
    port = free_port()
    config = {
        "policy": OVERHEAD_POLICY["disaggpool"],
        "model": MODEL,
        "listen": {"http": f"127.0.0.1:{port}", "grpc": f"127.0.0.1:{grpc_port}"},
        "slo_classes": [{"name": "chat", "ttft_s": 1.0, "tpot_s": 0.1}],
        "tokenizer": {"kind": "emulator"},
        "pool": {
            "static": {
                "prefill": [{"name": "p0", "url": urls["p0"]}],
                "decode": [{"name": "d0", "url": urls["d0"]}],
            }
        },
        "profiles": {"dir": str(tmp / "profiles")},
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    cmd = [*command, str(path)]
    if CPUS[0]:
        cmd = ["taskset", "-c", CPUS[0], *cmd]
    log = (tmp / f"{name}.log").open("wb")
    procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/health", procs[-1])
    time.sleep(1.5)  # the profiles read, a scrape done
    return url


def on_client_cpu(main: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """`asyncio.run(main())` with this process on the client's CPU (1), then on every CPU again."""
    if CPUS[1]:
        os.sched_setaffinity(0, {int(CPUS[1])})
    try:
        return asyncio.run(main())
    finally:
        if CPUS[1]:
            os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))


async def timed_request(
    session: aiohttp.ClientSession,
    targets: dict[str, str],
    pair: dict[str, str],
    body: dict[str, Any],
    who: str,
    request_id: str,
) -> float:
    """Seconds for `body` through router `who` of `targets`, or as the two legs straight to
    `pair` when `who` is ``"direct"`` (not streamed); an answer other than 200 raises."""
    t0 = time.perf_counter()
    if who == "direct":
        direct = {**body, "stream": False}
        await benchutil.two_legs(session, pair["p0"], pair["d0"], direct, request_id)
    else:
        async with session.post(f"{targets[who]}/v1/completions", json=body) as r:
            assert r.status == 200, (who, r.status)
            await r.read()
    return time.perf_counter() - t0


def interleaved_latencies(
    targets: dict[str, str], pair: dict[str, str], body: dict[str, Any], n: int, desc: str
) -> dict[str, list[float]]:
    """Seconds per request of `body`, sent one at a time from CPU 1: as the two legs straight to
    `pair` (`"direct"`, not streamed) and through each of `targets` (name -> URL); 20 warm-up
    requests each (connections, the routers' first scrape), then `n` each in 10 interleaved
    blocks, so drift hits every path alike."""

    async def one(session: aiohttp.ClientSession, who: str, i: int) -> float:
        return await timed_request(session, targets, pair, body, who, f"direct-{i}")

    async def run() -> dict[str, list[float]]:
        times: dict[str, list[float]] = {who: [] for who in ("direct", *targets)}
        async with aiohttp.ClientSession() as session:
            for who in times:
                for i in range(20):
                    await one(session, who, i)
            for block in progress.bar(range(10), desc=desc, unit="block"):
                for who in times:
                    for i in range(n // 10):
                        times[who].append(await one(session, who, block * n + i))
        return times

    return on_client_cpu(run)


def measure_overhead(n: int, rate_seconds: float, router: Path | None) -> dict[str, dict[str, Any]]:
    """Latency percentiles (ms) of the same request sent one at a time, directly and through
    each router, and each router's climb up the rate ladder (`_rate_ladder`)."""
    body = {
        "model": MODEL,
        "prompt": "one two three four five six seven eight nine ten eleven twelve thirteen "
        "fourteen fifteen",
        "max_tokens": 2,
    }
    with tempfile.TemporaryDirectory(prefix="dp-overhead-") as tmp_name, processes() as procs:
        tmp = Path(tmp_name)
        emulators, urls = start_fast_pair(tmp)
        procs.append(emulators)
        targets = {"disaggpool": start_pair_sidecar(tmp, urls, procs)}
        if router is not None:
            members = {"prefill": [{"url": urls["p0"]}], "decode": [{"url": urls["d0"]}]}
            targets["vllm-router"] = start_vllm_router(
                procs, tmp, router, members, OVERHEAD_POLICY["vllm-router"], cpu=CPUS[0]
            )
        times = interleaved_latencies(targets, urls, body, n, "overhead")
        ladder = _rate_ladder(targets, urls, body, rate_seconds)
    out: dict[str, dict[str, Any]] = {}
    for who, values in times.items():
        out[who] = {
            "p50_ms": statistics.median(values) * 1000,
            "p99_ms": percentile(values, 99) * 1000,
        }
    for who in targets:
        steps = [{"rps": rate, **ladder[rate][who]} for rate in RATES if rate in ladder]
        out[who]["rate_ladder"] = steps
        passed = [s["rps"] for s in steps if s["errors"] == 0 and s["overhead_p99_ms"] < 5.0]
        # The highest rate of the ladder's unbroken run from its foot.
        ok = [r for i, r in enumerate(RATES) if all(x in passed for x in RATES[: i + 1])]
        out[who]["sustained_rps"] = ok[-1] if ok else 0
    return out


def _rate_ladder(
    targets: dict[str, str], pair: dict[str, str], body: dict[str, Any], seconds: float
) -> dict[int, dict[str, dict[str, float]]]:
    """At each rate of `RATES`, `seconds` of requests at that constant rate (open loop: sent on
    time whether or not earlier ones have answered) to each path in turn, direct first; per
    router its p99 overhead over the direct p99 at the same rate, and its errors."""

    async def one(session: aiohttp.ClientSession, who: str, i: int) -> float | None:
        try:
            return await timed_request(session, targets, pair, body, who, f"rate-{i}")
        except (TimeoutError, aiohttp.ClientError, AssertionError):
            return None  # counted as an error of that rung

    async def at_rate(session: aiohttp.ClientSession, who: str, rate: int) -> list[float | None]:
        # One second at the rate first, not recorded: the connections a rate needs are opened
        # then, not inside the measured window. Then enough requests for a p99 of 400 or more.
        count = rate + max(LADDER_SAMPLES, int(rate * seconds))
        start = time.perf_counter()

        async def fire(i: int) -> float | None:
            await asyncio.sleep(max(0.0, start + i / rate - time.perf_counter()))
            return await one(session, who, i)

        return (await asyncio.gather(*(fire(i) for i in range(count))))[rate:]

    async def run() -> dict[int, dict[str, dict[str, float]]]:
        out: dict[int, dict[str, dict[str, float]]] = {}
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            for rate in progress.bar(RATES, desc="rate ladder", unit="rate"):
                direct_run = await at_rate(session, "direct", rate)
                direct = [t for t in direct_run if t is not None]
                base = percentile(direct, 99)
                if len(direct) < len(direct_run) or base > HARNESS_LIMIT_S:
                    # The client and the emulators (one core) cannot carry this rate themselves:
                    # what a router would add is not measurable here.
                    print(f"rate ladder stops at {rate} req/s: the direct path saturates")
                    break
                got = {who: await at_rate(session, who, rate) for who in targets}
                out[rate] = {}
                for who in targets:
                    ok = [t for t in got[who] if t is not None]
                    out[rate][who] = {
                        "p99_ms": round(percentile(ok, 99) * 1000, 3),
                        "direct_p99_ms": round(base * 1000, 3),
                        "overhead_p99_ms": round((percentile(ok, 99) - base) * 1000, 3),
                        "errors": len(got[who]) - len(ok),
                    }
        return out

    return on_client_cpu(run)


def measure(
    quick: bool,
    duration_s: float | None,
    seed: int,
    peers: bool,
    part: str = "all",
    pool: str = "fixed",
) -> dict[str, Any]:
    router = vllm_router() if peers else None
    doc: dict[str, Any] = {"vllm_router": VLLM_ROUTER if router is not None else None, "rows": []}
    if part in ("goodput", "all"):
        duration = duration_s or (20.0 if quick else 90.0)
        if pool == "fixed":
            cfg = DemoConfig(
                duration, seed=seed, prefill_speeds=(1.0,), decode_speeds=DECODE_SPEEDS
            )
        else:  # the demo's boards, placed by its split search over every placement
            cfg = DemoConfig(duration, seed=seed, min_pods_per_role=1)
        ours, theirs = (QUICK_OURS, QUICK_THEIRS) if quick else (OURS, THEIRS)
        doc["goodput"] = measure_goodput(cfg, ours, theirs, router)
        doc["rows"] = doc["goodput"]["rows"]
    if part in ("overhead", "all"):
        latency = measure_overhead(60 if quick else 300, 2.0 if quick else 5.0, router)
        doc["latency_ms"] = latency
        direct = latency["direct"]
        for row in doc["rows"]:
            if row["policy"] == OVERHEAD_POLICY[row["router"]] and row["router"] in latency:
                mine = latency[row["router"]]
                row["overhead_p50_ms"] = round(mine["p50_ms"] - direct["p50_ms"], 3)
                row["overhead_p99_ms"] = round(mine["p99_ms"] - direct["p99_ms"], 3)
                row["sustained_rps"] = mine["sustained_rps"]
    return doc


def _points(ci: Sequence[float] | None) -> str:
    """A difference of goodputs' interval in points, e.g. "+0.4 to +3.1"; "" for none."""
    return f"{100 * ci[0]:+.1f} to {100 * ci[1]:+.1f}" if ci else ""


def render(doc: dict[str, Any]) -> str:
    res = doc["peers"]
    g = res.get("goodput")
    rows = [
        {
            **r,
            "95% interval": f"{r['goodput_ci'][0]:.3f}-{r['goodput_ci'][1]:.3f}",
            "TTFT p50/p99 s": f"{r['ttft_p50_s']:.3f} / {r['ttft_p99_s']:.3f}",
            "TPOT p50/p99 ms": f"{r['tpot_p50_s'] * 1000:.1f} / {r['tpot_p99_s'] * 1000:.1f}",
            "requests per decode pod": " / ".join(str(v) for v in r["served_by_pod"].values()),
            "prompts per prefill pod": " / ".join(
                str(v) for v in r.get("served_by_prefill_pod", {}).values()
            ),
            "first minus this (paired 95%)": _points(r.get("first_minus_this_ci")),
            "prefilled on decode pods": r.get("prefilled_by_decode_pods", ""),
            "overhead p50/p99 ms": (
                f"{r['overhead_p50_ms']:.2f} / {r['overhead_p99_ms']:.2f}"
                if r["overhead_p50_ms"] is not None
                else ""
            ),
        }
        for r in res["rows"]
    ]
    cols = ["router", "policy", "goodput", "95% interval", "first minus this (paired 95%)",
            "TTFT p50/p99 s", "TPOT p50/p99 ms", "errors", "requests per decode pod",
            "prompts per prefill pod", "prefilled on decode pods",
            "overhead p50/p99 ms"]  # fmt: skip
    out = ""
    if g:
        out += (
            f"### Goodput ({g['pool']}; {g['requests']} requests at {g['rate_rps']} req/s over "
            f"{g['duration_s']:.0f} s; SLO TTFT {g['slo']['ttft_s']:.2f} s, TPOT "
            f"{g['slo']['tpot_s'] * 1000:.0f} ms; vllm-router {res['vllm_router']})\n\n"
            + benchutil.md_table(rows, cols)
        )
    if "latency_ms" in res:
        lat = res["latency_ms"]
        paths = [
            {"path": who, "p50_ms": v["p50_ms"], "p99_ms": v["p99_ms"]} for who, v in lat.items()
        ]
        ladder = [
            {"router": who, **step, "sustained": v["sustained_rps"]}
            for who, v in lat.items()
            if who != "direct"
            for step in v["rate_ladder"]
        ]
        out += (
            "\n### The same request, one at a time, directly and through each router (ms)\n\n"
            + benchutil.md_table(paths, ["path", "p50_ms", "p99_ms"])
            + "\n### Open-loop rate ladder: p99 overhead over the direct p99 at the same rate\n\n"
            + benchutil.md_table(
                ladder, ["router", "rps", "p99_ms", "direct_p99_ms", "overhead_p99_ms", "errors"]
            )
            + "".join(
                f"\n{who}: sustains {v['sustained_rps']} req/s with p99 overhead under 5 ms\n"
                for who, v in lat.items()
                if who != "direct"
            )
        )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a 20 s trace, two policies each")
    ap.add_argument("--duration", type=float, help="seconds of trace (default 90; quick 20)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-peers", action="store_true", help="leave vllm-router out")
    ap.add_argument("--part", choices=("goodput", "overhead", "all"), default="all")
    ap.add_argument(
        "--pool",
        choices=("fixed", "placed"),
        default="fixed",
        help="goodput on 1 prefill + 3 decode (fixed) or on the demo's placed pool",
    )
    ap.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = ap.parse_args(argv)
    if args.duration is not None and args.duration <= 0:
        ap.error(f"--duration must be positive, got {args.duration}")
    peers = not args.no_peers
    benchutil.measure_and_report(
        lambda: {
            "peers": measure(args.quick, args.duration, args.seed, peers, args.part, args.pool)
        },
        render,
        args.json,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
