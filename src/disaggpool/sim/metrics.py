"""Run metrics: goodput (fraction of requests meeting their SLO), latency percentiles, load.

Goodput follows the study: a request counts when its TTFT and its TPOT (mean time per output token
after the first) both meet its class's targets; a request that was rejected or never finished
counts as missed. Every miss is attributed to the term that broke (`misses`: TTFT only, TPOT only,
both, shed by the router, or never finished), so an experiment says which pool limited it: TTFT
misses come from prefill queueing and decode admission, TPOT misses from crowded decode batches.
Percentiles are nearest-rank, so results are exact and deterministic. Called by
`sim.runner.execute` for every simulated run; pure. The percentile itself is
`core.stats.percentile`, shared with the load generator so both report the same statistic.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from disaggpool.core.contracts import SLOClass
from disaggpool.core.stats import percentile
from disaggpool.sim.cluster import SimOutcome

__all__ = ["latency_percentiles", "summarize"]


def latency_percentiles(
    ttfts: Sequence[float], tpots: Sequence[float], digits: int | None = 6
) -> dict[str, float]:
    """``ttft_p50_s`` ... ``tpot_p99_s``: p50, p90 and p99 of each, nearest rank, rounded to
    `digits` (a run's row) or not at all (None)."""
    out = {}
    for name, values in (("ttft", ttfts), ("tpot", tpots)):
        for q in (50, 90, 99):
            p = percentile(values, q)
            out[f"{name}_p{q}_s"] = p if digits is None else round(p, digits)
    return out


def summarize(outcome: SimOutcome, slo_classes: Mapping[str, SLOClass]) -> dict[str, Any]:
    """Goodput and percentiles overall and per SLO class, plus per-instance load."""
    per_class: dict[str, dict[str, list[float]]] = {}
    misses = {"ttft": 0, "tpot": 0, "both": 0, "shed": 0, "unfinished": 0}
    met_total = 0
    ttfts: list[float] = []
    tpots: list[float] = []
    for r in outcome.requests:
        bucket = per_class.setdefault(r.slo_class, {"ttft": [], "tpot": [], "met": []})
        if r.finish < 0:
            bucket["met"].append(0.0)
            misses["shed" if r.shed else "unfinished"] += 1
            continue
        ttft, tpot = r.ttft, r.tpot
        slo = slo_classes[r.slo_class]
        late, slow = ttft > slo.ttft_s, tpot > slo.tpot_s
        met = not (late or slow)
        if not met:
            misses["both" if late and slow else "ttft" if late else "tpot"] += 1
        met_total += met
        bucket["met"].append(1.0 if met else 0.0)
        bucket["ttft"].append(ttft)
        bucket["tpot"].append(tpot)
        ttfts.append(ttft)
        tpots.append(tpot)
    n = len(outcome.requests)
    classes = {
        name: {
            "requests": len(b["met"]),
            "goodput": round(sum(b["met"]) / len(b["met"]), 6),
            **latency_percentiles(b["ttft"], b["tpot"]),
        }
        for name, b in sorted(per_class.items())
    }
    return {
        "requests": n,
        "completed": len(ttfts),
        "rejected": len(outcome.rejected),
        "shed": len(outcome.shed),
        "goodput": round(met_total / n, 6) if n else math.nan,
        "misses": misses,
        **latency_percentiles(ttfts, tpots),
        "classes": classes,
        "preemptions": sum(outcome.preemptions.values()),
        "served": dict(sorted(outcome.served.items())),
        "makespan_s": round(outcome.end_time, 6),
    }
