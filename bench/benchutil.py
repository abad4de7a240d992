"""Helpers shared by the benchmark scripts in this folder: machine info, inputs, tables, JSON.

Not a benchmark itself. The scripts import it as a sibling module (Python puts the script's own
folder first on ``sys.path``), so nothing here needs the folder to be a package.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp

from disaggpool.core.contracts import SLOClass
from disaggpool.core.hardware import builtin_profile
from disaggpool.formats.embedded import azure_services
from disaggpool.formats.traces import TraceRequest
from disaggpool.pdwire import prefill_leg_params
from disaggpool.sim import capacity
from disaggpool.studies.paper_config import PaperConfig
from disaggpool.studies.paper_traces import mixed_trace

#: The nominal profile of the paper pool (Llama-3-8B on A40).
PROFILE = "a40-llama3-8b"


def cpu_model() -> str:
    """The ``model name`` line of /proc/cpuinfo, or platform.processor() elsewhere."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def machine_info() -> dict[str, Any]:
    """CPU, cores, affinity, Python and the load average when the numbers were taken."""
    affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return {
        "date_utc": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "sched_getaffinity": affinity,
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "platform": platform.platform(),
        "load_average_1_5_15": load_average(),
    }


def proc_stat_ticks() -> dict[str, tuple[int, int]]:
    """(busy, total) clock ticks since boot from /proc/stat: ``cpu`` for the whole machine,
    ``cpu0``, ``cpu1`` ... per core; empty where there is no /proc/stat."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return {}
    out = {}
    for line in lines:
        name, *fields = line.split()
        if name == "cpu" or (name.startswith("cpu") and name[3:].isdigit()):
            ticks = [int(x) for x in fields[:8]]  # user nice system idle iowait irq softirq steal
            idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
            out[name] = (sum(ticks) - idle, sum(ticks))
    return out


def _proc_stat_busy_s() -> float | None:
    """Busy CPU seconds of the whole machine since boot (all cores), from /proc/stat."""
    machine = proc_stat_ticks().get("cpu")
    return None if machine is None else machine[0] / os.sysconf("SC_CLK_TCK")


class Contention:
    """How much CPU *other* processes used while a benchmark ran, in cores (0 = machine quiet).

    Machine-wide busy time from /proc/stat minus this process's and its children's CPU time,
    divided by the wall time. It sees only this (virtual) machine: a busy host is invisible.
    Children still running are counted as this benchmark's only when their `pids` are given
    (their /proc/PID/stat times; `os.times` counts a child once it is waited for).
    """

    def __init__(self, pids: Sequence[int] = ()) -> None:
        self._pids = list(pids)
        self._busy = _proc_stat_busy_s()
        self._own = self._own_cpu()
        self._wall = time.perf_counter()

    def _own_cpu(self) -> float:
        t = os.times()
        own = t.user + t.system + t.children_user + t.children_system
        return own + sum(process_cpu_s(pid) for pid in self._pids)

    def other_cores(self) -> float:
        busy = _proc_stat_busy_s()
        wall = time.perf_counter() - self._wall
        if busy is None or self._busy is None or wall <= 0:
            return math.nan
        other = (busy - self._busy) - (self._own_cpu() - self._own)
        return round(max(0.0, other) / wall, 2)


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process `pid` has used, from /proc/PID/stat; 0 when it is
    gone (a reaped child is then in `os.times`' children_*) or there is no /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def machine_table(info: dict[str, Any]) -> str:
    rows = [{"item": k, "value": str(v)} for k, v in info.items()]
    return md_table(rows, ["item", "value"])


def machine_line(info: dict[str, Any]) -> str:
    """One line: CPU, cores, Python, date and the contention seen during the run."""
    return (
        f"Machine: {info['cpu_model']}, {info['cpu_count']} cores (affinity "
        f"{info['sched_getaffinity']}), {info['python']}, {info['date_utc']}; load average "
        f"{info['load_average_1_5_15']}; other processes' CPU during the run: "
        f"{info.get('other_processes_cpu_cores_during_run', 'n/a')} cores."
    )


def paper_inputs() -> tuple[
    list[TraceRequest], list[TraceRequest], dict[str, SLOClass], dict[str, list[TraceRequest]]
]:
    """Mixed trace 0 of `sim paper`, its predictor history, its SLO classes, the raw services.

    The SLO classes are derived exactly as `paper_setup.make_setup` derives them (from all three
    mixed traces), so they equal the paper's targets.
    """
    cfg = PaperConfig()
    services = azure_services()
    pairs = [mixed_trace(services, k, cfg) for k in range(3)]
    slo = capacity.slo_targets(builtin_profile(PROFILE), [r for t, _ in pairs for r in t])
    trace, history = pairs[0]
    return trace, history, slo, services


def fmt(v: Any) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "n/a"
        if abs(v) >= 1000:
            return f"{v:,.0f}"
        if abs(v) >= 10:
            return f"{v:.1f}"
        return f"{v:.3f}"
    return str(v)


def md_table(rows: Sequence[dict[str, Any]], cols: Sequence[str]) -> str:
    """A GitHub markdown table of `rows` restricted to `cols`."""
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |")
    return "\n".join(lines) + "\n"


def write_json(path: str | None, doc: dict[str, Any]) -> None:
    if path:
        Path(path).write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n")
        print(f"wrote {path}", file=sys.stderr)


def measure_and_report(
    run: Callable[[], dict[str, Any]],
    render: Callable[[dict[str, Any]], str],
    json_path: str | None,
) -> None:
    """Run a benchmark while watching the machine, print its tables and the machine, save JSON."""
    machine = machine_info()
    contention = Contention()
    doc = run()
    machine["other_processes_cpu_cores_during_run"] = contention.other_cores()
    doc["machine"] = machine
    print(render(doc))
    print(machine_line(machine))
    write_json(json_path, doc)


async def two_legs(
    session: aiohttp.ClientSession,
    prefill_url: str,
    decode_url: str,
    body: dict[str, Any],
    request_id: str,
    api_key: str = "",
) -> None:
    """vLLM's P/D handoff done by the client itself, as a baseline for the routers: the prefill
    leg (one token, not streamed, `do_remote_decode`), then the decode leg with its
    `kv_transfer_params`; with `api_key`, for pods started with vLLM's --api-key."""
    hdr = {"X-Request-Id": request_id}
    if api_key:
        hdr["Authorization"] = f"Bearer {api_key}"
    leg = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": prefill_leg_params()}
    async with session.post(f"{prefill_url}/v1/completions", json=leg, headers=hdr) as r:
        params = (await r.json())["kv_transfer_params"]
    decode = {**body, "kv_transfer_params": params}
    async with session.post(f"{decode_url}/v1/completions", json=decode, headers=hdr) as r:
        assert r.status == 200, r.status
        await r.read()
