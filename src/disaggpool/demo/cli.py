"""`disaggpool demo`: its command-line arguments, and the command itself.

`register` adds the subcommand to the `disaggpool` parser (`disaggpool.cli`); `config_from_args`
turns its arguments into a `DemoConfig` (`--trace mooncake` brings its own pool and policies).
"""

from __future__ import annotations

import argparse
import signal
from typing import Any

from disaggpool.demo.design import (
    MIN_PODS_PER_ROLE,
    MOONCAKE_DECODE_SPEEDS,
    MOONCAKE_POLICIES,
    MOONCAKE_PREFILL_SPEEDS,
    POLICIES,
    TRACES,
    DemoConfig,
)
from disaggpool.demo.run import run_demo

__all__ = ["config_from_args", "register"]


def config_from_args(args: argparse.Namespace) -> DemoConfig:
    """The `demo` command's arguments as a config: `--trace mooncake` brings its own pool and
    policies unless `--policies` names others."""
    mooncake = args.trace == "mooncake"
    default = MOONCAKE_POLICIES if mooncake else POLICIES
    policies = tuple(args.policies.split(",")) if args.policies else default
    pool: dict[str, Any] = (
        {"prefill_speeds": MOONCAKE_PREFILL_SPEEDS, "decode_speeds": MOONCAKE_DECODE_SPEEDS}
        if mooncake
        else {}
    )
    return DemoConfig(
        duration_s=args.duration,
        budget_s=args.budget_seconds,
        policies=policies,
        seed=args.seed,
        trace=args.trace,
        min_pods_per_role=args.min_pods_per_role,
        **pool,
    )


def _stop(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def _run(args: argparse.Namespace) -> int:
    # SIGTERM unwinds like Ctrl-C does, so `processes` stops the emulators and sidecars it started
    # (Python's default for SIGTERM is to die on the spot and leave them running).
    signal.signal(signal.SIGTERM, _stop)
    run_demo(config_from_args(args), args.json)
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("demo", help="emulated pool + probe + sidecar + replay, per policy")
    p.add_argument("--duration", type=float, default=30.0, help="trace seconds (default 30)")
    p.add_argument("--budget-seconds", type=float, default=20.0, help="probe budget per pod")
    p.add_argument(
        "--trace",
        choices=TRACES,
        default="azure",
        help="azure (default: four boards, placed by the split search, no prefix caching) or "
        "mooncake (2 + 2 pods, prefix caching, every sidecar with its prefix index)",
    )
    p.add_argument(
        "--policies",
        help=f"comma-separated (default {','.join(POLICIES)}; "
        f"with --trace mooncake {','.join(MOONCAKE_POLICIES)})",
    )
    p.add_argument(
        "--min-pods-per-role",
        type=int,
        default=MIN_PODS_PER_ROLE,
        help=f"the fewest boards the placement search gives either role (default "
        f"{MIN_PODS_PER_ROLE}: both legs have a routing decision; 1 searches every placement)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")
    p.set_defaults(func=_run)
