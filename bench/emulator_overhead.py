"""How many concurrent streams one emulator process sustains on one core before its timing drifts.

An emulator is only a faithful stand-in while its own CPU cost stays small next to the engine
time it emulates. This starts one `disaggpool emulate` process pinned to CPU 0 (the client runs
in this process, pinned to CPU 1) with the A40 profile and no jitter, then for N = 8, 16, ... 256
concurrent streaming requests (prompt 256 tokens, 200 output tokens, ``ignore_eos``, started
together) measures each stream's time per output token (TPOT, after its first token) and compares
the median with what the engine model itself says for that batch: the mean step time
``decode.step(N, context)`` over the streams' decode, with the context growing from 257 to 456
tokens per stream. Drift = measured / modelled - 1. The emulator schedules steps on absolute
deadlines, so an overloaded one does not drift on average: it delivers tokens late and in bunches.
So the gaps between tokens are measured too, once every stream is decoding (from its 40th token,
after the prefill chunks of the others): each gap divided by the modelled step(s) it spans. The
answer is the largest N with |drift| <= 5% and a p99 gap within 5% of the modelled step.

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


def _modelled_steps(n: int) -> list[float]:
    return [PROFILE.decode.step(n, n * (PROMPT + 1 + k)) for k in range(OUTPUT - 1)]


STEADY_FROM = 40  # tokens: by then every stream's prompt is prefilled


async def _streams(url: str, n: int) -> list[tuple[float, list[float]]]:
    """Per stream: (TPOT, each steady-state gap / the modelled steps it spans)."""
    steps = _modelled_steps(n)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def one(i: int) -> tuple[float, list[float]]:
            body = {"prompt": list(range(3, 3 + PROMPT)), "max_tokens": OUTPUT,
                    "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}  # fmt: skip
            first = last = 0.0
            tokens = seen = 0
            ratios: list[float] = []
            async with session.post(f"{url}/v1/completions", json=body) as resp:
                async for line in resp.content:
                    if line.startswith(b"data: {"):
                        now = time.perf_counter()
                        event = json.loads(line[6:])
                        if event.get("usage"):
                            tokens = event["usage"]["completion_tokens"]
                            continue
                        text = event["choices"][0].get("text") or ""
                        k = len(text.split())  # the emulator's words are one token each
                        if not first:
                            first = last = now
                            seen = k
                            continue
                        if seen >= STEADY_FROM and k:
                            modelled = sum(steps[seen - 1 : seen - 1 + k])
                            ratios.append((now - last) / modelled)
                        seen += k
                        last = now
            return (time.perf_counter() - first) / (tokens - 1), ratios

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
                results = asyncio.run(_streams(url, n))
                tpots = [t for t, _ in results]
                gaps = sorted(x for _, ratios in results for x in ratios)
                measured = statistics.median(tpots)
                modelled = statistics.fmean(_modelled_steps(n))
                rows.append({
                    "streams": n, "modelled TPOT ms": modelled * 1000,
                    "measured TPOT ms (median)": measured * 1000,
                    "measured p90 ms": sorted(tpots)[int(0.9 * (n - 1))] * 1000,
                    "drift": measured / modelled - 1.0,
                    "gap / modelled step p50": statistics.median(gaps),
                    "gap / modelled step p99": gaps[int(0.99 * (len(gaps) - 1))],
                    "tokens/s served": n / measured,
                })  # fmt: skip
                n *= 2
        finally:
            proc.terminate()
            proc.wait(10)
    ok = [
        r["streams"]
        for r in rows
        if abs(r["drift"]) <= 0.05 and r["gap / modelled step p99"] <= 1.05
    ]
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
