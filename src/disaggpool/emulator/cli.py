"""`main(argv)`: the command line of the emulator (wired as ``disaggpool emulate``).

    disaggpool emulate --profile NAME|FILE [--port 8000] [--host 127.0.0.1] [--model M]
                       [--side-channel-port 5600]
                       [--served-model-name NAME ...] [--max-model-len N] [--seed S]
                       [--kv-lease-duration 30] [--max-num-queued-reqs N] [--jitter 0.03]
                       [--startup-delay SECONDS] [--[no-]enable-prefix-caching]
                       [--kv-events-config JSON] [--scheduling-policy fcfs|priority]
                       [--api-key KEY ...]

Flags mirror `vllm serve` where vLLM has one. The NIXL side channel is configured as in vLLM,
by `VLLM_NIXL_SIDE_CHANNEL_HOST` (default localhost; advertised as `remote_host`) and
`VLLM_NIXL_SIDE_CHANNEL_PORT` (default 5600; really listened on); vLLM has no flag for the
port, so `--side-channel-port` is the emulator's own and wins over the variable: a second
emulator on one machine needs one. `VLLM_SERVER_DEV_MODE=1`
adds vLLM's development endpoint `POST /reset_prefix_cache`; `VLLM_API_KEY` is the key when
`--api-key` is not given, as in vLLM; `VLLM_HTTP_TIMEOUT_KEEP_ALIVE`
(default 5 s) closes idle HTTP connections as vLLM's server does. Exit codes: 0 after a signal,
2 bad input (the message names the flag or file and the field), 1 anything else (for example a
port already in use: the message names the setting that clashed and how to change it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Sequence

from disaggpool import precise_loop
from disaggpool.emulator.config import (
    EmulatorConfig,
    dev_mode_from_env,
    keep_alive_from_env,
    side_channel_from_env,
)
from disaggpool.emulator.server import serve
from disaggpool.engine.request import SCHEDULING_POLICIES
from disaggpool.errors import InputError
from disaggpool.formats.kv_events import KVEventsConfig, parse_kv_events_config
from disaggpool.formats.profiles import resolve_profile

__all__ = ["build_parser", "config_from_args", "main", "run"]

log = logging.getLogger(__name__)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The emulator's flags, on a new parser or added to a subcommand's."""
    p = parser or argparse.ArgumentParser(
        prog="disaggpool emulate",
        description="Serve a GPU-free stand-in for vLLM 0.33 whose timing follows a profile.",
    )
    p.add_argument("--profile", required=True, help="built-in profile name or profile file")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    p.add_argument("--host", default="127.0.0.1", help="HTTP address (default 127.0.0.1)")
    p.add_argument(
        "--side-channel-port",
        type=int,
        default=None,
        help="port of the NIXL side channel decode pods pull KV through (default: "
        "$VLLM_NIXL_SIDE_CHANNEL_PORT, as vLLM reads it, else 5600); a second emulator on one "
        "machine needs its own; 0 picks a free one. The host is $VLLM_NIXL_SIDE_CHANNEL_HOST "
        "(default localhost)",
    )
    p.add_argument("--model", default="", help="model path or name (default: the profile's)")
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="names the API accepts; the first is the /v1/models id and the metrics label",
    )
    p.add_argument("--max-model-len", type=int, default=None, help="default: the profile's")
    p.add_argument("--seed", type=int, default=0, help="seed of output tokens and jitter")
    p.add_argument(
        "--kv-lease-duration",
        type=float,
        default=30.0,
        help="seconds a prefill leg's KV blocks wait for the decode side (default 30)",
    )
    p.add_argument(
        "--max-num-queued-reqs",
        type=int,
        default=None,
        help="answer 503 while this many requests wait (default: no limit)",
    )
    p.add_argument("--jitter", type=float, default=0.03, help="relative std-dev of iteration times")
    p.add_argument(
        "--startup-delay",
        type=float,
        default=0.0,
        help="seconds before the port listens, like vLLM loading a model (default 0)",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV of cached leading prompt blocks on prefill legs (default: on, as vLLM)",
    )
    p.add_argument(
        "--scheduling-policy",
        choices=SCHEDULING_POLICIES,
        default="fcfs",
        help="fcfs (default) or priority: waiting requests ordered by the request's `priority`",
    )
    p.add_argument(
        "--kv-events-config",
        default=None,
        help="vLLM's KV events config as JSON, e.g. "
        '\'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}\'',
    )
    p.add_argument(
        "--api-key",
        nargs="+",
        default=None,
        help="require one of these keys (Authorization: Bearer) under /v1, as vLLM's --api-key; "
        "default: $VLLM_API_KEY",
    )
    return p


def config_from_args(args: argparse.Namespace) -> EmulatorConfig:
    """Resolve the profile and the side-channel environment; raises `InputError`."""
    profile = resolve_profile(args.profile)
    host, port = side_channel_from_env(port_flag=args.side_channel_port)
    return EmulatorConfig(
        profile=profile,
        model=args.model,
        served_model_names=tuple(args.served_model_name or ()),
        max_model_len=args.max_model_len,
        seed=args.seed,
        kv_lease_duration=args.kv_lease_duration,
        max_num_queued_reqs=args.max_num_queued_reqs,
        jitter=args.jitter,
        startup_delay=args.startup_delay,
        enable_prefix_caching=args.enable_prefix_caching,
        scheduling_policy=args.scheduling_policy,
        server_dev_mode=dev_mode_from_env(),
        http_keep_alive=keep_alive_from_env(),
        kv_events=parse_kv_events_config(args.kv_events_config)
        if args.kv_events_config
        else KVEventsConfig(),
        host=args.host,
        port=args.port,
        side_channel_host=host,
        side_channel_port=port,
        api_keys=tuple(k for k in (args.api_key or [os.environ.get("VLLM_API_KEY", "")]) if k),
    )


async def _run(config: EmulatorConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    running = await serve(config)
    print(
        f"disaggpool emulate: serving {config.served_name} on http://{config.host}:"
        f"{running.port} (side channel {config.side_channel_host}:{running.side_channel_port})",
        file=sys.stderr,
        flush=True,
    )
    try:
        await stop.wait()
    finally:
        await running.close()


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM; `args` from `build_parser` (or a subcommand built with it)."""
    try:
        config = config_from_args(args)
    except InputError as exc:
        print(f"disaggpool emulate: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        # Timers on time to the microsecond: the engines' wake-ups are the profile's timing.
        with asyncio.Runner(loop_factory=precise_loop.new_event_loop) as runner:
            runner.run(_run(config))
    except OSError as exc:
        print(f"disaggpool emulate: {exc}", file=sys.stderr)
        return 1
    return 0
