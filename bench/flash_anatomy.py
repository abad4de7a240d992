"""Where the goodput of `sim autoscale`'s flash crowd goes: ours against KEDA's queue scaler.

`flash` runs a seventh of the peak, then the peak for two minutes from 40% of the run (720-840 s of
1,800), then a seventh again; a new pod serves 60 s after it is asked for. Every autoscaler loses
a third or more of the run's goodput there (docs/results/autoscaling.md). This bench splits each
run by arrival time: before the crowd, the crowd and the minute after it (720-900 s), after; and
in the crowd, in 20 s steps, how long prompts waited for prefill and then for their first decoded
token, and how many went to the prefill and decode pods that were serving when the crowd began
(which hold the queues of its first minute), against the pods the autoscaler started for it.
With `--priority` the engines schedule by priority and the router gives priority 1 to the
requests it predicts late (`router.priorityScheduling`).

Run: ``PYTHONPATH=src .venv/bin/python bench/flash_anatomy.py [--priority] [--seeds 1,2,3]
[--json FILE]`` (about a minute on 2 cores). Its outputs are `bench/flash_anatomy.json` and
`bench/flash_anatomy_priority.json`, quoted in docs/results/autoscaling.md ("flash").
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from disaggpool.engine.request import EngineRequest
from disaggpool.sim.cluster import SimOutcome
from disaggpool.studies.autoscale_study import (
    AutoscaleConfig,
    AutoscaleSpec,
    autoscale_row,
    run_autoscale,
    simulate_autoscale,
)
from disaggpool.studies.autoscale_traffic import FLASH_AT, FLASH_S

AUTOSCALERS = ("disaggpool", "keda_queue")
STEP_S = 20.0


def anatomy(spec: AutoscaleSpec) -> dict[str, Any]:
    """The study's row for `spec`, without its timeline, plus the split by arrival time."""
    outcome, controller = simulate_autoscale(spec)
    row = autoscale_row(spec, outcome, controller)
    del row["timeline"]
    start = FLASH_AT * AutoscaleConfig().duration_s  # the study's default run, as main's
    row.update(_split(spec, outcome, start, start + FLASH_S + 60.0))
    return row


def _split(spec: AutoscaleSpec, outcome: SimOutcome, start: float, end: float) -> dict[str, Any]:
    slo = {c.name: c for c in spec.slo_classes}

    def met(r: EngineRequest) -> bool:
        return r.finish >= 0 and slo[r.slo_class].met(r.ttft, r.tpot)

    phases = {"before": (-1.0, start), "crowd": (start, end), "after": (end, float("inf"))}
    goodput = {}
    for name, (lo, hi) in phases.items():
        rs = [r for r in outcome.requests if lo <= r.arrival < hi]
        goodput[name] = round(sum(map(met, rs)) / len(rs), 4) if rs else None
    # The prefill and decode pods serving when the crowd began: those given its arrivals before
    # any pod asked for at its start could serve (local prefills name no prefill pod).
    first = start + spec.bounds.startup_s
    first_minute = [r for r in outcome.requests if start <= r.arrival < first]
    old = {r.prefill_instance for r in first_minute} - {""}
    old_decode = {r.decode_instance for r in first_minute} - {""}
    steps = []
    t = start
    while t < end:
        rs = [r for r in outcome.requests if t <= r.arrival < t + STEP_S and r.prefill_instance]
        waits = [r.prefill_done - r.arrival for r in rs if r.prefill_done >= 0]
        # From the prompt's prefill to the first token: the KV's transfer and the decode queue.
        decode_waits = [r.first_token - r.prefill_done for r in rs if r.first_token >= 0]
        steps.append(
            {
                "from_s": round(t - start),
                "requests": len(rs),
                "goodput": round(sum(map(met, rs)) / len(rs), 3) if rs else None,
                "prefill_wait_p50_s": round(statistics.median(waits), 2) if waits else None,
                "decode_wait_p50_s": (
                    round(statistics.median(decode_waits), 2) if decode_waits else None
                ),
                "to_old_pods": sum(r.prefill_instance in old for r in rs),
                "to_old_decode_pods": sum(r.decode_instance in old_decode for r in rs),
            }
        )
        t += STEP_S
    return {
        "goodput_by_phase": goodput,
        "old_prefill_pods": len(old),
        "old_decode_pods": len(old_decode),
        "crowd": steps,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--priority", action="store_true", help="engines schedule by priority")
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    cfg = AutoscaleConfig(
        shapes=("flash",),
        autoscalers=AUTOSCALERS,
        seeds=tuple(int(s) for s in args.seeds.split(",")),
        priority_scheduling=args.priority,
    )
    rows = run_autoscale(cfg, workers=args.workers, run=anatomy)["experiments"]["autoscale"]
    table = _table(rows)
    print(table)
    if args.json:
        doc: dict[str, Any] = {
            "config": {"seeds": list(cfg.seeds), "priority_scheduling": args.priority}
        }
        doc |= {"rows": rows, "table": table}
        args.json.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")


def _table(rows: list[dict[str, Any]]) -> str:
    """Per autoscaler, means over the seeds: goodput overall and by phase, GPU-hours; then the
    crowd's steps (median prefill wait, share to the old pods, goodput)."""
    lines = [
        "| autoscaler | goodput | before | crowd + 60 s | after | GPU-hours | old prefill pods "
        "| old decode pods |",
        "|---|---|---|---|---|---|---|---|",
    ]
    steps = [
        "",
        "| autoscaler | arrivals from (s) | prefill wait p50 (s) | to old pods | decode wait "
        "p50 (s) | to old decode pods | goodput |",
    ]
    steps.append("|---|---|---|---|---|---|---|")
    for name in AUTOSCALERS:
        mine = [r for r in rows if r["autoscaler"] == name]
        if not mine:
            continue

        def mean(get: Any, rs: list[dict[str, Any]] = mine) -> float:
            return statistics.fmean(get(r) for r in rs)

        phase = {
            p: mean(lambda r, p=p: r["goodput_by_phase"][p]) for p in ("before", "crowd", "after")
        }
        lines.append(
            f"| {name} | {mean(lambda r: r['goodput']):.3f} | {phase['before']:.3f} | "
            f"{phase['crowd']:.3f} | {phase['after']:.3f} | {mean(lambda r: r['gpu_hours']):.2f} "
            f"| {mean(lambda r: r['old_prefill_pods']):.1f} "
            f"| {mean(lambda r: r['old_decode_pods']):.1f} |"
        )
        for i, step in enumerate(mine[0]["crowd"]):
            at = [r["crowd"][i] for r in mine]
            waits = [s["prefill_wait_p50_s"] for s in at if s["prefill_wait_p50_s"] is not None]
            sent = max(1, sum(s["requests"] for s in at))
            share = sum(s["to_old_pods"] for s in at) / sent
            decode_share = sum(s["to_old_decode_pods"] for s in at) / sent
            decode_waits = [
                s["decode_wait_p50_s"] for s in at if s["decode_wait_p50_s"] is not None
            ]
            good = [s["goodput"] for s in at if s["goodput"] is not None]
            steps.append(
                f"| {name} | {step['from_s']} | {statistics.fmean(waits):.1f} | {share:.0%} | "
                f"{statistics.fmean(decode_waits):.1f} | {decode_share:.0%} | "
                f"{statistics.fmean(good):.3f} |"
            )
    return "\n".join(lines + steps)


if __name__ == "__main__":
    main()
