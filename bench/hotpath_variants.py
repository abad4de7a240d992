"""Would uvloop or orjson make the front door faster? The sidecar's overhead under each.

vLLM's own server runs on uvloop and vllm-router's Python side uses orjson; the sidecar uses
neither (asyncio's loop, the standard `json`). Here the same sidecar (`calibrated`, 1 prefill + 1
decode emulator with zero jitter, 20x an A40, as in bench/peers.py) runs four times side by side:
on asyncio's loop or uvloop (`uvloop.install()` before it starts), with the standard `json` or
with `json.loads`/`json.dumps` answered by orjson (so aiohttp's bodies and the front door's own
parsing of every answer and stream event go through it). Two request shapes, sent one at a time
in interleaved blocks: a 15-word prompt with 2 output tokens not streamed, and the same prompt
with 64 output tokens streamed (a JSON event per token). Reported: p50/p99 latency and the p50
overhead over the two legs sent directly by the client. Each sidecar on CPU 0, the emulators and
this client on CPU 1.

Needs uvloop and orjson in the environment (``.venv/bin/pip install uvloop orjson``; not
dependencies of the project); says so and exits 0 without them.

Run: ``.venv/bin/python bench/hotpath_variants.py [--requests N] [--json FILE]``.
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
from disaggpool.core.stats import percentile
from disaggpool.demo import processes
from peers import MODEL, interleaved_latencies, start_fast_pair, start_pair_sidecar

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
if "uvloop" in variant:
    import uvloop
    uvloop.install()
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


def render(doc: dict[str, Any]) -> str:
    res = doc["hotpath_variants"]
    cols = ["path", "p50_ms", "p99_ms", "overhead_p50_ms"]
    return "".join(
        f"### {shape} ({res['requests_per_path']} requests per path)\n\n"
        + benchutil.md_table(rows, cols)
        + "\n"
        for shape, rows in res["shapes"].items()
    )


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=400, help="per path and shape (400)")
    ap.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = ap.parse_args(argv)
    if args.requests < 10:
        ap.error(f"--requests must be at least 10, got {args.requests}")
    missing = [m for m in ("uvloop", "orjson") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"needs {' and '.join(missing)}: .venv/bin/pip install uvloop orjson")
        return 0
    benchutil.measure_and_report(
        lambda: {"hotpath_variants": measure(args.requests)}, render, args.json
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
