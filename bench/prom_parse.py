"""Cost of reading a vLLM `/metrics` page: `prometheus_client`'s parser versus `promtext`.

What it measures
----------------
Wall time per page of four ways to get the sidecar's five gauges' samples out of one page
(`vllm:num_requests_running`, `_waiting`, `vllm:kv_cache_usage_perc`,
`vllm:num_preemptions_total`, `vllm:cache_config_info`):

* ``library, whole page``: ``prometheus_client.parser.text_string_to_metric_families`` over the
  page, as a reader that wants every family would;
* ``library, picked lines``: the same parser over only the lines of the five series (picked as
  `promtext.parse` picks them: a prefix test, then the exact name);
* ``promtext.parse``: ours, picking and parsing;
* ``parse_gauges``: the sidecar's reader (`promtext.parse` plus summing), what a scrape costs.

Two pages: the emulator's (``disaggpool.emulator``, the A40 profile, idle) and one rendered from
the families real vLLM 0.32.0 served in ``tests/realvllm/fixtures/vllm_0.32.0_wire.json``
(its decode pod: every family, type, label name and histogram bucket as recorded, label values
where recorded, one placeholder series per family otherwise, so real pages are at least this
long). Before timing, the library's samples of the picked lines are checked equal to ours.

Timing: ``time.perf_counter`` around batches of calls sized to about 20 ms, the four ways
interleaved (order rotated every round) so that slow spells of a shared machine hit all alike;
the median over rounds. ``x promtext`` divides each way's time by ``promtext.parse``'s.

Run: ``.venv/bin/python bench/prom_parse.py [--quick] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import statistics
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

import benchutil
from disaggpool import promtext
from disaggpool.core.hardware import builtin_profile
from disaggpool.emulator.config import EmulatorConfig
from disaggpool.emulator.harness import EmulatorThread
from disaggpool.sidecar.scrape import parse_gauges

NAMES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:num_preemptions_total",
    "vllm:cache_config_info",
)
FIXTURE = Path(__file__).resolve().parents[1] / "tests/realvllm/fixtures/vllm_0.32.0_wire.json"
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
BATCH_S = 0.02


def emulator_page() -> str:
    cfg = EmulatorConfig(builtin_profile("a40-llama3-8b"), port=0, side_channel_port=0)
    with EmulatorThread(cfg) as emu, urllib.request.urlopen(f"{emu.url}/metrics") as resp:
        return str(resp.read().decode())


def fixture_page() -> str:
    """A page with the families, label names and buckets real vLLM 0.32.0 served."""
    families = json.loads(FIXTURE.read_text())["metrics"]["decode"]
    lines: list[str] = []
    for name, fam in families.items():
        lines += [f"# HELP {name} {name}.", f"# TYPE {name} {fam['type']}"]
        recorded = fam.get("label_values", {})
        choices = [[(k, v) for v in recorded.get(k, ["x"])] for k in fam["labels"]]
        for combo in itertools.product(*choices):
            labels = ",".join(f'{k}="{v}"' for k, v in combo)
            for suffix in fam["samples"]:
                sample = name if suffix == "<name>" else name + suffix
                if suffix == "_bucket":
                    for le in fam["buckets"]:
                        sep = "," if labels else ""
                        lines.append(f'{sample}{{{labels}{sep}le="{le}"}} 1.0')
                else:
                    lines.append(f"{sample}{{{labels}}} 1.0" if labels else f"{sample} 1.0")
    return "\n".join(lines) + "\n"


def picked(text: str) -> str:
    wanted = set(NAMES)
    keep = [
        line
        for line in text.split("\n")
        if line.startswith(NAMES) and (m := _NAME.match(line)) and m.group() in wanted
    ]
    return "\n".join(keep) + "\n"


def library_samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [
        (s.name, dict(s.labels), s.value)
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    ]


def ways(page: str) -> dict[str, Callable[[], object]]:
    return {
        "library, whole page": lambda: list(text_string_to_metric_families(page)),
        "library, picked lines": lambda: list(text_string_to_metric_families(picked(page))),
        "promtext.parse": lambda: promtext.parse(page, NAMES),
        "parse_gauges": lambda: parse_gauges(page),
    }


def time_page(page: str, rounds: int) -> dict[str, float]:
    """Median microseconds per call of each way over `rounds` interleaved rounds."""
    ours = [(s.name, dict(s.labels), s.value) for s in promtext.parse(page, NAMES)]
    if library_samples(picked(page)) != ours:
        raise SystemExit("promtext and prometheus_client disagree on this page")
    calls = ways(page)
    batch = {}
    for name, call in calls.items():
        t0 = time.perf_counter()
        call()
        batch[name] = max(1, round(BATCH_S / max(time.perf_counter() - t0, 1e-7)))
    times: dict[str, list[float]] = {name: [] for name in calls}
    order = list(calls)
    for r in range(rounds):
        for name in order[r % len(order) :] + order[: r % len(order)]:
            call, n = calls[name], batch[name]
            t0 = time.perf_counter()
            for _ in range(n):
                call()
            times[name].append((time.perf_counter() - t0) / n * 1e6)
    return {name: statistics.median(ts) for name, ts in times.items()}


def run(quick: bool) -> dict[str, Any]:
    rounds = 5 if quick else 30
    pages = {"emulator": emulator_page(), "vLLM 0.32.0 families": fixture_page()}
    rows = []
    for page_name, page in pages.items():
        us = time_page(page, rounds)
        base = us["promtext.parse"]
        for way, t in us.items():
            rows.append(
                {
                    "page": page_name,
                    "lines": page.count("\n"),
                    "bytes": len(page),
                    "way": way,
                    "us_per_page": round(t, 1),
                    "x promtext": round(t / base, 2),
                }
            )
    return {"rounds": rounds, "rows": rows}


def render(doc: dict[str, Any]) -> str:
    cols = ["page", "lines", "bytes", "way", "us_per_page", "x promtext"]
    return (
        "### Reading a vLLM /metrics page: prometheus_client vs promtext\n\n"
        f"Median of {doc['rounds']} interleaved rounds; microseconds per page.\n\n"
        + benchutil.md_table(doc["rows"], cols)
    )


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="5 rounds instead of 30")
    ap.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = ap.parse_args(argv)
    benchutil.measure_and_report(lambda: run(args.quick), render, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
