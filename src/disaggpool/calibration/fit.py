"""Fitting calibration constants from probe measurements: robust least squares, held-out error,
bootstrap confidence intervals and a quality verdict.

Pure (numpy only, no I/O, no clock; randomness from a seed): `calibration.stages` collects the
samples over HTTP and calls `fit_overhead`; `calibration.assemble` calls the model fits and
`verdict`; tests feed them synthetic samples.

Models fitted (the profile's formulas, `core.profile`):

* prefill, from the TTFT of single requests on an idle engine, less the request path's own cost
  (`fit_overhead`: a line in the prompt length, from requests the server rejects unprocessed):
  ``TTFT(n) = p0 * ceil(n / M_b) + p1 * n + p2 * n**2``;
* decode, from the mean inter-token gap of B concurrent streams holding K context tokens:
  ``ITL(B, K) = d0 + d1 * B + d2 * K``;
* KV transfer, from the TTFT of decode legs on an idle decode engine whose prompt was prefilled
  elsewhere: ``TTFT_D(n) = k0 + n * bytes_per_token / bandwidth + step(1, n)``; the decode step is
  subtracted with the decode fit, so only the slope ``bytes_per_token / bandwidth`` and ``k0``
  are identified (bytes per token comes from the model's shape).

Robustness: Huber-weighted iteratively reweighted least squares, so a few requests delayed by a
garbage collection or a noisy neighbour do not drag the fit. Coefficients are constrained to be
non-negative (a negative time per token is never physical: the coefficient is then refitted at 0).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from disaggpool.core.profile import PrefillModel

__all__ = [
    "DecodeSample",
    "FitResult",
    "OverheadSample",
    "PrefillSample",
    "TransferSample",
    "fit_decode",
    "fit_overhead",
    "fit_prefill",
    "fit_transfer",
    "huber_nnls",
    "prefill_error",
    "verdict",
]

HOLDOUT_FRACTION = 0.25
NOISE_FLOOR_S = 0.005
BOOTSTRAP_ROUNDS = 200
#: Held-out mean absolute percentage error thresholds for the verdict (fractions).
GOOD_MAPE = 0.10
FAIR_MAPE = 0.25


@dataclasses.dataclass(frozen=True, slots=True)
class PrefillSample:
    prompt_tokens: int
    ttft_s: float
    cached_tokens: int = 0  # of the prompt, found in the pod's prefix cache


def prefill_error(
    fitted: FitResult, samples: Sequence[PrefillSample], max_batched_tokens: int
) -> float:
    """Mean absolute percentage error of the fitted prefill model on `samples` (which it was not
    fitted on: an out-of-sample check)."""
    if not samples:
        raise ValueError("no samples to check the prefill model on")
    model = PrefillModel(*fitted.coef)  # (p0, p1, p2)
    errors = [
        abs(model.partial_time(s.prompt_tokens, s.cached_tokens, max_batched_tokens) - s.ttft_s)
        / max(s.ttft_s, NOISE_FLOOR_S)
        for s in samples
    ]
    return float(np.mean(errors))


@dataclasses.dataclass(frozen=True, slots=True)
class DecodeSample:
    batch: int
    context_tokens: float
    itl_s: float


@dataclasses.dataclass(frozen=True, slots=True)
class TransferSample:
    prompt_tokens: int
    ttft_s: float  # decode-leg TTFT on an idle decode engine


@dataclasses.dataclass(frozen=True, slots=True)
class OverheadSample:
    prompt_tokens: int
    seconds: float  # round trip of a request the server rejects before its engine sees it


@dataclasses.dataclass(frozen=True, slots=True)
class FitResult:
    """Coefficients with 95% bootstrap intervals and the held-out error of the fitted model."""

    names: tuple[str, ...]
    coef: tuple[float, ...]
    ci_low: tuple[float, ...]
    ci_high: tuple[float, ...]
    holdout_mape: float
    train_points: int
    holdout_points: int

    def as_dict(self) -> dict[str, object]:
        return {
            "coefficients": dict(zip(self.names, self.coef, strict=True)),
            "ci95": {
                n: [lo, hi] for n, lo, hi in zip(self.names, self.ci_low, self.ci_high, strict=True)
            },
            "holdout_mape": self.holdout_mape,
            "train_points": self.train_points,
            "holdout_points": self.holdout_points,
        }


def huber_nnls(
    x: np.ndarray, y: np.ndarray, *, iterations: int = 20, delta: float = 1.345
) -> np.ndarray:
    """Non-negative, Huber-weighted least squares of y ~ x (relative residuals).

    Residuals are taken relative to y so that short and long requests weigh alike (a 5 ms error
    on a 20 ms TTFT matters as much as 50 ms on 200 ms), as in DistServe's relative-error fits,
    but never relative to less than `NOISE_FLOOR_S`: below it, HTTP and timer noise dominate and
    relative errors would hand the fit to the noisiest points.
    """
    w_rel = 1.0 / np.maximum(np.abs(y), NOISE_FLOOR_S)
    weights = np.ones_like(y)
    coef = np.zeros(x.shape[1])
    for _ in range(iterations):
        sw = np.sqrt(weights) * w_rel
        coef = _nnls(x * sw[:, None], y * sw)
        resid = (y - x @ coef) * w_rel
        scale = 1.4826 * _median(np.abs(resid - _median(resid))) or 1e-12
        u = np.abs(resid) / (delta * scale)
        new = np.where(u <= 1.0, 1.0, 1.0 / np.maximum(u, 1e-12))
        # np.allclose(new, weights, atol=1e-6), spelt out: the bootstrap runs this loop some
        # thousand times per fit, and allclose's generality costs more than the fit's own solve.
        if (np.abs(new - weights) <= 1e-6 + 1e-5 * np.abs(weights)).all():
            break
        weights = new
    return coef


def _median(a: np.ndarray) -> float:
    """np.median of a 1-d array of finite numbers, the same value without its overhead (a
    partition, then the middle element or the mean of the middle two)."""
    n = len(a)
    k = n // 2
    if n % 2:
        return float(np.partition(a, k)[k])
    part = np.partition(a, (k - 1, k))
    return float((part[k - 1] + part[k]) / 2)


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with coefficients clamped at zero (active set, tiny problems only)."""
    active = list(range(a.shape[1]))
    while True:
        coef = np.zeros(a.shape[1])
        if active:
            sol, *_ = np.linalg.lstsq(a[:, active], b, rcond=None)
            coef[active] = sol
        negative = [i for i in active if coef[i] < 0]
        if not negative:
            return coef
        active.remove(min(negative, key=lambda i: coef[i]))


def _fit(
    names: tuple[str, ...],
    x: np.ndarray,
    y: np.ndarray,
    seed: int,
    offset: np.ndarray | None = None,
) -> FitResult:
    """Fit y ~ x; the held-out error is relative to ``y + offset`` (what was actually measured).

    The reported coefficients are fitted on every point; the held-out error comes from a fit on
    a training split alone (an honest out-of-sample error), the interval from `_bootstrap_ci`
    of the reported fit."""
    n = len(y)
    if n < len(names) + 2:
        raise ValueError(
            f"need at least {len(names) + 2} samples to fit {', '.join(names)}, got {n}"
        )
    rng = np.random.default_rng(seed)
    order = rng.permutation(n)
    n_hold = max(1, round(HOLDOUT_FRACTION * n))
    hold, train = order[:n_hold], order[n_hold:]
    pred = x[hold] @ huber_nnls(x[train], y[train])
    measured = y[hold] + (offset[hold] if offset is not None else 0.0)
    mape = float(np.mean(np.abs(pred - y[hold]) / np.maximum(np.abs(measured), NOISE_FLOOR_S)))
    full = huber_nnls(x, y)
    low, high = _bootstrap_ci(x, y, full, rng)
    return FitResult(
        names=names,
        coef=tuple(float(c) for c in full),
        ci_low=tuple(float(c) for c in low),
        ci_high=tuple(float(c) for c in high),
        holdout_mape=mape,
        train_points=len(train),
        holdout_points=n_hold,
    )


def _bootstrap_ci(
    x: np.ndarray, y: np.ndarray, coef: np.ndarray, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """95% percentile bootstrap interval of `coef`, the `huber_nnls` fit of every point.

    Each round resamples all the points `coef` was fitted on and refits them with the very same
    estimator (all its iterations), so that the interval describes the coefficients reported: a
    cheaper estimator (fewer Huber iterations, the training split alone) describes other
    coefficients, and its interval can miss the reported value. Cost: 200 full fits, about 0.1 s
    for the 180 prefill or 66 decode samples of a 60 s probe.

    The interval is then widened, where needed, to reach `coef`: a percentile interval need not
    contain its own estimate (a skewed bootstrap distribution, a coefficient pinned at its bound
    0 in most resamples but not in the full fit), and an interval that excludes the value it
    qualifies reads as a contradiction. Widening only ever makes the verdict's width check more
    cautious."""
    n = len(y)
    boots = np.empty((BOOTSTRAP_ROUNDS, len(coef)))
    for i in range(BOOTSTRAP_ROUNDS):
        pick = rng.integers(0, n, size=n)
        boots[i] = huber_nnls(x[pick], y[pick])
    low, high = np.percentile(boots, [2.5, 97.5], axis=0)
    return np.minimum(low, coef), np.maximum(high, coef)


def fit_overhead(samples: Sequence[OverheadSample]) -> tuple[float, float]:
    """(seconds, seconds per prompt token) of the request path outside the engine.

    A straight line: sending, parsing and validating a prompt grows with its length (a few
    hundred microseconds for thousands of token ids), which would otherwise read as prefill.
    """
    if len(samples) < 2:
        raise ValueError(f"need at least 2 overhead samples, got {len(samples)}")
    n = np.array([s.prompt_tokens for s in samples], dtype=float)
    x = np.column_stack([np.ones(len(samples)), n])
    a, b = huber_nnls(x, np.array([s.seconds for s in samples], dtype=float))
    return float(a), float(b)


def fit_prefill(
    samples: Sequence[PrefillSample], max_batched_tokens: int, seed: int = 0
) -> FitResult:
    n = np.array([s.prompt_tokens for s in samples], dtype=float)
    x = np.column_stack([np.ceil(n / max_batched_tokens), n, n * n])
    y = np.array([s.ttft_s for s in samples], dtype=float)
    return _fit(("p0", "p1", "p2"), x, y, seed)


def fit_decode(samples: Sequence[DecodeSample], seed: int = 0) -> FitResult:
    x = np.column_stack(
        [
            np.ones(len(samples)),
            np.array([s.batch for s in samples], dtype=float),
            np.array([s.context_tokens for s in samples], dtype=float),
        ]
    )
    y = np.array([s.itl_s for s in samples], dtype=float)
    return _fit(("d0", "d1", "d2"), x, y, seed)


def fit_transfer(samples: Sequence[TransferSample], decode: FitResult, seed: int = 0) -> FitResult:
    """k0 and seconds per token of the KV pull, after removing D's first step."""
    d0, d1, d2 = decode.coef
    n = np.array([s.prompt_tokens for s in samples], dtype=float)
    first_step = d0 + d1 + d2 * n
    y = np.maximum(np.array([s.ttft_s for s in samples], dtype=float) - first_step, 1e-6)
    x = np.column_stack([np.ones(len(samples)), n])
    # Judge the fit on the decode-leg TTFT it predicts, not on the small remainder alone.
    return _fit(("k0", "s_per_token"), x, y, seed, offset=first_step)


def verdict(
    fits: Sequence[FitResult], checks: Mapping[str, float] | None = None
) -> tuple[str, str]:
    """(quality, reason): good/fair/poor from held-out error and interval widths. `checks`:
    named out-of-sample errors of the fitted models (e.g. on partial prefills), judged by the
    same thresholds as the held-out errors."""
    checks = checks or {}
    worst = max([f.holdout_mape for f in fits] + list(checks.values()))
    reasons = [
        f"{name} error {error:.0%} > {FAIR_MAPE:.0%}"
        for name, error in checks.items()
        if error > FAIR_MAPE
    ]
    caveats: list[str] = []
    for f in fits:
        if f.holdout_mape > FAIR_MAPE:
            reasons.append(
                f"{'/'.join(f.names)} held-out error {f.holdout_mape:.0%} > {FAIR_MAPE:.0%}"
            )
        for name, c, lo, hi in zip(f.names, f.coef, f.ci_low, f.ci_high, strict=True):
            # A dominant coefficient whose interval spans more than its own size is not determined.
            if not (c > 0 and hi - lo > 2.0 * c):
                continue
            what = f"{name} poorly determined (95% CI {lo:.3g}..{hi:.3g})"
            if name in ("p1", "d0"):  # the bulk of every prefill / every step: untrustworthy
                reasons.append(what)
            elif name == "s_per_token":
                # The KV pull is a small share of a decode leg's TTFT (the held-out error above
                # says how small); an uncertain rate makes the fit usable with a caveat, not poor.
                caveats.append(what)
    if reasons:
        return "poor", "; ".join(reasons + caveats)
    if worst <= GOOD_MAPE and not caveats:
        return "good", f"held-out error {worst:.1%}"
    why = f"held-out error {worst:.1%}" + (f" (> {GOOD_MAPE:.0%})" if worst > GOOD_MAPE else "")
    return "fair", "; ".join([why, *caveats])
