"""`vllm` in the test image: the operator's `vllm serve ...` command line, run by the emulator.

The test node has no GPU and no room for real engines next to everything else, so the engine
pods the operator renders run `disaggpool emulate` with the settings that command line gives:
model and served names, port, maximum length, KV-event publisher, scheduling policy. The NIXL
side channel comes from the same environment variables vLLM reads (the emulator reads them too).
Flags the emulator has no use for (`--tensor-parallel-size`, `--kv-transfer-config`, whose role
it does not need since it serves either leg, `--enforce-eager`, ...) are accepted and ignored,
as a real engine's would be. `DISAGGPOOL_EMULATOR_PROFILE` picks the emulated hardware (a
built-in profile name; default a40-qwen2.5-3b). `DISAGGPOOL_EMULATOR_STARTUP_DELAY` (seconds,
test-only) keeps the port closed that long first, as a real engine loading its weights does.
`VLLM_API_KEY` reaches the emulator through the environment, as it reaches vLLM. Binds all
addresses, as vLLM does by default.
"""

from __future__ import annotations

import argparse
import os
import sys


def emulate_argv(argv: list[str], env: dict[str, str]) -> list[str]:
    parser = argparse.ArgumentParser(prog="vllm")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve")
    serve.add_argument("model")
    serve.add_argument("--served-model-name", nargs="+")
    serve.add_argument("--host", default="0.0.0.0")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--max-model-len", type=int)
    serve.add_argument("--kv-events-config")
    serve.add_argument("--scheduling-policy")
    args, _ignored = parser.parse_known_args(argv)
    out = [
        "disaggpool",
        "emulate",
        "--profile",
        env.get("DISAGGPOOL_EMULATOR_PROFILE", "a40-qwen2.5-3b"),
    ]
    out += ["--model", args.model, "--host", args.host, "--port", str(args.port)]
    if args.served_model_name:
        out += ["--served-model-name", *args.served_model_name]
    if args.max_model_len:
        out += ["--max-model-len", str(args.max_model_len)]
    if args.kv_events_config:
        out += ["--kv-events-config", args.kv_events_config]
    if args.scheduling_policy:
        out += ["--scheduling-policy", args.scheduling_policy]
    if env.get("DISAGGPOOL_EMULATOR_STARTUP_DELAY"):
        out += ["--startup-delay", env["DISAGGPOOL_EMULATOR_STARTUP_DELAY"]]
    return out


if __name__ == "__main__":
    argv = emulate_argv(sys.argv[1:], dict(os.environ))
    os.execvp(argv[0], argv)
