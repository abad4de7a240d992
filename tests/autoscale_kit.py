"""The hand-computed profile and traffic the autoscaling tests share (tests/core)."""

from __future__ import annotations

from disaggpool.core.demand import Demand
from disaggpool.core.profile import CalibrationProfile, DecodeModel, KVTransferModel, PrefillModel

Z90 = 1.2815515655446004  # Phi^-1(0.9)

# step(b) = 0.01 + 1e-6 * b * 1000 = 0.01 + 0.001 b at a 1,000-token mean context.
PROFILE = CalibrationProfile(
    name="hand",
    prefill=PrefillModel(0.01, 1e-4, 0.0),
    decode=DecodeModel(0.01, 0.0, 1e-6),
    kv_transfer=KVTransferModel(0.002, 1.0, 1e9),
    kv_capacity_tokens=30_000,
    max_num_seqs=256,
    max_num_batched_tokens=2048,
    quality="good",
)


def demand(**over: object) -> Demand:
    base = dict(
        now=1000.0,
        window_s=60.0,
        arrival_rps=10.0,
        rate_slope=0.0,
        dispersion=1.0,
        bursts_known=True,
        mean_prompt=900.0,
        mean_output=200.0,
        work_cv=0.0,
        slot_context=1000.0,
        slot_cv=0.0,
        ttft_ratio_p90=0.5,
        tpot_ratio_p90=0.5,
        finished=100,
    )
    base.update(over)
    return Demand(**base)  # type: ignore[arg-type]
