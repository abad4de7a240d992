"""Output-length predictors: how many tokens a request will generate, before it runs.

The router needs the expected decode length of a request to price it (the cost model multiplies
`Prediction.mean` by the per-token step time) and a spread to hedge with. `predict` is called on
the routing hot path, once per request, by the simulator (`disaggpool.sim`) and by the routing
sidecar (`sidecar.service`); `observe` is called when a request finishes and its true output
length is known.

Everything here is pure: no I/O, no clock, no global state. Randomness comes only from the
`random.Random` passed to `predict` (only the noisy oracle uses it).

Predictors
----------
* `OnlineQuantilePredictor` (``"online"``): learns from completed requests. Method:

  - Key: (SLO class, prompt bucket) with bucket = floor(log2(prompt_tokens)).
  - Per key, and per class (all buckets of the class together), a table holds a histogram of
    output lengths over log2-spaced bins (`BINS_PER_OCTAVE` = 4 per octave, bin ``b`` centred on
    ``2**(b/4)`` tokens, from 1 token to `max_tokens`), plus the sum and sum of squares of the
    outputs. All are exponentially decayed: each observation of a table multiplies its previous
    contents by `decay` (effective memory 1/(1-decay) observations of that table, 1000 by
    default), so it follows drift. Decay is applied lazily through a per-table scale factor, so
    `observe` costs O(1), not O(bins).
  - Hierarchical shrinkage (a Dirichlet-style backoff). With ``w`` = `prior_weight`, ``π`` the
    prior (a log-normal over the same bins), ``n_c``/``H_c`` the decayed weight/histogram of the
    class table and ``n_k``/``H_k`` those of the key table::

        P_class = (H_c + w·π)       / (n_c + w)
        P_key   = (H_k + w·P_class) / (n_k + w)

    i.e. the key's own data gets weight n_k/(n_k+w): a key with no data predicts its class, a
    class with no data predicts the prior, and w observations are worth as much as the parent.
    The mean and the second moment are blended with the same weights (sums S, Q in place of H;
    the prior's moments are those of the log-normal), giving `mean` and `std`.
  - The prior is log-normal with a log2 standard deviation of `PRIOR_LOG2_SIGMA` (one octave) and
    its centre placed so that its *mean* is `prior_mean`; with no data at all, `mean` is exactly
    `prior_mean` and `p50` is prior_mean·exp(-(σ·ln2)²/2) (about 0.79·prior_mean).
  - p50/p90 come from the blended histogram, interpolated geometrically (linearly in log2)
    within the bin holding the quantile, clamped to [1, max_tokens].
  - Caching: predict is a dict lookup plus a staleness check. The prediction of a key is
    recomputed lazily, on the next `predict` after its key table or its class table has received
    more than ``max(1, floor((n + w) / REFRESH_DIVISOR))`` observations since the cached value
    was computed (n being that table's decayed weight). While data is scarce every observation
    therefore triggers a refresh; once warm (n ≈ 1000) one refresh every ~30 observations, so at
    most ~1/32 of the blended probability mass is unseen by a cached prediction.
  - `errors()`: on every `observe`, the prediction that `predict` would have returned just
    before (cached value included) is scored against the true output: running MAE of `mean`
    (tokens) and mean |log2(p50) - log2(true)| (the median is the point minimising it), averaged
    over all observations since construction or `reset_errors()`. The first observations are
    therefore scored against the prior: the error is honest, online, out-of-sample.

* `OraclePredictor` (``"oracle"``): the true output, std 0 (an upper bound for experiments).
* `NoisyOraclePredictor` (``"noisy:<sigma>"``): true × exp(N(0, sigma)), drawn from the rng.

`make_predictor(spec)` builds one of them from a string spec.
"""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Final, Protocol

from disaggpool.errors import InputError

__all__ = [
    "BINS_PER_OCTAVE",
    "PRIOR_LOG2_SIGMA",
    "REFRESH_DIVISOR",
    "NoisyOraclePredictor",
    "OnlineQuantilePredictor",
    "OraclePredictor",
    "OutputPredictor",
    "Prediction",
    "make_predictor",
]

#: Histogram resolution: bins per doubling of the output length (bin width ≈ 19 %).
BINS_PER_OCTAVE: Final = 4
#: Log2 standard deviation of the log-normal prior (one octave).
PRIOR_LOG2_SIGMA: Final = 1.0
#: A cached prediction is refreshed after (decayed weight + prior_weight) / REFRESH_DIVISOR
#: new observations of its key or class (at least 1).
REFRESH_DIVISOR: Final = 32.0

_Z90: Final = 1.2815515655446004  # standard normal 0.9 quantile
_LN2: Final = math.log(2.0)
_RENORM_AT: Final = 1e100  # lazy-decay increment at which a table is renormalised


@dataclasses.dataclass(frozen=True, slots=True)
class Prediction:
    """A predicted output length, in tokens."""

    mean: float  # expected output tokens (what the cost model multiplies by step time)
    p50: float
    p90: float
    std: float  # uncertainty in tokens


class OutputPredictor(Protocol):
    """What the router and the simulator use: predict at routing time, observe at completion."""

    name: str

    def predict(
        self,
        slo_class: str,
        prompt_tokens: int,
        rng: random.Random,
        true_output: int | None = None,
    ) -> Prediction: ...

    def observe(self, slo_class: str, prompt_tokens: int, output_tokens: int) -> None: ...


# --------------------------------------------------------------------------------------------
# Online predictor
# --------------------------------------------------------------------------------------------


class _Table:
    """Exponentially decayed histogram + moments of one key or one class.

    Lazy decay: an observation adds `inc` instead of 1, and `inc` is divided by `decay` after
    each one; the true (decayed) value of every stored quantity is ``stored * scale`` with
    ``scale = 1 / inc``. When `inc` grows large everything is rescaled back to inc = 1.
    """

    __slots__ = ("count", "hist", "inc", "inv_decay", "q", "s", "scale", "w")

    def __init__(self, n_bins: int, decay: float) -> None:
        self.hist = [0.0] * n_bins
        self.w = 0.0  # stored total weight
        self.s = 0.0  # stored sum of outputs
        self.q = 0.0  # stored sum of squared outputs
        self.inc = 1.0
        self.scale = 1.0
        self.inv_decay = 1.0 / decay
        self.count = 0  # raw number of observations (drives cache refresh)

    def add(self, b: int, y: float) -> None:
        inc = self.inc
        self.hist[b] += inc
        self.w += inc
        self.s += inc * y
        self.q += inc * y * y
        self.count += 1
        inc *= self.inv_decay
        if inc > _RENORM_AT:
            f = 1.0 / inc
            self.hist = [h * f for h in self.hist]
            self.w *= f
            self.s *= f
            self.q *= f
            inc = 1.0
        self.inc = inc
        self.scale = 1.0 / inc

    def weight(self) -> float:
        """Decayed number of observations."""
        return self.w * self.scale


class _KeyState:
    """Key table, a reference to its class table, and the cached prediction."""

    __slots__ = ("cls", "cls_deadline", "key_deadline", "pred", "table")

    def __init__(self, table: _Table, cls: _Table) -> None:
        self.table = table
        self.cls = cls
        self.pred: Prediction | None = None
        self.key_deadline = 0  # refresh once table.count reaches this
        self.cls_deadline = 0  # ... or once cls.count reaches this


def _bucket(prompt_tokens: int) -> int:
    """floor(log2(prompt_tokens)); prompts of 0 or 1 token share bucket 0."""
    return prompt_tokens.bit_length() - 1 if prompt_tokens > 1 else 0


def _phi(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


class OnlineQuantilePredictor:
    """Learns from completed requests, keyed by (SLO class, prompt-length bucket).

    The prompt-length bucket is floor(log2(prompt_tokens)). See the module docstring for the
    method (decayed log2 histograms, hierarchical shrinkage key → class → log-normal prior,
    lazily refreshed per-key cache, honest online errors).
    """

    name = "online"

    def __init__(
        self,
        *,
        prior_mean: float = 128.0,
        prior_weight: float = 8.0,
        max_tokens: int = 32768,
        decay: float = 0.999,
    ) -> None:
        if not (math.isfinite(prior_mean) and prior_mean >= 1.0):
            raise ValueError(f"prior_mean must be a finite number >= 1, got {prior_mean!r}")
        if not (math.isfinite(prior_weight) and prior_weight > 0.0):
            raise ValueError(f"prior_weight must be a finite number > 0, got {prior_weight!r}")
        if max_tokens < 2:
            raise ValueError(f"max_tokens must be >= 2, got {max_tokens!r}")
        if not (0.0 < decay <= 1.0):
            raise ValueError(f"decay must be in (0, 1], got {decay!r}")
        self.prior_mean = float(prior_mean)
        self.prior_weight = float(prior_weight)
        self.max_tokens = int(max_tokens)
        self.decay = float(decay)

        # Bin b covers log2(y) in [(b - 0.5)/k, (b + 0.5)/k), k = BINS_PER_OCTAVE; the last bin
        # is centred on (or just above) max_tokens.
        k = BINS_PER_OCTAVE
        self._n_bins = math.ceil(k * math.log2(self.max_tokens)) + 1

        # Log-normal prior in log2 space, mean = prior_mean: mu = log2(mean) - sigma² ln2 / 2.
        sig = PRIOR_LOG2_SIGMA
        mu = math.log2(self.prior_mean) - sig * sig * _LN2 / 2.0
        cdf = [_phi(((b + 0.5) / k - mu) / sig) for b in range(self._n_bins - 1)]
        edges = [0.0, *cdf, 1.0]  # first bin takes the lower tail, last bin the upper one
        self._prior_pmf = [edges[b + 1] - edges[b] for b in range(self._n_bins)]
        self._prior_m1 = self.prior_mean
        self._prior_m2 = self.prior_mean * self.prior_mean * math.exp((sig * _LN2) ** 2)

        self._keys: dict[tuple[str, int], _KeyState] = {}
        self._classes: dict[str, _Table] = {}
        self._err_abs = 0.0
        self._err_log2 = 0.0
        self._err_n = 0

    # -- hot path -------------------------------------------------------------------------------

    def predict(
        self,
        slo_class: str,
        prompt_tokens: int,
        rng: random.Random,
        true_output: int | None = None,
    ) -> Prediction:
        """Predicted output length for a request; `rng` and `true_output` are ignored."""
        st = self._keys.get((slo_class, _bucket(prompt_tokens)))
        if st is not None:
            p = st.pred
            if (
                p is not None
                and st.table.count < st.key_deadline
                and st.cls.count < st.cls_deadline
            ):
                return p
        return self._refresh(st, slo_class, prompt_tokens)

    def observe(self, slo_class: str, prompt_tokens: int, output_tokens: int) -> None:
        """Learn from a completed request; first score what `predict` would have said."""
        key = (slo_class, _bucket(prompt_tokens))
        st = self._keys.get(key)
        if st is None:
            st = self._state(key)
        p = st.pred
        if p is None or st.table.count >= st.key_deadline or st.cls.count >= st.cls_deadline:
            p = self._refresh(st, slo_class, prompt_tokens)
        y = min(max(float(output_tokens), 1.0), float(self.max_tokens))
        self._err_abs += abs(p.mean - output_tokens)
        self._err_log2 += abs(math.log2(p.p50) - math.log2(y))
        self._err_n += 1

        b = min(int(BINS_PER_OCTAVE * math.log2(y) + 0.5), self._n_bins - 1)
        st.table.add(b, y)
        st.cls.add(b, y)

    def errors(self) -> dict[str, float]:
        """Honest online errors of the predictions made just before each observation.

        ``mae_tokens``: mean |mean - true|; ``mean_abs_log2_error``: mean |log2(p50/true)|
        (true clamped to [1, max_tokens]); ``count``: number of scored predictions.
        """
        n = self._err_n
        if n == 0:
            return {"mae_tokens": 0.0, "mean_abs_log2_error": 0.0, "count": 0.0}
        return {
            "mae_tokens": self._err_abs / n,
            "mean_abs_log2_error": self._err_log2 / n,
            "count": float(n),
        }

    def reset_errors(self) -> None:
        """Restart the error averages (e.g. after a warm-up); the learned state is kept."""
        self._err_abs = 0.0
        self._err_log2 = 0.0
        self._err_n = 0

    # -- slow path ------------------------------------------------------------------------------

    def _state(self, key: tuple[str, int]) -> _KeyState:
        cls = self._classes.get(key[0])
        if cls is None:
            cls = self._classes[key[0]] = _Table(self._n_bins, self.decay)
        st = self._keys[key] = _KeyState(_Table(self._n_bins, self.decay), cls)
        return st

    def _refresh(self, st: _KeyState | None, slo_class: str, prompt_tokens: int) -> Prediction:
        if st is None:
            st = self._state((slo_class, _bucket(prompt_tokens)))
        kt, ct = st.table, st.cls
        w = self.prior_weight
        n_c = ct.weight()
        n_k = kt.weight()
        # P_class = (H_c + w π) / (n_c + w); key mass = H_k + w P_class (total n_k + w), so per
        # bin: f_k·stored H_k + f_c·stored H_c + f_p·π.
        f_k = kt.scale
        f_c = w * ct.scale / (n_c + w)
        f_p = w * w / (n_c + w)
        mass = [
            f_k * hk + f_c * hc + f_p * pi
            for hk, hc, pi in zip(kt.hist, ct.hist, self._prior_pmf, strict=True)
        ]
        total = n_k + w
        m1_c = (ct.s * ct.scale + w * self._prior_m1) / (n_c + w)
        m2_c = (ct.q * ct.scale + w * self._prior_m2) / (n_c + w)
        mean = (kt.s * kt.scale + w * m1_c) / total
        m2 = (kt.q * kt.scale + w * m2_c) / total
        std = math.sqrt(max(m2 - mean * mean, 0.0))
        p50, p90 = self._quantiles(mass, 0.5 * total, 0.9 * total)
        pred = Prediction(mean=mean, p50=p50, p90=p90, std=std)

        st.pred = pred
        st.key_deadline = kt.count + max(1, int((n_k + w) / REFRESH_DIVISOR))
        st.cls_deadline = ct.count + max(1, int((n_c + w) / REFRESH_DIVISOR))
        return pred

    def _quantiles(self, mass: list[float], t50: float, t90: float) -> tuple[float, float]:
        """Values at cumulative masses t50 <= t90, log2-linear within the bin."""
        k = BINS_PER_OCTAVE
        hi = float(self.max_tokens)
        out: list[float] = []
        targets = (t50, t90)
        ti = 0
        cum = 0.0
        last = len(mass) - 1
        for b, m in enumerate(mass):
            nxt = cum + m
            while ti < 2 and (nxt >= targets[ti] or b == last):
                frac = (targets[ti] - cum) / m if m > 0.0 else 0.5
                frac = min(max(frac, 0.0), 1.0)
                v = 2.0 ** ((b - 0.5 + frac) / k)
                out.append(min(max(v, 1.0), hi))
                ti += 1
            if ti == 2:
                break
            cum = nxt
        return out[0], out[1]


# --------------------------------------------------------------------------------------------
# Oracles
# --------------------------------------------------------------------------------------------


def _require_truth(name: str, true_output: int | None) -> int:
    if true_output is None:
        raise ValueError(f"{name} predictor needs true_output (the request's real output length)")
    return true_output


class OraclePredictor:
    """Returns the true output length exactly, with std 0 (an upper bound on prediction)."""

    name = "oracle"

    def predict(
        self,
        slo_class: str,
        prompt_tokens: int,
        rng: random.Random,
        true_output: int | None = None,
    ) -> Prediction:
        y = float(_require_truth(self.name, true_output))
        return Prediction(mean=y, p50=y, p90=y, std=0.0)

    def observe(self, slo_class: str, prompt_tokens: int, output_tokens: int) -> None:
        """Nothing to learn."""


class NoisyOraclePredictor:
    """The true output times exp(N(0, sigma)), drawn from the rng passed to `predict`.

    The estimate is reported as both mean and p50; p90 is estimate·exp(z90·sigma) and std is
    estimate·sigma (the first-order spread of a log-normal error of log-std sigma).
    """

    name = "noisy_oracle"

    def __init__(self, sigma: float) -> None:
        if not (math.isfinite(sigma) and sigma >= 0.0):
            raise ValueError(f"sigma must be a finite number >= 0, got {sigma!r}")
        self.sigma = float(sigma)
        self._p90_factor = math.exp(_Z90 * self.sigma)

    def predict(
        self,
        slo_class: str,
        prompt_tokens: int,
        rng: random.Random,
        true_output: int | None = None,
    ) -> Prediction:
        y = float(_require_truth(self.name, true_output))
        est = y * math.exp(rng.gauss(0.0, self.sigma))
        return Prediction(mean=est, p50=est, p90=est * self._p90_factor, std=est * self.sigma)

    def observe(self, slo_class: str, prompt_tokens: int, output_tokens: int) -> None:
        """Nothing to learn."""


# --------------------------------------------------------------------------------------------
# Factory
# --------------------------------------------------------------------------------------------

_VALID_SPECS: Final = "'online', 'oracle', 'noisy:<sigma>' (e.g. 'noisy:0.5')"


def make_predictor(spec: str) -> OutputPredictor:
    """Build a predictor from a spec: ``online``, ``oracle`` or ``noisy:<sigma>``.

    Raises `InputError` (a ValueError) naming the valid specs when `spec` is not one of them.
    """
    s = spec.strip().lower()
    if s == "online":
        return OnlineQuantilePredictor()
    if s == "oracle":
        return OraclePredictor()
    name, sep, arg = s.partition(":")
    if name == "noisy":
        if not sep or not arg.strip():
            raise InputError("predictor", spec, f"noisy needs a sigma; valid specs: {_VALID_SPECS}")
        try:
            sigma = float(arg)
        except ValueError:
            raise InputError(
                "predictor", spec, f"sigma {arg!r} is not a number; valid specs: {_VALID_SPECS}"
            ) from None
        if not (math.isfinite(sigma) and sigma >= 0.0):
            raise InputError(
                "predictor", spec, f"sigma must be finite and >= 0; valid specs: {_VALID_SPECS}"
            )
        return NoisyOraclePredictor(sigma)
    raise InputError("predictor", spec, f"unknown predictor; valid specs: {_VALID_SPECS}")
