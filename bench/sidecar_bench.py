"""The routing sidecar's hot path: decision latency, gRPC Route throughput, front-door overhead.

Three measurements, each against a baseline measured in the same run:

* ``decision``: in-process ``RoutingService.route`` + ``finished`` (snapshot of the live state,
  output-length prediction, the policy, the in-flight booking: everything a request costs the
  router) for 4 prefill and 8, 32 or 128 decode pods, each with a trusted profile and 0-40
  requests in flight; p50 and p99 per policy and calibrated / round_robin.
* ``grpc``: a sidecar *process* (``disaggpool sidecar``, pinned to CPU 0 where there are two)
  in front of 1 prefill + 8 decode emulators; from this process (pinned to CPU 1) a closed loop
  of 64 concurrent ``Route`` + ``Report(FINISHED)`` pairs for 8 s gives the throughput of one
  sidecar core, then an open loop for 8 s gives the latency at a rate it can serve: 1,000
  routes/s, or 70% of the first sidecar's closed-loop throughput where that is less.
  Both for calibrated and round_robin, and calibrated again with a gRPC token required
  (``grpc.token_file``, every call carrying it): the cost of authentication, as a ratio.
* ``frontdoor``: the same request (a 16-token prompt, 2 output tokens, not streamed) 300 times
  in sequence, (a) through the front door and (b) as the two legs sent directly by the client
  (prefill leg, then the decode leg with its ``kv_transfer_params``); the overhead is the
  difference of the medians. The emulators run with zero jitter and require an API key (vLLM's
  ``--api-key``), which every path sends: directly, through a front door without keys of its
  own (the client's key is passed on), and through one with keys (``auth.api_keys_file``: the
  client's key checked, the pods' own sent upstream).

Usage: ``python bench/sidecar_bench.py [--part decision|grpc|frontdoor|all] [--quick]
[--json FILE]``. Figures go to BENCHMARKS.md by hand, with the command and the machine line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import yaml

from benchutil import md_table, measure_and_report, two_legs
from disaggpool.core.hardware import builtin_profile
from disaggpool.emulator.config import EmulatorConfig
from disaggpool.emulator.harness import EmulatorThread
from disaggpool.formats.profiles import save_profile
from disaggpool.router.v1 import router_pb2 as pb
from disaggpool.router.v1 import router_pb2_grpc as pb_grpc
from disaggpool.sidecar.config import parse_config
from disaggpool.sidecar.service import RoutingService
from disaggpool.sidecar.state import Gauges
from disaggpool.sim.pools import build_pool

A40 = builtin_profile("a40-llama3-8b")
MODEL = "bench/model"
SLO = [
    {"name": "chat", "ttft_s": 1.5, "tpot_s": 0.07},
    {"name": "code", "ttft_s": 1.0, "tpot_s": 0.1},
]


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


# ----------------------------------------------------------------------------- in-process
def _service(policy: str, n_decode: int, seed: int) -> RoutingService:
    specs = build_pool(4, n_decode, A40, seed=1)
    static = {
        role: [{"name": s.name, "url": f"http://{s.name}:8000"} for s in specs if s.role == role]
        for role in ("prefill", "decode")
    }
    doc = {"policy": policy, "model": MODEL, "slo_classes": SLO, "max_inflight": 100_000}
    cfg = parse_config({**doc, "pool": {"static": static}})
    svc = RoutingService(cfg, seed=seed, clock=lambda: 0.0)
    svc.state.set_members(cfg.static_members)
    rng = random.Random(seed)
    for s in specs:
        svc.state.set_profile(s.name, s.believed_profile, 0.0)
        svc.state.scraped(
            s.name,
            Gauges(
                rng.randint(0, 40), rng.randint(0, 3), rng.random() * 0.6, A40.kv_capacity_tokens
            ),
            0.0,
        )
    for i in range(n_decode * 20):  # background requests in flight
        svc.route(f"bg{i}", rng.randint(50, 3000), rng.choice(["chat", "code"]))
        if rng.random() < 0.7:
            svc.progress(f"bg{i}", rng.randint(1, 200))
    return svc


def bench_decision(quick: bool) -> list[dict[str, Any]]:
    rows = []
    for n_decode in (8, 32, 128):
        calls = {8: 20_000, 32: 5_000, 128: 2_000}[n_decode] // (10 if quick else 1)
        row: dict[str, Any] = {"decode pods": n_decode}
        for policy in ("round_robin", "least_loaded", "calibrated"):
            svc = _service(policy, n_decode, seed=n_decode)
            rng = random.Random(7)
            lengths = [(rng.randint(20, 4000), rng.randint(1, 400)) for _ in range(256)]
            times = []
            for i in range(calls + 200):
                prompt, out = lengths[i % 256]
                t0 = time.perf_counter_ns()
                svc.route(f"r{i}", prompt, "chat" if i % 3 else "code")
                svc.finished(f"r{i}", out, 0.5, 0.05)
                if i >= 200:
                    times.append((time.perf_counter_ns() - t0) / 1000)
            row[f"{policy} p50 µs"] = statistics.median(times)
            row[f"{policy} p99 µs"] = _pct(times, 99)
        row["calibrated / round_robin (p50)"] = row["calibrated p50 µs"] / row["round_robin p50 µs"]
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------- a real pool
def _emulator_process(n_decode: int, tmp: Path) -> tuple[subprocess.Popen[str], dict[str, str]]:
    """1 prefill + n decode emulators in one helper process; returns it and name -> URL."""
    code = f"""
import sys, time, json
from disaggpool.core.hardware import builtin_profile
from disaggpool.emulator.config import EmulatorConfig
from disaggpool.emulator.harness import EmulatorThread
fast = builtin_profile("a40-llama3-8b").scaled(20.0)
urls = {{}}
for name in ["p0"] + [f"d{{i}}" for i in range({n_decode})]:
    emu = EmulatorThread(EmulatorConfig(fast, port=0, side_channel_port=0, jitter=0.0,
                                        model="{MODEL}", side_channel_host="127.0.0.1")).start()
    urls[name] = emu.url
print(json.dumps(urls), flush=True)
time.sleep(3600)
"""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    urls = json.loads(proc.stdout.readline())
    for name in urls:
        save_profile(A40.scaled(20.0, name=name), tmp / "profiles" / f"{name}.yaml")
    return proc, urls


POD_KEY, CLIENT_KEY, GRPC_TOKEN = "pod-key", "client-key", "grpc-token"
OPEN_LOOP_RATE = 1000.0  # routes/s, where the server can take it


def _sidecar_process(  # type: ignore[no-untyped-def]
    policy: str, urls: dict[str, str], tmp: Path, port: int, gport: int, token: bool = False
):
    cfg: dict[str, Any] = {
        "policy": policy,
        "model": MODEL,
        "slo_classes": SLO,
        "scrape_interval_s": 1.0,
        "max_inflight": 100_000,
        "tokenizer": {"kind": "emulator"},
        "listen": {"http": f"127.0.0.1:{port}", "grpc": f"127.0.0.1:{gport}"},
        "pool": {
            "static": {
                "prefill": [{"name": "p0", "url": urls["p0"]}],
                "decode": [{"name": n, "url": u} for n, u in urls.items() if n != "p0"],
            }
        },
        "profiles": {"dir": str(tmp / "profiles")},
    }
    cfg["grpc"] = {"max_inflight": 100_000}  # the load, not the admission limits, is measured
    if token:
        (tmp / "grpc-token").write_text(GRPC_TOKEN)
        cfg["grpc"]["token_file"] = str(tmp / "grpc-token")
    path = tmp / f"sidecar-{policy}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "disaggpool", "sidecar", "--config", str(path)]
    if (os.cpu_count() or 1) >= 2:
        cmd = ["taskset", "-c", "0", *cmd]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).status == 200:
                time.sleep(1.5)  # profiles loaded
                return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("sidecar did not start")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def grpc_load(
    target: str, seconds: float, rate: float | None, token: str = ""
) -> dict[str, float]:
    """Closed loop (rate None, 64 workers) or open loop at `rate` routes/s; every call carries
    `token` when given."""
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.RouterStub(channel)
        lat: list[float] = []
        counter = iter(range(10**9))
        end = time.perf_counter() + seconds

        async def one() -> None:
            rid = f"q{next(counter)}"
            t0 = time.perf_counter()
            route = pb.RouteRequest(request_id=rid, prompt_tokens=700, slo_class="chat")
            await stub.Route(route, metadata=metadata)
            lat.append(time.perf_counter() - t0)
            await stub.Report(
                pb.ReportRequest(
                    request_id=rid,
                    stage=pb.STAGE_FINISHED,
                    output_tokens=100,
                    ttft_s=0.3,
                    tpot_s=0.03,
                ),
                metadata=metadata,
            )

        started = time.perf_counter()
        if rate is None:

            async def worker() -> None:
                while time.perf_counter() < end:
                    await one()

            await asyncio.gather(*(worker() for _ in range(64)))
        else:
            tasks = []
            t = started
            while t < end:
                await asyncio.sleep(max(0.0, t - time.perf_counter()))
                tasks.append(asyncio.ensure_future(one()))
                t += 1.0 / rate
            await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - started
    return {
        "routes_per_s": len(lat) / elapsed,
        "p50_ms": statistics.median(lat) * 1000,
        "p99_ms": _pct(lat, 99) * 1000,
    }


def bench_grpc(quick: bool) -> list[dict[str, Any]]:
    seconds = 3.0 if quick else 8.0
    if (os.cpu_count() or 1) >= 2:
        os.sched_setaffinity(0, {1})
    rows = []
    rate = 0.0  # the open loop's, below what the first sidecar serves closed-loop
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        (tmp / "profiles").mkdir()
        emus, urls = _emulator_process(8, tmp)
        try:
            for policy, token in (
                ("round_robin", ""), ("calibrated", ""), ("calibrated", GRPC_TOKEN)
            ):  # fmt: skip
                port, gport = _free_port(), _free_port()
                sidecar = _sidecar_process(policy, urls, tmp, port, gport, bool(token))
                target = f"127.0.0.1:{gport}"
                try:
                    closed = asyncio.run(grpc_load(target, seconds, None, token))
                    # An open loop beyond what the server can do measures only its backlog
                    # (and ends in cancelled calls): at most 1,000/s, at most 70% of capacity.
                    rate = rate or min(OPEN_LOOP_RATE, 0.7 * closed["routes_per_s"])
                    open_ = asyncio.run(grpc_load(target, seconds, rate, token))
                finally:
                    sidecar.terminate()
                    sidecar.wait(10)
                rows.append(
                    {
                        "policy": policy + (", token" if token else ""),
                        "closed-loop routes/s (64 in flight)": closed["routes_per_s"],
                        "closed-loop p99 ms": closed["p99_ms"],
                        "open loop: rate /s": rate,
                        "open loop: achieved": open_["routes_per_s"],
                        "open loop: p50 ms": open_["p50_ms"],
                        "open loop: p99 ms": open_["p99_ms"],
                    }
                )
        finally:
            emus.kill()
    base = rows[0]["closed-loop routes/s (64 in flight)"]
    for r in rows:
        r["throughput / round_robin"] = r["closed-loop routes/s (64 in flight)"] / base
    calibrated = rows[1]["closed-loop routes/s (64 in flight)"]
    rows[2]["throughput / round_robin"] = rows[2]["closed-loop routes/s (64 in flight)"] / base
    rows[2]["token / no token"] = rows[2]["closed-loop routes/s (64 in flight)"] / calibrated
    rows[0]["token / no token"] = rows[1]["token / no token"] = None
    return rows


async def _timed_requests(session: aiohttp.ClientSession, send: Any, n: int) -> list[float]:
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        await send(session, i)
        out.append(time.perf_counter() - t0)
    return out


def bench_frontdoor(quick: bool) -> list[dict[str, Any]]:
    from disaggpool.sidecar.harness import SidecarThread

    n = 60 if quick else 300
    fast = A40.scaled(20.0)
    cfgs = [
        EmulatorConfig(
            fast,
            port=0,
            side_channel_port=0,
            jitter=0.0,
            model=MODEL,
            side_channel_host="127.0.0.1",
            api_keys=(POD_KEY,),
        )
        for _ in range(2)
    ]
    with (
        EmulatorThread(cfgs[0]) as p,
        EmulatorThread(cfgs[1]) as d,
        tempfile.TemporaryDirectory() as t,
    ):
        for name in ("p0", "d0"):
            save_profile(fast, Path(t) / f"{name}.yaml")
        (Path(t) / "client-keys").write_text(CLIENT_KEY)
        (Path(t) / "pod-key").write_text(POD_KEY)
        keyed = {
            "auth": {
                "api_keys_file": str(Path(t) / "client-keys"),
                "upstream_api_key_file": str(Path(t) / "pod-key"),
            }
        }
        doc: dict[str, Any] = {
            "policy": "calibrated",
            "model": MODEL,
            "slo_classes": SLO,
            "listen": {"http": "127.0.0.1:0", "grpc": "127.0.0.1:0"},
            "tokenizer": {"kind": "emulator"},
            "profiles": {"dir": t},
            "pool": {
                "static": {
                    "prefill": [{"name": "p0", "url": p.url}],
                    "decode": [{"name": "d0", "url": d.url}],
                }
            },
        }
        cfg, cfg_keyed = parse_config(doc), parse_config({**doc, **keyed})
        body = {
            "model": MODEL,
            "prompt": "one two three four five six seven eight nine ten "
            "eleven twelve thirteen fourteen fifteen",
            "max_tokens": 2,
        }

        async def direct(session: aiohttp.ClientSession, i: int) -> None:
            await two_legs(session, p.url, d.url, body, f"direct-{i}", POD_KEY)

        with SidecarThread(cfg) as plain, SidecarThread(cfg_keyed) as keyed_sc:

            def through(url: str, key: str) -> Any:
                headers = {"Authorization": f"Bearer {key}"}

                async def send(session: aiohttp.ClientSession, i: int) -> None:
                    async with session.post(
                        f"{url}/v1/completions", json=body, headers=headers
                    ) as r:
                        assert r.status == 200, r.status
                        await r.read()

                return send

            paths = {
                "two legs sent directly": direct,
                "through the front door (no keys of its own)": through(plain.url, POD_KEY),
                "through the front door with API keys": through(keyed_sc.url, CLIENT_KEY),
            }

            async def run() -> dict[str, list[float]]:
                out: dict[str, list[float]] = {name: [] for name in paths}
                async with aiohttp.ClientSession() as s:
                    for send in paths.values():
                        await _timed_requests(s, send, 20)  # warm-up
                    for _ in range(5):  # interleaved blocks: drift hits every path alike
                        for name, send in paths.items():
                            out[name] += await _timed_requests(s, send, n // 5)
                return out

            times = asyncio.run(run())
    d50 = statistics.median(times["two legs sent directly"]) * 1000
    f50 = statistics.median(times["through the front door (no keys of its own)"]) * 1000
    rows = []
    for name, t in times.items():
        p50 = statistics.median(t) * 1000
        rows.append(
            {
                "path": name,
                "p50 ms": p50,
                "p99 ms": _pct(t, 99) * 1000,
                "overhead p50 ms": p50 - d50,
                "x direct (p50)": p50 / d50,
                "x front door without keys (p50)": p50 / f50,
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=("decision", "grpc", "frontdoor", "all"), default="all")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()

    def run() -> dict[str, Any]:
        doc: dict[str, Any] = {}
        if args.part in ("decision", "all"):
            doc["decision"] = bench_decision(args.quick)
        if args.part in ("frontdoor", "all"):
            doc["frontdoor"] = bench_frontdoor(args.quick)
        if args.part in ("grpc", "all"):
            doc["grpc"] = bench_grpc(args.quick)
        return doc

    def render(doc: dict[str, Any]) -> str:
        parts = []
        for key, title in (
            ("decision", "In-process decision (route + finished), µs"),
            ("grpc", "gRPC Route on loopback (sidecar on one core)"),
            ("frontdoor", "Front door vs the two legs sent directly"),
        ):
            if key in doc:
                parts.append(f"### {title}\n\n" + md_table(doc[key], list(doc[key][0])))
        return "\n\n".join(parts)

    measure_and_report(run, render, args.json)


if __name__ == "__main__":
    main()
