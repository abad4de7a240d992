"""`disaggpool pd-proxy --listen HOST:PORT --model-server URL ...`: serve until SIGINT/SIGTERM.

Every flag may also come from the environment as DISAGGPOOL_PD_PROXY_<FLAG> (for a container
spec), e.g. DISAGGPOOL_PD_PROXY_MODEL_SERVER. A bad value exits 2 naming the flag.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from disaggpool.errors import InputError

__all__ = ["register"]


def _env(name: str, default: Any = None) -> Any:
    return os.environ.get(f"DISAGGPOOL_PD_PROXY_{name.upper()}", default)


def _number(args: argparse.Namespace, name: str, kind: type = float) -> Any:
    value = getattr(args, name)
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise InputError(
            "pd-proxy", "--" + name.replace("_", "-"), f"not a number: {value!r}"
        ) from None


def _run(args: argparse.Namespace) -> int:
    from disaggpool.pdproxy.app import run_forever
    from disaggpool.pdproxy.config import ProxyConfig

    if not args.model_server:
        raise InputError("pd-proxy", "--model-server", "required (the local vLLM's URL)")
    config = ProxyConfig(
        listen=args.listen,
        model_server=args.model_server,
        api_keys_file=args.api_keys_file or "",
        upstream_api_key_file=args.upstream_api_key_file or "",
        allow_unauthenticated=bool(args.allow_unauthenticated),
        connect_timeout_s=_number(args, "connect_timeout_s"),
        prefill_timeout_s=_number(args, "prefill_timeout_s"),
        decode_timeout_s=_number(args, "decode_timeout_s"),
        idle_timeout_s=_number(args, "idle_timeout_s"),
        max_body_bytes=_number(args, "max_body_bytes", int),
        debug_errors=bool(args.debug_errors),
    ).check()  # InputError -> exit 2 naming the flag
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    run_forever(config)
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser(
        "pd-proxy",
        help="decode-side P/D proxy beside a decode pod's vLLM (x-prefiller-host-port)",
        description="Run vLLM's prefill leg on the prefill pod named in x-prefiller-host-port, "
        "then the decode leg on the local vLLM (docs/pd-proxy.md).",
    )
    p.add_argument(
        "--listen",
        default=_env("listen", "127.0.0.1:8001"),
        metavar="HOST:PORT",
        help="where to listen (default 127.0.0.1:8001); beyond loopback only with "
        "--api-keys-file or --allow-unauthenticated",
    )
    p.add_argument(
        "--model-server",
        default=_env("model_server"),
        metavar="URL",
        help="the local vLLM, e.g. http://127.0.0.1:8000 (required)",
    )
    p.add_argument(
        "--api-keys-file",
        default=_env("api_keys_file"),
        metavar="FILE",
        help="clients' API keys, one per line (re-read when it changes): every path "
        "but /health and /metrics then needs Authorization: Bearer <key>",
    )
    p.add_argument(
        "--upstream-api-key-file",
        default=_env("upstream_api_key_file"),
        metavar="FILE",
        help="the pods' key (vLLM's --api-key), sent on both legs",
    )
    p.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        default=_env("allow_unauthenticated", "") not in ("", "0", "false"),
        help="listen beyond loopback without API keys (only where a NetworkPolicy "
        "admits the gateway alone)",
    )
    p.add_argument(
        "--prefill-timeout-s",
        default=_env("prefill_timeout_s", 60.0),
        help="one prefill leg, whole (default 60); past it the next host is tried",
    )
    p.add_argument(
        "--connect-timeout-s",
        default=_env("connect_timeout_s", 5.0),
        help="connecting to a pod (default 5)",
    )
    p.add_argument(
        "--decode-timeout-s",
        default=_env("decode_timeout_s", 600.0),
        help="the decode leg or any other request, whole (default 600)",
    )
    p.add_argument(
        "--idle-timeout-s",
        default=_env("idle_timeout_s", 60.0),
        help="the longest silence inside a streamed answer (default 60)",
    )
    p.add_argument(
        "--max-body-bytes",
        default=_env("max_body_bytes", 4 * 1024 * 1024),
        help="request bodies larger than this get 413 (default 4 MiB)",
    )
    p.add_argument(
        "--debug-errors",
        action="store_true",
        help="error bodies name the failing host (logs always do)",
    )
    p.add_argument("--verbose", action="store_true", help="debug logging")
    p.set_defaults(func=_run)
