"""Cost of a routing decision with the router's prefix index, and the index's memory per pod.

What it measures
----------------
The decision-cost pools of `decision_cost.py` (4 prefill + 8 decode instances, 64 seeded
snapshots, believed A40 profiles), each prefill instance's entry in a `core.prefix_index.
PrefixIndex` filled to 10,000 blocks (the Mooncake conversation trace replayed onto them round
robin, 512-token blocks, capacity 10,000 blocks per instance). Requests are the trace's next
2,000 requests with their real block ids, prompts clipped to 7,680 tokens. Timed per call, in
interleaved blocks of 200 (rotated order), garbage collector on:

* ``hits``: `PrefixIndex.hits` over the 4 prefill instances (what the router adds per request);
* ``route``: `policy.route` of the calibrated policy (P/D decider on) without prefix hits;
* ``hits + route``: both, the request carrying the hits (the decision with the index);
* ``round_robin``: `policy.route` of round-robin, the baseline of the same run;
* ``prompt_blocks (16)``: the sidecar's own per-request step before the lookup: cutting the
  prompt's token ids (the request's length, synthetic ids) into chained 16-token block ids, as
  `core.prefix_index.prompt_blocks` does for a GPU vLLM's block size (the simulator's traces
  carry their block ids and skip it).

Memory: ``tracemalloc`` of one instance's index filled to 10,000 blocks (bytes per block too).

Run: ``.venv/bin/python bench/prefix_index.py [--quick] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import random
import statistics
import time
import tracemalloc
from collections.abc import Sequence
from typing import Any

import benchutil
import decision_cost
from disaggpool.core.policies.registry import default_options, make_policy
from disaggpool.core.prefix_index import PrefixIndex, prompt_blocks
from disaggpool.formats.embedded import embedded_trace
from disaggpool.sim import workload

BLOCKS_PER_POD = 10_000
BLOCK = 512


def _filled(names: Sequence[str], trace: Sequence[Any]) -> tuple[PrefixIndex, int]:
    """An index whose every instance holds BLOCKS_PER_POD blocks; how many requests it took."""
    index = PrefixIndex()
    used = 0
    while min(index.size(n) for n in names) < BLOCKS_PER_POD:
        r = trace[used]
        index.record(
            names[used % len(names)], r.blocks, r.prompt_tokens, BLOCK, BLOCKS_PER_POD * BLOCK
        )
        used += 1
    return index, used


def memory_per_pod(trace: Sequence[Any]) -> dict[str, float]:
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index, _ = _filled(["p"], trace)
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert index.size("p") == BLOCKS_PER_POD
    return {"bytes": after - before, "bytes_per_block": (after - before) / BLOCKS_PER_POD}


def measure(quick: bool) -> dict[str, Any]:
    base, _, slo, _ = benchutil.paper_inputs()
    cases = decision_cost.scenarios(8, base, slo)
    names = [i.name for i in cases[0][1].prefill]
    trace = workload.clip_lengths(embedded_trace("mooncake-conversation"), 7680, 512)
    index, used = _filled(names, trace)
    requests = trace[used : used + 2000]
    calibrated = make_policy("calibrated", options=default_options("calibrated"))
    rr = make_policy("round_robin")
    rng = random.Random(7)
    calls = 2000 if quick else 20000
    times: dict[str, list[int]] = {
        "hits": [],
        "route": [],
        "hits + route": [],
        "round_robin": [],
        "prompt_blocks (16)": [],
    }
    ids = [rng.randrange(32000) for _ in range(8192)]
    clock = time.perf_counter_ns

    def block(kind: str, start: int) -> None:
        out = times[kind]
        for k in range(start, start + 200):
            features, snapshot = cases[k % len(cases)]
            r = requests[k % len(requests)]
            features = dataclasses.replace(features, prompt_tokens=r.prompt_tokens)
            t0 = clock()
            if kind == "hits":
                index.hits(names, r.blocks, r.prompt_tokens, BLOCK)
            elif kind == "route":
                calibrated.route(features, snapshot, rng)
            elif kind == "round_robin":
                rr.route(features, snapshot, rng)
            elif kind == "prompt_blocks (16)":
                prompt_blocks(ids[: r.prompt_tokens], 16)
            else:
                hits = index.hits(names, r.blocks, r.prompt_tokens, BLOCK)
                calibrated.route(dataclasses.replace(features, prefix_hits=hits), snapshot, rng)
            out.append(clock() - t0)

    kinds = list(times)
    for start in range(0, 1000, 200):  # warm-up
        for kind in kinds:
            block(kind, start)
    for kind in kinds:
        times[kind].clear()
    for n, start in enumerate(range(0, calls, 200)):
        order = kinds[n % len(kinds) :] + kinds[: n % len(kinds)]
        for kind in order:
            block(kind, start)
    rr_mean = statistics.mean(times["round_robin"]) / 1000
    hit_share = statistics.mean(
        sum(index.hits(names, r.blocks, r.prompt_tokens, BLOCK).values())
        / (len(names) * r.prompt_tokens)
        for r in requests
    )
    rows = []
    for kind in kinds:
        us = [t / 1000 for t in times[kind]]
        rows.append(
            {
                "call": kind,
                "calls": len(us),
                "mean_us": statistics.mean(us),
                "p50_us": statistics.median(us),
                "p99_us": sorted(us)[int(0.99 * len(us))],
                "x_round_robin_mean": statistics.mean(us) / rr_mean,
            }
        )
    return {
        "pool": "4 prefill (indexed) + 8 decode, decision_cost snapshots",
        "blocks_per_pod": BLOCKS_PER_POD,
        "requests_replayed_to_fill": used,
        "mean_cached_share_per_pod": round(hit_share, 4),
        "rows": rows,
        "memory_per_pod": memory_per_pod(trace),
    }


def render(doc: dict[str, Any]) -> str:
    res = doc["prefix_index"]
    mem = res["memory_per_pod"]
    cols = ["call", "calls", "mean_us", "p50_us", "p99_us", "x_round_robin_mean"]
    return (
        f"### Decision with the prefix index ({res['pool']}, {res['blocks_per_pod']:,} blocks "
        f"per indexed pod)\n\n"
        + benchutil.md_table(res["rows"], cols)
        + f"\nMemory: {mem['bytes'] / 1e6:.2f} MB per pod for {res['blocks_per_pod']:,} blocks "
        f"({mem['bytes_per_block']:.0f} bytes per block). Mean share of a prompt cached per "
        f"pod: {res['mean_cached_share_per_pod']:.3f}.\n"
    )


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a tenth of the calls")
    ap.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = ap.parse_args(argv)
    benchutil.measure_and_report(lambda: {"prefix_index": measure(args.quick)}, render, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
