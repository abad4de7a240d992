"""Building simulated pools: per-instance true profiles and the profiles the router believes.

A pool of one GPU type is never perfectly homogeneous: boards of the same SKU sustain different
clocks (cooling, power limits, PCIe placement). Each instance's *true* profile is the nominal one
scaled by a speed factor drawn from a log-normal with ``speed_sigma`` (5% by default), fixed by
the seed. What the calibrated router believes is what a probe would fit: the true constants, each
off by a relative error drawn from N(0, ``fit_error``) (3% by default, the size of the held-out
errors our probe reports). The uncalibrated router believes the datasheet profile everywhere.

Pure; called by `studies.paper_setup` and `sim.scenario`.
"""

from __future__ import annotations

import dataclasses
import math
import random

from disaggpool.core.profile import CalibrationProfile, DecodeModel, KVTransferModel, PrefillModel
from disaggpool.sim.cluster import InstanceSpec

__all__ = ["build_pool", "perturbed"]


def perturbed(
    profile: CalibrationProfile, rng: random.Random, rel_error: float
) -> CalibrationProfile:
    """`profile` with every time constant off by an independent relative error ~ N(0, rel_error)."""

    def e(x: float) -> float:
        return max(0.0, x * (1.0 + rng.gauss(0.0, rel_error)))

    pf, dm, kv = profile.prefill, profile.decode, profile.kv_transfer
    return dataclasses.replace(
        profile,
        prefill=PrefillModel(e(pf.p0), e(pf.p1), e(pf.p2)),
        decode=DecodeModel(e(dm.d0), e(dm.d1), e(dm.d2)),
        kv_transfer=KVTransferModel(e(kv.k0), kv.bytes_per_token, kv.bandwidth_bytes_per_s),
        source="probe",
        quality="good",
    )


def build_pool(
    n_prefill: int,
    n_decode: int,
    nominal: CalibrationProfile,
    seed: int,
    *,
    speed_sigma: float = 0.05,
    fit_error: float = 0.03,
) -> list[InstanceSpec]:
    """Instances ``prefill-0..`` and ``decode-0..`` with seeded speed spread and fit error."""
    rng = random.Random(f"pool:{seed}")
    specs = []
    for role, count in (("prefill", n_prefill), ("decode", n_decode)):
        for i in range(count):
            name = f"{role}-{i}"
            speed = math.exp(rng.gauss(0.0, speed_sigma)) if speed_sigma else 1.0
            true = nominal.scaled(speed, name=name)
            specs.append(InstanceSpec(name, role, true, perturbed(true, rng, fit_error)))
    return specs
