"""Probe accuracy and wall time against the emulator, per hidden true profile.

For each profile (A40-like, H100-like, and an A40 host with large fixed overheads) two emulators
serve it (decode pod + prefill peer, loopback, jitter 3%); `disaggpool.calibration.probe` probes
them within the budget; we print every fitted constant against the truth, the held-out TTFT and
TPOT errors, the verdict and the wall time. Usage:

    .venv/bin/python bench/probe_accuracy.py [--budget 60] [--json FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

from disaggpool.calibration.probe import ProbeConfig, run_probe
from disaggpool.core.hardware import builtin_profile
from disaggpool.core.profile import CalibrationProfile, DecodeModel, KVTransferModel, PrefillModel
from disaggpool.emulator.config import EmulatorConfig
from disaggpool.emulator.harness import EmulatorThread

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget", type=float, default=60.0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = []
    for true in PROFILES:
        cfg = EmulatorConfig(true, port=0, side_channel_port=0, jitter=0.03, seed=7)
        with (
            EmulatorThread(cfg) as decode,
            EmulatorThread(dataclasses.replace(cfg, seed=8)) as peer,
        ):
            start = time.perf_counter()
            result = run_probe(
                ProbeConfig(
                    endpoint=decode.url,
                    peer=peer.url,
                    budget_s=args.budget,
                    max_num_seqs=true.max_num_seqs,
                    max_num_batched_tokens=true.max_num_batched_tokens,
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
