"""Run every benchmark in this folder and print one markdown report with the machine it ran on.

Runs `sim_throughput` (simulated requests per wall-clock second per policy on the 8-GPU A40
paper pool, plus the peak memory of a one-hour run) and `decision_cost` (the cost of one
``policy.route`` call for 8, 32 and 128 decode instances), in this order, in one process (the
memory run spawns its own fresh subprocesses). The report starts with the machine: CPU model
from /proc/cpuinfo, core count, CPU affinity, Python version, the load average at the start and
at the end, and the CPU other processes used during the run in cores (/proc/stat busy time minus
this process tree's own; 0 means a quiet machine). When other work shared the cores, the ratios
against round-robin measured in the same run are the figures that survive it.

Run: ``.venv/bin/python bench/run_all.py [--quick] [--json FILE]``; ``--quick`` passes on to both.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

import benchutil
import decision_cost
import sim_throughput


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the quick variant of every benchmark")
    ap.add_argument("--json", metavar="FILE", help="also write all results as one JSON document")
    args = ap.parse_args(argv)

    machine = benchutil.machine_info()
    t0 = time.perf_counter()
    contention = benchutil.Contention()
    doc: dict[str, Any] = {"quick": args.quick, "machine": machine}
    doc["sim_throughput"] = sim_throughput.run(args.quick)
    doc["decision_cost"] = decision_cost.run(args.quick)
    doc["elapsed_s"] = round(time.perf_counter() - t0, 1)
    machine["load_average_at_end"] = benchutil.load_average()
    machine["other_processes_cpu_cores_during_run"] = contention.other_cores()

    print(f"## disaggpool benchmarks ({'quick' if args.quick else 'full'})\n")
    print(benchutil.machine_table(machine))
    print(sim_throughput.render(doc["sim_throughput"]))
    print(decision_cost.render(doc["decision_cost"]))
    print(f"Total benchmark time: {doc['elapsed_s']} s.")
    benchutil.write_json(args.json, doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
