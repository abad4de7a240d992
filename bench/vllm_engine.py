"""One real vLLM engine on this CPU, for the benches that hold the engine model against it.

vLLM 0.32.0 (`python -m vllm.entrypoints.openai.api_server`) with the tiny Llama of the real-vLLM
suite, both built by `scripts/vllm_env.sh`: `real_engine` starts it with its model worker bound to
a CPU of its own (`cpu_split`: the last one; its API server and engine core on the others) and
stops its whole process group; `warm_up` pays its lazy initialisation; `probe_engine` fits its
profile as the operator's Job does, a poor fit probed again; `counter` and `busy_shares` read the
engine's counters and how busy each CPU was. Used by `engine_fidelity.py`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import benchutil
from disaggpool import promtext
from disaggpool.calibration.probe import ProbeConfig, ProbeResult, run_probe
from disaggpool.core.profile import profile_to_dict
from disaggpool.localpool.processes import free_port
from disaggpool.operator.spec import DEFAULT_MAX_PROBE_ATTEMPTS

VENV = Path(os.environ.get("DISAGGPOOL_VLLM_VENV", "/var/cache/disaggpool/vllm-venv"))
MODEL = Path(os.environ.get("DISAGGPOOL_VLLM_MODEL", "/var/cache/disaggpool/tiny-llama"))
SERVED = "tiny"
MAX_MODEL_LEN = 2048
MAX_NUM_SEQS = 64
MAX_BATCHED_TOKENS = 2048
PROBE_ATTEMPTS = DEFAULT_MAX_PROBE_ATTEMPTS  # the operator's default `calibration.maxAttempts`


def cpu_split() -> tuple[int, set[int]]:
    """(the engine core's CPU, the CPUs for everything else): the last CPU this process may use
    for the engine, the rest for its API server, this process and the load generator (all of
    them on one machine with a single CPU). Taken before this process pins itself."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return cpus[0], set(cpus)
    return cpus[-1], set(cpus[:-1])


@contextlib.contextmanager
def real_engine(
    log_dir: Path, engine_cpu: int, other_cpus: set[int], timeout_s: float = 360.0
) -> Iterator[str]:
    """A real vLLM engine on a free loopback port (its URL), stopped with its process group:
    its model worker bound to `engine_cpu`, its API server and engine core to `other_cpus`."""
    if not (VENV / "bin" / "python").exists() or not (MODEL / "config.json").exists():
        raise SystemExit(
            f"real vLLM missing ({VENV}, {MODEL}): build it with `bash scripts/vllm_env.sh`"
        )
    port = free_port()
    cmd = [
        *("taskset", "-c", ",".join(map(str, sorted(other_cpus)))),
        str(VENV / "bin" / "python"),
        "-m",
        "vllm.entrypoints.openai.api_server",
        *("--model", str(MODEL), "--served-model-name", SERVED, "--dtype", "float32"),
        *("--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(MAX_MODEL_LEN)),
        *("--max-num-seqs", str(MAX_NUM_SEQS)),
        *("--max-num-batched-tokens", str(MAX_BATCHED_TOKENS)),
        "--no-enable-prefix-caching",
    ]
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"PYTHONPATH", "VIRTUAL_ENV", "PROMETHEUS_MULTIPROC_DIR", "PYTHONHOME"}
    }
    env.update(
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CPU_OMP_THREADS_BIND=str(engine_cpu),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        PATH=f"{VENV / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}",
    )
    log_path = log_dir / f"vllm-{port}.log"
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        deadline = time.monotonic() + timeout_s
        while not _healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = log_path.read_text(errors="replace").splitlines()[-30:]
                raise SystemExit("vLLM did not come up:\n" + "\n".join(tail))
            time.sleep(1.0)
        yield url
    finally:
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=wait)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as resp:
            return bool(resp.status == 200)
    except (OSError, urllib.error.URLError):
        return False


def counter(url: str, name: str) -> float:
    """The engine's counter `name` now, summed over its labels."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return promtext.total(promtext.parse(text, [name]), name)


def busy_shares(before: dict[str, tuple[int, int]]) -> dict[str, float]:
    """Per CPU, the share of the time since `before` (`benchutil.proc_stat_ticks`) it was busy
    (all processes)."""
    after = benchutil.proc_stat_ticks()
    return {
        c: round((after[c][0] - b[0]) / max(1, after[c][1] - b[1]), 3)
        for c, b in before.items()
        if c != "cpu"
    }


def warm_up(url: str) -> None:
    """The first requests to a fresh API server pay its lazy initialisation."""
    body = json.dumps({"model": SERVED, "prompt": [5] * 300, "max_tokens": 8}).encode()
    for _ in range(3):
        req = urllib.request.Request(
            url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=120) as resp:
            resp.read()


def probe_engine(url: str, budget: float, seed: int) -> tuple[ProbeResult, list[dict[str, Any]]]:
    """Probe the engine as the operator does (a poor fit probed again, each attempt with its own
    seed): (the last `ProbeResult`, every attempt's verdict, errors and decode samples)."""
    attempts = []
    for attempt in range(PROBE_ATTEMPTS):
        probe = run_probe(
            ProbeConfig(
                endpoint=url,
                role="decode",
                name="real-vllm-cpu",
                budget_s=budget,
                max_num_seqs=MAX_NUM_SEQS,
                max_num_batched_tokens=MAX_BATCHED_TOKENS,
                gpu="cpu",
                seed=seed + attempt,
            )
        )
        fit = probe.profile
        attempts.append(
            {
                "quality": fit.quality,
                "ttft_mape": fit.ttft_mape,
                "tpot_mape": fit.tpot_mape,
                "decode": profile_to_dict(fit)["decode"],
                "samples": probe.report["samples"],
                # (batch, context tokens, inter-token seconds): what the decode fit saw.
                "decode_measurements": probe.report["measurements"]["decode"],
            }
        )
        if fit.quality != "poor":
            break
        print(f"[fidelity] fit poor ({attempts[-1]['tpot_mape']}): probing again", file=sys.stderr)
    return probe, attempts


def request_path(report: dict[str, Any]) -> dict[str, Any]:
    """The probe's fit of the request path outside the engine, as this bench records it."""
    overhead = report["http_overhead"]
    return {
        "from": overhead["from"],
        "base_s": overhead["seconds"],
        "per_prompt_token_s": overhead["seconds_per_prompt_token"],
    }
