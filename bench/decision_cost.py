"""Cost of one routing decision, ``policy.route(features, snapshot, rng)``, versus pool size.

What it measures
----------------
Wall time of a single ``route`` call for pools of 4 prefill and 8, 32 or 128 decode instances,
for the calibrated policy and the round_robin, least_loaded and length baselines (all built with
``make_policy`` and each policy's default switches, ``registry.default_options``: the calibrated
policy with its P/D decider on, as the sidecar runs it). Only ``route`` is timed: building the
snapshot (``core.pods``, the same in the simulator and the sidecar) is not part of it.

Inputs are realistic and fixed by seed. Profiles are the *believed* profiles of
``sim.pools.build_pool(4, n_decode, builtin_profile("a40-llama3-8b"), seed=1)`` (per-instance speed
spread 5%, fit error 3%), so every instance has its own trusted profile and the calibrated policy
scores with them (no fallback). For each pool size 64 different (request, snapshot) pairs are
drawn and cycled through:

* request: prompt and output lengths of a request of ``sim paper``'s mixed trace 0 (Azure 2023
  conversation + code), its class (chat or code, with the paper's SLO targets), the predicted
  output within x/÷ 1.5 of the truth and an uncertainty of 80% of it;
* decode instance: 20-80 running sequences, each with a trace prompt and part of its output
  already in KV (``kv_tokens_used``, capped at the KV capacity), 0-6 more in flight not yet
  decoding (``queued``, some of them reported ``waiting``), ``remaining_output_tokens`` summed over
  them, and ``tpot_budgets`` as the ledger buckets them: one per decoding request, its class's TPOT
  target (about 69% chat, the trace's share) within +-30%, by its remaining tokens;
* prefill instance: 0-1 running, 0-4 queued prompts with their token sums.

Timing: ``time.perf_counter_ns`` around each call; per pool size 20,000 calls per policy for 8
decode instances, 5,000 for 32 and 2,000 for 128 (``--quick``: a tenth), after 500 warm-up calls.
Calls are issued in interleaved blocks of 200 per policy (policy order rotated every block), so
that slow spells of a shared machine hit all policies alike. The garbage collector stays on, as
in production. The figures include the clock's own overhead, printed separately (the median of
back-to-back ``perf_counter_ns`` pairs). ``x round_robin`` divides each policy's mean (or p50)
by round-robin's, measured in the same run. ``cpu_share`` is CPU time over wall time of all timed
calls of a pool size (``time.process_time``): near 1.0 the process had its core to itself (within
this virtual machine; a busy host is invisible to it).

Run: ``.venv/bin/python bench/decision_cost.py [--quick] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Sequence
from typing import Any

import benchutil
from disaggpool.core.contracts import (
    InstanceSnapshot,
    PoolSnapshot,
    RequestFeatures,
    SLOClass,
    TpotBudgets,
)
from disaggpool.core.hardware import builtin_profile
from disaggpool.core.policies.base import Policy
from disaggpool.core.policies.registry import default_options, make_policy
from disaggpool.core.profile import CalibrationProfile
from disaggpool.core.stats import percentile
from disaggpool.formats.traces import TraceRequest
from disaggpool.sim.pools import build_pool

POLICIES = ("round_robin", "least_loaded", "length", "calibrated")
N_PREFILL = 4
DECODE_SIZES = (8, 32, 128)
ITERATIONS = {8: 20_000, 32: 5_000, 128: 2_000}
SCENARIOS = 64
BLOCK_CALLS = 200  # calls per policy per interleaved block
WARMUP = 500
CHAT_SHARE = 19366 / (19366 + 8819)  # conversation requests / all requests of the Azure hour


def _prefill_snapshot(
    name: str, prof: CalibrationProfile, rng: random.Random, trace: Sequence[TraceRequest]
) -> InstanceSnapshot:
    running = rng.randint(0, 1)
    queued = rng.randint(0, 4)
    prompts = [rng.choice(trace).prompt_tokens for _ in range(queued)]
    return InstanceSnapshot(
        name=name,
        role="prefill",
        running=running,
        waiting=queued,
        kv_tokens_used=sum(rng.choice(trace).prompt_tokens for _ in range(running)),
        inflight=queued + running,
        queued=queued,
        queued_tokens=sum(prompts),
        queued_sq_tokens=float(sum(p * p for p in prompts)),
        profile=prof,
    )


def _decode_snapshot(
    name: str,
    prof: CalibrationProfile,
    rng: random.Random,
    trace: Sequence[TraceRequest],
    slo: dict[str, SLOClass],
) -> InstanceSnapshot:
    running = rng.randint(20, 80)
    queued = rng.randint(0, 6)
    kv = 0
    remaining = 0.0
    counts: dict[tuple[float, int], int] = {}
    for _ in range(running):
        r = rng.choice(trace)
        done = rng.randint(0, r.output_tokens)
        kv += r.prompt_tokens + done
        left = max(1, r.output_tokens - done)
        remaining += left
        # a decoding request affords its class's target give or take the slack it has had
        target = slo["chat" if rng.random() < CHAT_SHARE else "code"].tpot_s
        key = (
            round(target * rng.uniform(0.7, 1.3) * 2000.0) / 2000.0,
            1 << (left.bit_length() - 1),
        )
        counts[key] = counts.get(key, 0) + 1
    queued_reqs = [rng.choice(trace) for _ in range(queued)]
    remaining += sum(r.output_tokens for r in queued_reqs)
    inflight = running + queued
    for r in queued_reqs:
        target = slo["chat" if rng.random() < CHAT_SHARE else "code"].tpot_s
        key = (target, 1 << (max(1, r.output_tokens).bit_length() - 1))
        counts[key] = counts.get(key, 0) + 1
    targets = TpotBudgets.of((b, left, k) for (b, left), k in counts.items())
    return InstanceSnapshot(
        name=name,
        role="decode",
        running=running,
        waiting=rng.randint(0, queued),
        kv_tokens_used=min(kv, prof.kv_capacity_tokens),
        inflight=inflight,
        queued=queued,
        queued_tokens=sum(r.prompt_tokens for r in queued_reqs),
        remaining_output_tokens=remaining,
        tpot_budgets=targets,
        profile=prof,
    )


def scenarios(
    n_decode: int, trace: Sequence[TraceRequest], slo: dict[str, SLOClass], count: int = SCENARIOS
) -> list[tuple[RequestFeatures, PoolSnapshot]]:
    """`count` seeded (request, pool snapshot) pairs for a pool of 4 prefill + n_decode."""
    pool = build_pool(N_PREFILL, n_decode, builtin_profile(benchutil.PROFILE), 1)
    rng = random.Random(f"decision_cost:{n_decode}")
    out = []
    for i in range(count):
        r = rng.choice(trace)
        predicted = max(1.0, r.output_tokens * 1.5 ** rng.uniform(-1.0, 1.0))
        features = RequestFeatures(
            request_id=str(i),
            prompt_tokens=r.prompt_tokens,
            predicted_output_tokens=predicted,
            output_uncertainty=0.8 * predicted,
            slo=slo[r.slo_class],
        )
        prefill = [
            _prefill_snapshot(s.name, s.believed_profile, rng, trace)  # type: ignore[arg-type]
            for s in pool
            if s.role == "prefill"
        ]
        decode = [
            _decode_snapshot(s.name, s.believed_profile, rng, trace, slo)  # type: ignore[arg-type]
            for s in pool
            if s.role == "decode"
        ]
        out.append((features, PoolSnapshot(now=100.0 + i, prefill=prefill, decode=decode)))
    return out


def timer_overhead_ns(n: int = 20_000) -> float:
    clock = time.perf_counter_ns
    samples = []
    for _ in range(n):
        t0 = clock()
        t1 = clock()
        samples.append(t1 - t0)
    return statistics.median(samples)


def _time_calls(
    policy: Policy,
    cases: Sequence[tuple[RequestFeatures, PoolSnapshot]],
    rng: random.Random,
    start: int,
    n: int,
    out: list[int],
) -> None:
    clock = time.perf_counter_ns
    route = policy.route
    m = len(cases)
    for k in range(start, start + n):
        features, snapshot = cases[k % m]
        t0 = clock()
        route(features, snapshot, rng)
        t1 = clock()
        out.append(t1 - t0)


def measure(quick: bool) -> dict[str, Any]:
    trace, _, slo, _ = benchutil.paper_inputs()
    rows = []
    for n_decode in DECODE_SIZES:
        cases = scenarios(n_decode, trace, slo)
        iterations = ITERATIONS[n_decode] // (10 if quick else 1)
        policies = {name: make_policy(name, options=default_options(name)) for name in POLICIES}
        check = policies["calibrated"].route(*cases[0], random.Random(0))
        if check.policy != "calibrated":
            raise RuntimeError(f"calibrated policy fell back: {check.policy}")
        rngs = {name: random.Random(f"route:{name}") for name in POLICIES}
        samples: dict[str, list[int]] = {name: [] for name in POLICIES}
        for name in POLICIES:
            _time_calls(policies[name], cases, rngs[name], 0, WARMUP, [])
        blocks = max(1, iterations // BLOCK_CALLS)
        per_block = iterations // blocks
        c0, w0 = time.process_time(), time.perf_counter()
        for block in range(blocks):
            order = POLICIES[block % len(POLICIES) :] + POLICIES[: block % len(POLICIES)]
            for name in order:
                _time_calls(
                    policies[name], cases, rngs[name], block * per_block, per_block, samples[name]
                )
        cpu_share = (time.process_time() - c0) / (time.perf_counter() - w0)
        rr_mean = statistics.fmean(samples["round_robin"])
        rr_p50 = statistics.median(samples["round_robin"])
        for name in POLICIES:
            s = samples[name]
            mean = statistics.fmean(s)
            p50 = statistics.median(s)
            rows.append(
                {
                    "prefill": N_PREFILL,
                    "decode": n_decode,
                    "policy": name,
                    "calls": len(s),
                    "mean_us": mean / 1e3,
                    "p50_us": p50 / 1e3,
                    "p99_us": percentile(s, 99) / 1e3,
                    "x_round_robin_mean": mean / rr_mean,
                    "x_round_robin_p50": p50 / rr_p50,
                    "cpu_share": cpu_share,
                }
            )
    return {
        "rows": rows,
        "timer_overhead_us": timer_overhead_ns() / 1e3,
        "scenarios_per_size": SCENARIOS,
    }


def run(quick: bool) -> dict[str, Any]:
    return {"benchmark": "decision_cost", "quick": quick, **measure(quick)}


def render(doc: dict[str, Any]) -> str:
    cols = [
        "prefill",
        "decode",
        "policy",
        "calls",
        "mean_us",
        "p50_us",
        "p99_us",
        "x_round_robin_mean",
        "x_round_robin_p50",
        "cpu_share",
    ]
    ratio_rows = []
    by_size: dict[int, dict[str, dict[str, Any]]] = {}
    for r in doc["rows"]:
        by_size.setdefault(r["decode"], {})[r["policy"]] = r
    for n_decode, group in by_size.items():
        cal, rr = group["calibrated"], group["round_robin"]
        ratio_rows.append(
            {
                "decode": n_decode,
                "calibrated_mean_us": cal["mean_us"],
                "round_robin_mean_us": rr["mean_us"],
                "calibrated/round_robin (mean)": cal["x_round_robin_mean"],
                "calibrated/round_robin (p50)": cal["x_round_robin_p50"],
                "calibrated/round_robin (p99)": cal["p99_us"] / rr["p99_us"],
            }
        )
    return (
        "### Routing decision cost: one `policy.route` call\n\n"
        f"{doc['scenarios_per_size']} seeded snapshots per pool size, interleaved blocks; "
        f"microseconds, clock overhead included ({doc['timer_overhead_us']:.3f} us per "
        "perf_counter_ns pair).\n\n"
        + benchutil.md_table(doc["rows"], cols)
        + "\n"
        + benchutil.md_table(ratio_rows, list(ratio_rows[0]))
    )


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a tenth of the iterations")
    ap.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = ap.parse_args(argv)
    benchutil.measure_and_report(lambda: run(args.quick), render, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
