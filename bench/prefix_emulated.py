"""Prefix-cache-aware routing on an emulated pool: a Mooncake slice through the real sidecar.

What it runs
------------
A pool of emulated vLLM processes (`disaggpool emulate`, prefix caching on as in vLLM): 4 prefill
pods of `a40-llama3-8b`, the second and fourth 1.6x as fast, and 2 decode pods; their true
profiles are written as the router's profiles (as if a perfect probe had run). The trace is the
first `--requests` requests of the embedded Mooncake conversation trace (prompts clipped to
7,680 tokens, outputs to 64), its arrivals compressed to the rate at which least-loaded
routing attains 0.85 goodput in the simulator on the same pool (`sim.operating_point`), so the
conversations' turns come seconds apart and reuse their prefixes within the run. The load
generator turns every block id into the same 512 token ids, so requests that share block ids
share token prefixes and the engines' caches really hit.

For each router configuration, fresh emulators (empty caches) and a fresh sidecar process; the
trace is replayed through the sidecar's front door (`loadgen.replay`). Configurations: the
cache-blind `round_robin`, `least_loaded` and `calibrated` (no index); the prefix-cache rules
`cache_aware` (vLLM router's), `dynamo_kv` (Dynamo's) and `llmd_weighted` (llm-d's weighted
scorers) with the sidecar's approximate index;
and `calibrated` with the index fed by the prefill pods' KV events (`+events`). Then vLLM's own
router, `vllm-router` (PyPI, pinned `VLLM_ROUTER`, installed by this script into its own virtual
environment under `PEER_ROOT`; skipped with a message when it cannot be installed), in its P/D
mode (`--vllm-pd-disaggregation`) with `cache_aware` (its default), `kv_aware` (fed by the same
KV events from the prefill pods) and `power_of_two`.

Reported per configuration: goodput (SLO: TTFT 3 s, TPOT 100 ms) with a 95% bootstrap interval
over requests (2,000 resamples), the share of prompt tokens the engines found cached
(`vllm:prefix_cache_hits` / `_queries` summed over the prefill pods), TTFT p99, errors.

Run: ``.venv/bin/python bench/prefix_emulated.py [--requests N] [--no-peers] [--only LABEL,...]
[--json FILE]`` (about 90 s per configuration at 400 requests); ``--no-peers`` leaves
vllm-router out, ``--only`` runs only the named configurations of ours.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

import benchutil
from disaggpool import progress, promtext
from disaggpool.core.contracts import SLOClass
from disaggpool.core.hardware import builtin_profile
from disaggpool.core.profile import CalibrationProfile
from disaggpool.core.stats import bootstrap_share_interval
from disaggpool.formats.embedded import embedded_trace
from disaggpool.formats.profiles import save_profile
from disaggpool.formats.traces import TraceRequest
from disaggpool.loadgen import LoadReport, replay
from disaggpool.localpool.processes import free_port, processes, wait_http
from disaggpool.sim import workload
from disaggpool.sim.cluster import InstanceSpec, RouterOptions
from disaggpool.sim.operating_point import SearchProblem, operating_rates
from disaggpool.sim.runner import RunSpec

SLO = SLOClass("chat", 3.0, 0.1)
BASE = builtin_profile("a40-llama3-8b")
FAST = 1.6
# label -> (policy, prefix index, KV events)
CONFIGS: dict[str, tuple[str, bool, bool]] = {
    "round_robin": ("round_robin", False, False),
    "least_loaded": ("least_loaded", False, False),
    "calibrated (no index)": ("calibrated", False, False),
    "cache_aware": ("cache_aware", True, False),
    "dynamo_kv": ("dynamo_kv", True, False),
    "llmd_weighted": ("llmd_weighted", True, False),
    "calibrated": ("calibrated", True, False),
    "calibrated +events": ("calibrated", True, True),
}
# vllm-router's policies run here -> whether its prefill pods publish KV events for it
PEER_POLICIES: dict[str, bool] = {"cache_aware": False, "kv_aware": True, "power_of_two": False}
VLLM_ROUTER = "0.1.17"
PEER_ROOT = Path(os.environ.get("DISAGGPOOL_PEER_ROOT", "/var/cache/disaggpool/peers"))


def vllm_router() -> Path | None:
    """The pinned vllm-router in its own virtual environment (made on first use), or None."""
    venv = PEER_ROOT / f"vllm-router-{VLLM_ROUTER}"
    exe = venv / "bin" / "vllm-router"
    if exe.exists():
        return exe
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True)
        subprocess.run(
            [str(venv / "bin" / "pip"), "install", "-q", f"vllm-router=={VLLM_ROUTER}"],
            check=True,
            capture_output=True,
            timeout=600,
        )
    except (subprocess.SubprocessError, OSError) as exc:
        print(f"vllm-router {VLLM_ROUTER} could not be installed ({exc}): peers skipped")
        return None
    return exe if exe.exists() else None


def pods() -> dict[str, tuple[str, CalibrationProfile]]:
    out: dict[str, tuple[str, CalibrationProfile]] = {}
    for i in range(4):
        out[f"p{i}"] = ("prefill", BASE.scaled(FAST if i % 2 else 1.0, name=f"p{i}"))
    for i in range(2):
        out[f"d{i}"] = ("decode", BASE.scaled(1.0, name=f"d{i}"))
    return out


def mooncake_slice(n: int) -> list[TraceRequest]:
    trace = workload.clip_lengths(embedded_trace("mooncake-conversation"), 7680, 64)
    return [dataclasses.replace(r, slo_class="chat") for r in trace[:n]]


def operating_rate(trace: Sequence[TraceRequest]) -> float:
    """Where least-loaded attains 0.85 goodput in the simulator on this pool."""
    specs = tuple(InstanceSpec(n, role, p, p) for n, (role, p) in pods().items())
    spec = RunSpec(
        "prefix-emulated", "mooncake", tuple(trace), specs, (SLO,), "least_loaded", 1,
        router=RouterOptions(scrape_interval_s=1.0), prefix_caching=True,
    )  # fmt: skip
    problem = SearchProblem(spec, 0.85, low=0.3, high=20.0)
    return operating_rates([problem], steps=8, workers=1)[0]


def start_pool(
    procs: list[subprocess.Popen[bytes]], tmp: Path, seed: int, events: bool
) -> dict[str, list[dict[str, str]]]:
    """Fresh emulated pods (profiles written to tmp/profiles), each prefill pod publishing its KV
    events on an IPC socket when `events`; the members by role, as the sidecar's config names
    them."""
    exe = [sys.executable, "-m", "disaggpool"]
    members: dict[str, list[dict[str, str]]] = {"prefill": [], "decode": []}
    started = []
    for k, (name, (role, profile)) in enumerate(pods().items()):
        path = tmp / "profiles" / f"{name}.yaml"
        save_profile(profile, path)
        port = free_port()
        cmd = [*exe, "emulate", "--profile", str(path), "--port", str(port),
               "--seed", str(seed + k), "--model", BASE.model]  # fmt: skip
        member = {"name": name, "url": f"http://127.0.0.1:{port}"}
        if events and role == "prefill":
            # TCP, as vllm-router's kv_aware accepts no other; `*` binds the emulator's
            # --host, loopback here.
            kv_port = free_port()
            kv = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{kv_port}"}
            cmd += ["--kv-events-config", json.dumps(kv)]
            member["kv_events"] = f"tcp://127.0.0.1:{kv_port}"
        members[role].append(member)
        env = {**os.environ, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
        log = (tmp / f"{name}.log").open("wb")
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        procs.append(proc)
        started.append((member["url"], proc))
    for url, proc in started:
        wait_http(f"{url}/health", proc)
    return members


def start_sidecar(
    procs: list[subprocess.Popen[bytes]],
    tmp: Path,
    members: dict[str, list[dict[str, str]]],
    policy: str,
    index: bool,
    events: bool,
) -> str:
    port = free_port()
    config: dict[str, Any] = {
        "policy": policy,
        "model": BASE.model,
        "listen": {"http": f"127.0.0.1:{port}", "grpc": "127.0.0.1:0"},
        "slo_classes": [{"name": SLO.name, "ttft_s": SLO.ttft_s, "tpot_s": SLO.tpot_s}],
        "scrape_interval_s": 1.0,
        "tokenizer": {"kind": "emulator"},
        "pool": {"static": members},
        "profiles": {"dir": str(tmp / "profiles")},
        "prefix_index": index,
    }
    if events:
        config["kv_events"] = {"stale_after_s": 10.0}
    path = tmp / "sidecar.yaml"
    path.write_text(yaml.safe_dump(config))
    log = (tmp / "sidecar.log").open("wb")
    cmd = [sys.executable, "-m", "disaggpool", "sidecar", "--config", str(path)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    procs.append(proc)
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/health", proc)
    time.sleep(1.5)  # a scrape, the profiles, the event subscriptions
    return url


def start_vllm_router(
    procs: list[subprocess.Popen[bytes]],
    tmp: Path,
    exe: Path,
    members: dict[str, list[dict[str, str]]],
    policy: str,
    cpu: str = "",
) -> str:
    """vllm-router in its P/D mode in front of `members`, on CPU `cpu` if given; its URL."""
    port = free_port()
    cmd = [str(exe), "--host", "127.0.0.1", "--port", str(port), "--vllm-pd-disaggregation",
           "--policy", policy, "--log-level", "warning"]  # fmt: skip
    if cpu:
        cmd = ["taskset", "-c", cpu, *cmd]
    for m in members["prefill"]:
        cmd += ["--prefill", m["url"]]
        if "kv_events" in m:  # its P/D mode's own flag for static event sources (16-token blocks)
            cmd += ["--pd-kv-events", f"{m['url']}={m['kv_events']}"]
    for m in members["decode"]:
        cmd += ["--decode", m["url"]]
    log = (tmp / "vllm-router.log").open("wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    procs.append(proc)
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/health", proc)
    time.sleep(1.5)
    return url


def run_config(
    label: str, trace: Sequence[TraceRequest], tmp: Path, seed: int, router: Path | None = None
) -> dict[str, Any]:
    """One configuration on fresh pods: ours (`CONFIGS`), or vllm-router's policy `label` when
    `router` is its executable."""
    if router is None:
        policy, index, events = CONFIGS[label]
    else:
        policy, index, events = label, False, PEER_POLICIES[label]
    with processes() as procs:
        members = start_pool(procs, tmp, seed, events)
        if router is None:
            url = start_sidecar(procs, tmp, members, policy, index, events)
            name = label
        else:
            url = start_vllm_router(procs, tmp, router, members, policy)
            name = f"vllm-router {label}"
        bar = progress.bar(total=len(trace), desc=f"{name:>24}", unit="req")
        report = asyncio.run(
            replay(url, trace, [SLO], model=BASE.model, seed=seed, on_done=lambda _: bar.update(1))
        )
        bar.close()
        queries = hits = 0.0
        names = ["vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"]
        for m in members["prefill"]:
            with urllib.request.urlopen(f"{m['url']}/metrics", timeout=10) as r:
                fams = promtext.parse(r.read().decode(), names)
            queries += promtext.total(fams, names[0])
            hits += promtext.total(fams, names[1])
    row = summarize(name, report, hits / queries if queries else 0.0, seed)
    row["router"] = "disaggpool" if router is None else "vllm-router"
    return row


def summarize(label: str, report: LoadReport, hit_share: float, seed: int) -> dict[str, Any]:
    met = [report.met(r) for r in report.results]
    n = len(met)
    ttfts = sorted(r.ttft_s for r in report.results if r.ok)
    return {
        "config": label,
        "requests": n,
        "goodput": sum(met) / n,
        "goodput_ci95": list(bootstrap_share_interval(met, seed)),
        "prefix_hit": hit_share,
        "ttft_p99_s": ttfts[int(0.99 * (len(ttfts) - 1))] if ttfts else None,
        "errors": sum(not r.ok for r in report.results),
    }


def measure(
    requests: int,
    seed: int,
    peers: bool = True,
    ours: bool = True,
    only: Sequence[str] | None = None,
) -> dict[str, Any]:
    base = mooncake_slice(requests)
    rate = operating_rate(base)
    trace = workload.rescale(base, rate)
    router = vllm_router() if peers else None
    chosen = [label for label in CONFIGS if ours and (only is None or label in only)]
    runs: list[tuple[str, Path | None]] = [(label, None) for label in chosen]
    if router is not None:
        runs += [(policy, router) for policy in PEER_POLICIES]
    rows = []
    for label, exe in runs:
        with tempfile.TemporaryDirectory(prefix="dp-prefix-") as tmp_name:
            tmp = Path(tmp_name)
            (tmp / "profiles").mkdir()
            try:
                rows.append(run_config(label, trace, tmp, seed, exe))
            except RuntimeError as exc:  # a router that would not start: say so, go on
                print(f"{label}: {exc}")
                router = "vllm-router" if exe else "disaggpool"
                rows.append({"config": label, "router": router, "error": str(exc)[-300:]})
    return {
        "pool": "4 prefill (2 at 1.6x) + 2 decode, a40-llama3-8b, emulated",
        "requests": len(trace),
        "rate_rps": round(rate, 3),
        "duration_s": round(trace[-1].arrival_s - trace[0].arrival_s, 1),
        "slo": {"ttft_s": SLO.ttft_s, "tpot_s": SLO.tpot_s},
        "vllm_router": VLLM_ROUTER if router is not None else None,
        "rows": rows,
    }


def render(doc: dict[str, Any]) -> str:
    res = doc["prefix_emulated"]
    rows = [
        {
            "config": r["config"],
            "goodput": r["goodput"],
            "95% interval": f"{r['goodput_ci95'][0]:.3f}-{r['goodput_ci95'][1]:.3f}",
            "cached share": r["prefix_hit"],
            "TTFT p99 s": r["ttft_p99_s"],
            "errors": r["errors"],
        }
        for r in res["rows"]
        if "error" not in r
    ]
    failed = [f"{r['config']}: {r['error']}" for r in res["rows"] if "error" in r]
    cols = ["config", "goodput", "95% interval", "cached share", "TTFT p99 s", "errors"]
    return (
        f"### Mooncake slice on an emulated pool ({res['pool']}; {res['requests']} requests at "
        f"{res['rate_rps']} req/s over {res['duration_s']} s)\n\n"
        + benchutil.md_table(rows, cols)
        + "".join(f"\nNot run: {f}\n" for f in failed)
    )


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=400, help="requests of the slice (400)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--no-peers", action="store_true", help="leave vllm-router out")
    ap.add_argument("--peers-only", action="store_true", help="only vllm-router's policies")
    ap.add_argument("--only", metavar="LABELS", help="only these of our configurations (comma)")
    ap.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = ap.parse_args(argv)
    only = args.only.split(",") if args.only else None
    unknown = sorted(set(only or ()) - set(CONFIGS))
    if unknown:
        ap.error(f"--only: unknown configuration(s) {unknown}; valid: {', '.join(CONFIGS)}")
    benchutil.measure_and_report(
        lambda: {
            "prefix_emulated": measure(
                args.requests, args.seed, not args.no_peers, not args.peers_only, only
            )
        },
        render,
        args.json,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
