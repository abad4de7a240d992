"""From what the calibration probe measured to its result: TTFTs net of the request path, the
fits, the `CalibrationProfile` and the report.

Pure (no I/O, no clock: the caller passes the elapsed time and the fit's timestamp), so it is
tested on synthetic measurements. `probe` calls `net_of_request_path`, `fit_all` and `assemble`
in that order on the `stages`' `Measured`; the fitting itself is `fit`'s.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from disaggpool.calibration import fit
from disaggpool.calibration.common import Measured, Pod, ProbeConfig, ProbeError, ProbeResult
from disaggpool.core.profile import CalibrationProfile, DecodeModel, KVTransferModel, PrefillModel

__all__ = [
    "DEFAULT_K0_S",
    "DEFAULT_KV_BANDWIDTH",
    "Fits",
    "assemble",
    "fit_all",
    "net_of_request_path",
]

#: KV transfer constants of a profile whose probe had no peer to measure them with.
DEFAULT_K0_S = 0.002
DEFAULT_KV_BANDWIDTH = 20e9


@dataclasses.dataclass(frozen=True)
class Fits:
    prefill: fit.FitResult
    decode: fit.FitResult
    transfer: fit.FitResult | None  # None: no peer, not measured

    def all(self) -> list[fit.FitResult]:
        return [self.prefill, self.decode] + ([self.transfer] if self.transfer else [])


def net_of_request_path(measured: Measured) -> Measured:
    """The same measurements with every TTFT less the request path's cost for its prompt: the
    engine's own time (never below a microsecond)."""
    path = measured.request_path

    def engine_time(n: int, ttft: float) -> float:
        return max(1e-6, ttft - path.base_s - path.per_token_s * n)

    return dataclasses.replace(
        measured,
        prefill=[
            fit.PrefillSample(s.prompt_tokens, engine_time(s.prompt_tokens, s.ttft_s))
            for s in measured.prefill
        ],
        transfer=[
            fit.TransferSample(s.prompt_tokens, engine_time(s.prompt_tokens, s.ttft_s))
            for s in measured.transfer
        ],
        partial_prefill=[
            fit.PrefillSample(
                s.prompt_tokens, engine_time(s.prompt_tokens, s.ttft_s), s.cached_tokens
            )
            for s in measured.partial_prefill
        ],
    )


def fit_all(net: Measured, cfg: ProbeConfig) -> Fits:
    """Fit the prefill, decode and (if measured) KV-transfer models; `ProbeError` when there are
    too few measurements or a fit is not finite."""
    try:
        pre = fit.fit_prefill(net.prefill, cfg.max_num_batched_tokens, cfg.seed)
        dec = fit.fit_decode(net.decode, cfg.seed)
        xfer = fit.fit_transfer(net.transfer, dec, cfg.seed) if net.transfer else None
    except ValueError as exc:
        raise ProbeError(f"too few measurements to fit: {exc}") from None
    fits = Fits(pre, dec, xfer)
    if not all(math.isfinite(c) for f in fits.all() for c in f.coef):
        raise ProbeError("fit produced non-finite constants")
    return fits


def assemble(
    cfg: ProbeConfig,
    pod: Pod,
    net: Measured,
    fits: Fits,
    *,
    elapsed_s: float,
    fitted_at: str,
) -> ProbeResult:
    """The profile of `pod` and the probe's report (`fitted_at`: an ISO-8601 UTC timestamp).

    Partial prefills (a pod caching prefixes) are not fitted: the prefill model fitted on whole
    prompts must predict them, which is what the router's cache credit relies on; their error
    is judged like a held-out error."""
    checks = {}
    if net.partial_prefill:
        checks["partial prefill"] = fit.prefill_error(
            fits.prefill, net.partial_prefill, cfg.max_num_batched_tokens
        )
    quality, reason = fit.verdict(fits.all(), checks)
    unmeasured: tuple[str, ...] = ()
    if fits.transfer is None:
        unmeasured = ("kv_transfer",)
        quality, reason = _unmeasured_transfer(cfg.role, quality, reason)
        k0, bandwidth = DEFAULT_K0_S, DEFAULT_KV_BANDWIDTH
    else:
        k0 = fits.transfer.coef[0]
        bandwidth = cfg.kv_bytes_per_token / max(fits.transfer.coef[1], 1e-15)
    profile = CalibrationProfile(
        name=cfg.name,
        gpu=cfg.gpu,
        model=pod.model,
        prefill=PrefillModel(*fits.prefill.coef),
        decode=DecodeModel(*fits.decode.coef),
        kv_transfer=KVTransferModel(k0, float(cfg.kv_bytes_per_token), bandwidth),
        kv_capacity_tokens=pod.kv_capacity_tokens,
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        block_size=pod.block_size,
        max_model_len=pod.max_model_len,
        source="probe",
        quality=quality,
        fitted_at=fitted_at,
        ttft_mape=round(fits.prefill.holdout_mape, 4),
        tpot_mape=round(fits.decode.holdout_mape, 4),
        notes=reason,
        unmeasured=unmeasured,
    )
    if profile.implausible:
        # The router and the operator would refuse it (`core.profile`'s physical bounds): say so
        # here, where the pod can be probed again, rather than deliver a profile nobody takes.
        raise ProbeError(f"the fitted profile is not physical: {profile.implausible}")
    return ProbeResult(profile, _report(cfg, net, fits, elapsed_s, quality, reason, checks))


def _unmeasured_transfer(role: str, quality: str, reason: str) -> tuple[str, str]:
    """The verdict of a profile whose KV transfer holds the defaults (no --peer to measure it).

    A decode pod's transfer prices every decode leg it takes, so defaults there are at most
    `fair`: they say nothing of the pod's own link (one of 3 ms + 12 GB/s would be priced as
    2 ms + 20 GB/s), which `good` would claim. The router replaces them by its pool's measured
    median (`core.policies.calibrated`). A prefill pod's transfer is never priced (the decode pod
    pulls the KV, and the cost model reads the decode pod's profile): it is marked unmeasured,
    its verdict kept."""
    reason += "; KV transfer not measured (no --peer): default 2 ms + 20 GB/s, marked unmeasured"
    if role != "decode":
        return quality, reason + " (a prefill pod's is not used)"
    if quality == "good":
        quality = "fair"
        reason += ", so at most fair"
    return quality, reason + "; the router uses its pool's measured KV transfer where it has one"


def _report(
    cfg: ProbeConfig,
    net: Measured,
    fits: Fits,
    elapsed_s: float,
    quality: str,
    reason: str,
    checks: dict[str, float],
) -> dict[str, Any]:
    path = net.request_path
    return {
        "endpoint": cfg.endpoint,
        "peer": cfg.peer,
        "role": cfg.role,
        "elapsed_s": round(elapsed_s, 3),
        "http_overhead": {
            "from": path.source,
            "seconds": round(path.base_s, 6),
            "seconds_per_prompt_token": path.per_token_s,
            "samples": path.samples,
        },
        "budget_s": cfg.budget_s,
        "seed": cfg.seed,
        "samples": {
            "prefill": len(net.prefill),
            "decode": len(net.decode),
            "decode_timed_by_server": net.decode_timed_by_server,
            "transfer": len(net.transfer),
            "partial_prefill": len(net.partial_prefill),
        },
        # The prefill model, fitted on whole prompts, predicting prompts partly cached.
        "partial_prefill_error": round(checks["partial prefill"], 4)
        if "partial prefill" in checks
        else None,
        # What was fitted (TTFTs net of the request path), for anyone who doubts a fit.
        "measurements": {
            "prefill": [[s.prompt_tokens, round(s.ttft_s, 6)] for s in net.prefill],
            "decode": [[s.batch, s.context_tokens, round(s.itl_s, 6)] for s in net.decode],
            "transfer": [[s.prompt_tokens, round(s.ttft_s, 6)] for s in net.transfer],
            "partial_prefill": [
                [s.prompt_tokens, s.cached_tokens, round(s.ttft_s, 6)] for s in net.partial_prefill
            ],
        },
        "fits": {
            "prefill": fits.prefill.as_dict(),
            "decode": fits.decode.as_dict(),
            **({"transfer": fits.transfer.as_dict()} if fits.transfer else {}),
        },
        "quality": quality,
        "reason": reason,
        "unmeasured": [] if fits.transfer else ["kv_transfer"],
    }
