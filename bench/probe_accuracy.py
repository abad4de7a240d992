"""Probe accuracy and wall time against the emulator, per hidden true profile.

For each profile (A40-like, H100-like, and an A40 host with large fixed overheads) two emulators
serve it (decode pod + prefill peer, loopback, jitter 3%); `disaggpool.calibration.probe` probes
them within the budget; we print every fitted constant against the truth, the held-out TTFT and
TPOT errors, the verdict and the wall time. By default each emulator is its own process, pinned to
CPU 0 while the probe runs on CPU 1 (as a probe Job and a vLLM pod would be) and polls instead of
sleeping (`calibrate --busy-poll`); `--threads` runs them as threads of the probe's process
instead (sharing its interpreter lock; the probe then sleeps as usual). Usage:

    .venv/bin/python bench/probe_accuracy.py [--budget 60] [--threads | --no-busy-poll]
        [--only NAME] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from disaggpool.calibration.probe import ProbeConfig, run_probe
from disaggpool.core.hardware import builtin_profile
from disaggpool.core.profile import CalibrationProfile, DecodeModel, KVTransferModel, PrefillModel
from disaggpool.emulator.config import EmulatorConfig
from disaggpool.emulator.harness import EmulatorThread
from disaggpool.formats.profiles import save_profile

A40 = builtin_profile("a40-llama3-8b")
PROFILES = [
    A40,
    builtin_profile("h100-llama3-8b"),
    dataclasses.replace(
        A40,
        name="a40-slow-host",
        prefill=PrefillModel(0.040, A40.prefill.p1, A40.prefill.p2),
        decode=DecodeModel(0.060, 5e-4, A40.decode.d2),
        kv_transfer=KVTransferModel(0.020, A40.kv_transfer.bytes_per_token, 10e9),
    ),
]


def constants(p: CalibrationProfile) -> dict[str, float]:
    return {
        "p0": p.prefill.p0,
        "p1": p.prefill.p1,
        "p2": p.prefill.p2,
        "d0": p.decode.d0,
        "d1": p.decode.d1,
        "d2": p.decode.d2,
        "k0": p.kv_transfer.k0,
        "s_per_token": p.kv_transfer.bytes_per_token / p.kv_transfer.bandwidth_bytes_per_s,
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def emulator_processes(true: CalibrationProfile) -> Iterator[tuple[str, str]]:
    """(decode URL, peer URL): two `disaggpool emulate` processes pinned to CPU 0."""
    pin = ["taskset", "-c", "0"] if (os.cpu_count() or 1) >= 2 else []
    procs = []
    urls = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "true.yaml"
        save_profile(true, path)
        try:
            for seed in (7, 8):
                port = _free_port()
                env = {
                    **os.environ,
                    "VLLM_NIXL_SIDE_CHANNEL_PORT": str(_free_port()),
                    "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                }
                cmd = [
                    *pin,
                    sys.executable,
                    "-m",
                    "disaggpool",
                    "emulate",
                    "--profile",
                    str(path),
                    "--port",
                    str(port),
                    "--seed",
                    str(seed),
                    "--jitter",
                    "0.03",
                ]
                procs.append(
                    subprocess.Popen(
                        cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
                    )
                )
                urls.append(f"http://127.0.0.1:{port}")
            for url in urls:
                for _ in range(300):
                    try:
                        urllib.request.urlopen(f"{url}/health", timeout=1)
                        break
                    except OSError:
                        time.sleep(0.1)
            yield urls[0], urls[1]
        finally:
            for p in procs:
                p.terminate()
                p.wait(10)


@contextlib.contextmanager
def emulator_threads(true: CalibrationProfile) -> Iterator[tuple[str, str]]:
    cfg = EmulatorConfig(true, port=0, side_channel_port=0, jitter=0.03, seed=7)
    with EmulatorThread(cfg) as decode, EmulatorThread(dataclasses.replace(cfg, seed=8)) as peer:
        yield decode.url, peer.url


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget", type=float, default=60.0)
    parser.add_argument("--threads", action="store_true", help="emulators as threads")
    parser.add_argument(
        "--no-busy-poll", action="store_true", help="the probe sleeps while it waits"
    )
    parser.add_argument("--only", help="one profile name")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = []
    pods = emulator_threads if args.threads else emulator_processes
    if not args.threads and (os.cpu_count() or 1) >= 2:
        os.sched_setaffinity(0, {1})
    for true in PROFILES:
        if args.only and true.name != args.only:
            continue
        with pods(true) as (decode, peer):
            start = time.perf_counter()
            result = run_probe(
                ProbeConfig(
                    endpoint=decode,
                    peer=peer,
                    budget_s=args.budget,
                    max_num_seqs=true.max_num_seqs,
                    max_num_batched_tokens=true.max_num_batched_tokens,
                    # On its own CPU the probe polls (`calibrate --busy-poll`); sharing the
                    # emulators' interpreter it must not.
                    busy_poll=not (args.threads or args.no_busy_poll),
                )
            )
            wall = time.perf_counter() - start
        got, want = constants(result.profile), constants(true)
        errors = {k: abs(got[k] - want[k]) / want[k] for k in want}
        rows.append(
            {
                "profile": true.name,
                "wall_s": round(wall, 1),
                "quality": result.profile.quality,
                "ttft_mape": result.profile.ttft_mape,
                "tpot_mape": result.profile.tpot_mape,
                **{f"err_{k}": round(v, 3) for k, v in errors.items()},
            }
        )
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
