"""What the demo prints: progress lines on stderr as it goes, the result table on stdout at the end.

`print_table` reads only the result document (`run.run_demo`'s, the one `--json` writes), so a
saved run prints the same table.
"""

from __future__ import annotations

import sys
from typing import Any

from disaggpool.demo.design import TARGET_GOODPUT

__all__ = ["print_table", "say"]


def say(msg: str) -> None:
    """One progress line on stderr, flushed at once (the table goes to stdout)."""
    print(f"[demo] {msg}", file=sys.stderr, flush=True)


def print_table(result: dict[str, Any]) -> None:
    """The result table: the setup, a row per policy, the first policy against each other."""
    setup = result["setup"]
    roles = [pod["role"] for pod in setup["pods"].values()]
    print(
        f"\ndisaggpool demo: {roles.count('prefill')} prefill + {roles.count('decode')} decode "
        f"emulated pods, {setup['trace']} trace, {setup['rate_rps']} req/s for "
        f"{setup['duration_s']:.0f} s; SLO TTFT <= {setup['slo']['ttft_s']:.2f} s, "
        f"TPOT <= {setup['slo']['tpot_s'] * 1000:.0f} ms"
    )
    if len(setup["placements_rps"]) > 1:
        print(
            "placement: the one carrying the most traffic at round-robin's "
            f"{TARGET_GOODPUT} goodput point in the simulator, of "
            + ", ".join(
                f"{name} {rate:.2f}{' (chosen)' if name == setup['placement'] else ''}"
                for name, rate in sorted(setup["placements_rps"].items(), key=lambda kv: -kv[1])
            )
            + " req/s"
        )
    cached = setup["trace"] == "mooncake"
    # With one decode pod, routing decides where each prompt is prefilled: show that instead.
    one_decode = roles.count("decode") == 1
    head = (f"{'policy':<14}{'goodput':>9}{'95% interval':>15}{'simulated (sd)':>16}{'errors':>8}"
            f"{'TTFT p99':>10}"
            f"{'TPOT p99':>10}{'   cached (sim)' if cached else ''}"
            f"  {'prefills per pod' if one_decode else 'decode requests per pod'}")  # fmt: skip
    print(head)
    for r in result["policies"]:
        pools = r["prefilled_by_pod"] if one_decode else r["served_by_pod"]
        served = " ".join(f"{k}={v}" for k, v in pools.items())
        share = (
            f"{r['cached_share'] or 0.0:>9.3f} ({r['cached_share_simulated']:.3f})"
            if cached
            else ""
        )
        print(
            f"{r['policy']:<14}{r['goodput_measured']:>9.3f}"
            f"{r['goodput_ci95'][0]:>9.3f}-{r['goodput_ci95'][1]:.3f}"
            f"{r['goodput_simulated']:>9.3f} "
            f"({r['goodput_simulated_sd']:.3f})"
            f"{r['errors']:>8}{r['ttft_p99_s']:>9.2f}s{r['tpot_p99_s'] * 1000:>8.0f}ms"
            f"{share}  {served}"
        )
    first, *others = result["policies"]
    for r in others:
        lo, hi = r["vs_first_ci95"]
        gap = first["goodput_measured"] - r["goodput_measured"]
        print(
            f"{first['policy']} - {r['policy']}: {100 * gap:+.1f} points "
            f"(95% interval {100 * lo:+.1f} to {100 * hi:+.1f}, paired over the same requests)"
        )
    tied = [r["policy"] for r in others if r["vs_first_ci95"][0] <= 0 <= r["vs_first_ci95"][1]]
    if tied:
        print(
            f"{first['policy']} is not told apart from {', '.join(tied)} by this run: the 95% "
            "interval of the difference includes 0; a longer --duration narrows it."
        )
