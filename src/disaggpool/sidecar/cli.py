"""`disaggpool sidecar --config FILE`: run the routing sidecar until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from disaggpool.sidecar.config import load_config

__all__ = ["register"]


def _run(args: argparse.Namespace) -> int:
    from disaggpool.sidecar.app import run_forever

    config = load_config(args.config)  # InputError -> exit 2 with file and field
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    run_forever(config)
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("sidecar", help="run the gRPC routing sidecar and OpenAI front door")
    p.add_argument("--config", required=True, metavar="FILE", help="see sidecar/CONFIG.md")
    p.add_argument("--verbose", action="store_true", help="debug logging")
    p.set_defaults(func=_run)
