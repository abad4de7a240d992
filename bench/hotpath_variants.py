"""Would uvloop or orjson make the front door or the gRPC router faster? The sidecar under each.

vLLM's own server runs on uvloop and vllm-router's Python side uses orjson; the sidecar runs on
uvloop (since this bench's gRPC part) and the standard `json`. Here the same sidecar (`calibrated`,
1 prefill + 1 decode emulator with zero jitter, 20x an A40, as in bench/peers.py) runs four times
side by side: on asyncio's loop (uvloop hidden from it) or uvloop, with the standard `json` or with
`json.loads`/`json.dumps` answered by orjson (so aiohttp's bodies and the front door's own parsing
of every answer and stream event go through it). Two request shapes, sent one at a time in
interleaved blocks: a 15-word prompt with 2 output tokens not streamed, and the same prompt with 64
output tokens streamed (a JSON event per token). Reported: p50/p99 latency and the p50 overhead over
the two legs sent directly by the client. Each sidecar on CPU 0, the emulators and this client on
CPU 1.

gRPC (``--part grpc``): the same sidecar on asyncio's loop and on uvloop (gRPC carries protobuf,
so the JSON library cannot matter there), driven by `sidecar_bench.grpc_load` from CPU 1: a
`Route` plus a `Report(FINISHED)` per routed request, 64 in flight (closed loop), then 1,000
routes/s (open loop); `--rounds` rounds of `--seconds` each, alternating the two sidecars, and
the median over rounds reported.

Needs uvloop (a dependency) and orjson (not one: ``.venv/bin/pip install orjson``) in the
environment; says so and exits 0 without them.

Run: ``.venv/bin/python bench/hotpath_variants.py [--part frontdoor|grpc|all] [--requests N]
[--rounds R] [--seconds S] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import benchutil
from disaggpool import progress
from disaggpool.core.stats import percentile
from disaggpool.localpool.processes import free_port, processes
from peers import MODEL, interleaved_latencies, on_client_cpu, start_fast_pair, start_pair_sidecar
from sidecar_bench import grpc_load

VARIANTS = ("asyncio + json", "uvloop + json", "asyncio + orjson", "uvloop + orjson")
# Runs the sidecar with the variant's loop and JSON library; argv: variant, config path.
LAUNCHER = """
import json, sys
variant, config = sys.argv[1], sys.argv[2]
if "orjson" in variant:
    import orjson
    std_dumps, std_loads = json.dumps, json.loads
    def dumps(obj, **kw):  # orjson takes no options: those calls keep the standard library
        return std_dumps(obj, **kw) if kw else orjson.dumps(obj).decode()
    def loads(text, **kw):
        return std_loads(text, **kw) if kw else orjson.loads(text)
    json.dumps, json.loads = dumps, loads  # before aiohttp binds json.dumps as its default
if "uvloop" not in variant:
    sys.modules["uvloop"] = None  # the sidecar runs on uvloop when it imports: not here
from disaggpool.cli import main
sys.exit(main(["sidecar", "--config", config]))
"""
PROMPT = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen"
SHAPES = {
    "2 tokens, not streamed": {"max_tokens": 2},
    "64 tokens, streamed": {"max_tokens": 64, "stream": True},
}


def measure(n: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="dp-hotpath-") as tmp_name, processes() as procs:
        tmp = Path(tmp_name)
        emulators, urls = start_fast_pair(tmp)
        procs.append(emulators)
        targets = {
            v: start_pair_sidecar(
                tmp, urls, procs, (sys.executable, "-c", LAUNCHER, v), f"sidecar-{i}"
            )
            for i, v in enumerate(VARIANTS)
        }
        for shape, extra in SHAPES.items():
            body = {"model": MODEL, "prompt": PROMPT, "ignore_eos": True, **extra}
            times = interleaved_latencies(targets, urls, body, n, shape)
            base = statistics.median(times["direct"])
            out[shape] = [
                {
                    "path": who,
                    "p50_ms": statistics.median(v) * 1000,
                    "p99_ms": percentile(v, 99) * 1000,
                    "overhead_p50_ms": (statistics.median(v) - base) * 1000,
                }
                for who, v in times.items()
            ]
    return {"requests_per_path": n, "shapes": out}


def measure_grpc(rounds: int, seconds: float) -> dict[str, Any]:
    loops = [v for v in VARIANTS if v.endswith("+ json")]  # protobuf on the wire: loops only
    runs: dict[str, dict[str, list[dict[str, float]]]] = {
        v: {"closed": [], "open": []} for v in loops
    }
    with tempfile.TemporaryDirectory(prefix="dp-hotpath-") as tmp_name, processes() as procs:
        tmp = Path(tmp_name)
        emulators, urls = start_fast_pair(tmp)
        procs.append(emulators)
        targets = {}
        for i, v in enumerate(loops):
            port = free_port()
            start_pair_sidecar(
                tmp, urls, procs, (sys.executable, "-c", LAUNCHER, v), f"grpc-{i}", grpc_port=port
            )
            targets[v] = f"127.0.0.1:{port}"
        for _ in progress.bar(range(rounds), desc="gRPC rounds", unit="round"):
            for v, target in targets.items():
                for mode, rate in (("closed", None), ("open", 1000.0)):
                    run = on_client_cpu(lambda t=target, r=rate: grpc_load(t, seconds, r))
                    runs[v][mode].append(run)
    med = statistics.median
    rows = [
        {
            "loop": v.split(" + ")[0],
            "closed_routes_per_s": med(r["routes_per_s"] for r in runs[v]["closed"]),
            "closed_rounds_min_max": "{:,.0f}-{:,.0f}".format(
                min(r["routes_per_s"] for r in runs[v]["closed"]),
                max(r["routes_per_s"] for r in runs[v]["closed"]),
            ),
            "closed_p99_ms": med(r["p99_ms"] for r in runs[v]["closed"]),
            "open_achieved_per_s": med(r["routes_per_s"] for r in runs[v]["open"]),
            "open_p50_ms": med(r["p50_ms"] for r in runs[v]["open"]),
            "open_p50_rounds_min_max": "{:.2f}-{:.2f}".format(
                min(r["p50_ms"] for r in runs[v]["open"]), max(r["p50_ms"] for r in runs[v]["open"])
            ),
            "open_p99_ms": med(r["p99_ms"] for r in runs[v]["open"]),
        }
        for v in loops
    ]
    return {"rounds": rounds, "seconds": seconds, "rows": rows}


def render(doc: dict[str, Any]) -> str:
    out = ""
    res = doc.get("hotpath_variants")
    if res:
        cols = ["path", "p50_ms", "p99_ms", "overhead_p50_ms"]
        out += "".join(
            f"### {shape} ({res['requests_per_path']} requests per path)\n\n"
            + benchutil.md_table(rows, cols)
            + "\n"
            for shape, rows in res["shapes"].items()
        )
    grpc = doc.get("grpc")
    if grpc:
        cols = list(grpc["rows"][0])
        out += (
            f"### gRPC Route + Report (median of {grpc['rounds']} rounds of {grpc['seconds']} s)"
            "\n\n" + benchutil.md_table(grpc["rows"], cols) + "\n"
        )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("frontdoor", "grpc", "all"), default="all")
    ap.add_argument("--requests", type=int, default=400, help="per path and shape (400)")
    ap.add_argument("--rounds", type=int, default=5, help="gRPC rounds per loop (5)")
    ap.add_argument("--seconds", type=float, default=5.0, help="per gRPC load and round (5)")
    ap.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = ap.parse_args(argv)
    if args.requests < 10:
        ap.error(f"--requests must be at least 10, got {args.requests}")
    missing = [m for m in ("uvloop", "orjson") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"needs {' and '.join(missing)}: .venv/bin/pip install uvloop orjson")
        return 0
    if args.rounds < 1 or args.seconds <= 0:
        ap.error("--rounds must be at least 1 and --seconds positive")

    def run() -> dict[str, Any]:
        doc: dict[str, Any] = {}
        if args.part in ("frontdoor", "all"):
            doc["hotpath_variants"] = measure(args.requests)
        if args.part in ("grpc", "all"):
            doc["grpc"] = measure_grpc(args.rounds, args.seconds)
        return doc

    benchutil.measure_and_report(run, render, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
