"""How many concurrent streams one emulator process sustains on one core before its timing drifts.

An emulator is only a faithful stand-in while its own CPU cost stays small next to the engine
time it emulates. This starts one `disaggpool emulate` process pinned to CPU 0 (the client runs
in this process, pinned to CPU 1) with the A40 profile and no jitter, then for N = 8, 16, ... 256
concurrent streaming requests (prompt 256 tokens, 200 output tokens, ``ignore_eos``, started
together) measures each stream's time per output token (TPOT, after its first token) and compares
the median with what the engine model itself says for that batch: the mean step time
``decode.step(N, context)`` over the streams' decode, with the context growing from 257 to 456
tokens per stream. Drift = measured / modelled - 1; the answer is the largest N with |drift| <= 5%.

Usage: ``python bench/emulator_overhead.py [--json FILE] [--max-streams 256]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp

from benchutil import md_table, measure_and_report
from disaggpool.core.hardware import builtin_profile
from disaggpool.formats.profiles import save_profile

PROFILE = builtin_profile("a40-llama3-8b")
PROMPT, OUTPUT = 256, 200


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _modelled_tpot(n: int) -> float:
    steps = [PROFILE.decode.step(n, n * (PROMPT + 1 + k)) for k in range(OUTPUT - 1)]
    return statistics.fmean(steps)


async def _streams(url: str, n: int) -> list[float]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def one(i: int) -> float:
            body = {"prompt": list(range(3, 3 + PROMPT)), "max_tokens": OUTPUT,
                    "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}  # fmt: skip
            first = 0.0
            tokens = 0
            async with session.post(f"{url}/v1/completions", json=body) as resp:
                async for line in resp.content:
                    if line.startswith(b"data: {"):
                        event = json.loads(line[6:])
                        if event.get("usage"):
                            tokens = event["usage"]["completion_tokens"]
                        elif not first:
                            first = time.perf_counter()
            return (time.perf_counter() - first) / (tokens - 1)

        return list(await asyncio.gather(*(one(i) for i in range(n))))


def run(max_streams: int) -> dict[str, Any]:
    two_cores = (os.cpu_count() or 1) >= 2
    if two_cores:
        os.sched_setaffinity(0, {1})
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "a40.yaml"
        save_profile(PROFILE, path)
        port = _free_port()
        cmd = [sys.executable, "-m", "disaggpool", "emulate", "--profile", str(path),
               "--port", str(port), "--jitter", "0"]  # fmt: skip
        if two_cores:
            cmd = ["taskset", "-c", "0", *cmd]
        env = {**os.environ, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(_free_port())}
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        try:
            for _ in range(300):
                try:
                    urllib.request.urlopen(f"{url}/health", timeout=1)
                    break
                except OSError:
                    time.sleep(0.1)
            n = 8
            while n <= max_streams:
                tpots = asyncio.run(_streams(url, n))
                measured = statistics.median(tpots)
                modelled = _modelled_tpot(n)
                rows.append({
                    "streams": n, "modelled TPOT ms": modelled * 1000,
                    "measured TPOT ms (median)": measured * 1000,
                    "measured p90 ms": sorted(tpots)[int(0.9 * (n - 1))] * 1000,
                    "drift": measured / modelled - 1.0,
                    "tokens/s served": n / measured,
                })  # fmt: skip
                n *= 2
        finally:
            proc.terminate()
            proc.wait(10)
    ok = [r["streams"] for r in rows if abs(r["drift"]) <= 0.05]
    return {"rows": rows, "max_streams_within_5pct": max(ok) if ok else 0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-streams", type=int, default=256)
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()

    def render(doc: dict[str, Any]) -> str:
        table = md_table(doc["rows"], list(doc["rows"][0]))
        return f"{table}\n\nLargest N within 5%: {doc['max_streams_within_5pct']}"

    measure_and_report(lambda: run(args.max_streams), render, args.json)


if __name__ == "__main__":
    main()
