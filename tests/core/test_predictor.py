"""Tests for disaggpool.core.predictor: online learning, backoff, drift, errors, oracles, specs."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from disaggpool.core.predictor import (
    NoisyOraclePredictor,
    OnlineQuantilePredictor,
    OraclePredictor,
    OutputPredictor,
    Prediction,
    make_predictor,
)


def lognormal_int(rng: random.Random, median: float, sigma: float = 0.5) -> int:
    return max(1, round(median * math.exp(rng.gauss(0.0, sigma))))


def feed(
    p: OnlineQuantilePredictor,
    rng: random.Random,
    slo_class: str,
    median: float,
    n: int,
    prompt_tokens: int = 512,
) -> None:
    for _ in range(n):
        p.observe(slo_class, prompt_tokens, lognormal_int(rng, median))


# -- online: prior -----------------------------------------------------------------------------


def test_prior_with_no_data() -> None:
    p = OnlineQuantilePredictor(prior_mean=128.0)
    pred = p.predict("chat", 100, random.Random(0))
    assert isinstance(pred, Prediction)
    assert pred.mean == pytest.approx(128.0)
    # Log-normal prior with mean 128 and log2-sigma 1: median = 128 * exp(-(ln 2)^2 / 2).
    assert pred.p50 == pytest.approx(128.0 * math.exp(-(math.log(2) ** 2) / 2), rel=0.03)
    assert pred.p50 < pred.mean < pred.p90
    assert pred.std > 0.5 * pred.mean  # wide: the prior knows little
    # Every unseen key answers the same.
    assert p.predict("other", 7, random.Random(1)) == pred
    assert p.errors() == {"mae_tokens": 0.0, "mean_abs_log2_error": 0.0, "count": 0.0}


def test_prior_mean_parameter() -> None:
    p = OnlineQuantilePredictor(prior_mean=1000.0)
    assert p.predict("c", 10, random.Random(0)).mean == pytest.approx(1000.0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"prior_mean": 0.0},
        {"prior_weight": 0.0},
        {"max_tokens": 1},
        {"decay": 0.0},
        {"decay": 1.5},
    ],
)
def test_bad_parameters(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        OnlineQuantilePredictor(**kwargs)  # type: ignore[arg-type]


# -- online: learning --------------------------------------------------------------------------


def test_learns_per_class_medians() -> None:
    rng = random.Random(42)
    p = OnlineQuantilePredictor()
    for _ in range(5000):
        p.observe("code", 512, lognormal_int(rng, 15))
        p.observe("chat", 512, lognormal_int(rng, 150))
    code = p.predict("code", 512, rng)
    chat = p.predict("chat", 512, rng)
    assert code.p50 == pytest.approx(15, rel=0.2)
    assert chat.p50 == pytest.approx(150, rel=0.2)
    # Mean of a log-normal with sigma 0.5 is median * exp(0.125).
    assert code.mean == pytest.approx(15 * math.exp(0.125), rel=0.2)
    assert chat.mean == pytest.approx(150 * math.exp(0.125), rel=0.2)
    assert code.p90 < chat.p50  # well separated
    assert code.p50 < code.p90 and chat.p50 < chat.p90
    # p90 of the log-normal: median * exp(1.2816 * 0.5).
    assert chat.p90 == pytest.approx(150 * math.exp(1.2816 * 0.5), rel=0.2)
    # std of the log-normal: mean * sqrt(exp(0.25) - 1).
    assert chat.std == pytest.approx(chat.mean * math.sqrt(math.exp(0.25) - 1), rel=0.25)


def test_unseen_bucket_backs_off_to_class() -> None:
    rng = random.Random(3)
    p = OnlineQuantilePredictor()
    feed(p, rng, "code", 15, 3000, prompt_tokens=512)
    other_bucket = p.predict("code", 20000, rng)
    assert other_bucket.p50 == pytest.approx(15, rel=0.25)
    # A class never seen still answers with the prior.
    assert p.predict("batch", 512, rng).mean == pytest.approx(128.0)


def test_prompt_bucket_dependence() -> None:
    rng = random.Random(7)
    p = OnlineQuantilePredictor()
    for _ in range(4000):
        p.observe("chat", 100, lognormal_int(rng, 30))  # bucket 6
        p.observe("chat", 4000, lognormal_int(rng, 600))  # bucket 11
    short = p.predict("chat", 100, rng)
    long = p.predict("chat", 4000, rng)
    assert short.p50 == pytest.approx(30, rel=0.2)
    assert long.p50 == pytest.approx(600, rel=0.2)
    # Same bucket, same answer.
    assert p.predict("chat", 127, rng) == short
    assert p.predict("chat", 64, rng) == short


def test_shrinkage_toward_class_with_few_key_observations() -> None:
    rng = random.Random(11)
    p = OnlineQuantilePredictor(prior_weight=8.0)
    feed(p, rng, "chat", 100, 3000, prompt_tokens=512)
    # Two observations in a new bucket at 1000 tokens: pulled toward 1000, but mostly class.
    p.observe("chat", 40000, 1000)
    p.observe("chat", 40000, 1000)
    pred = p.predict("chat", 40000, rng)
    class_mean = p.predict("chat", 512, rng).mean
    # Key weight 2/(2+8) = 0.2 on the key's mean (1000), 0.8 on the class mean.
    assert pred.mean == pytest.approx(0.2 * 1000 + 0.8 * class_mean, rel=0.02)


def test_drift_is_followed() -> None:
    rng = random.Random(5)
    p = OnlineQuantilePredictor(decay=0.995)
    feed(p, rng, "chat", 100, 3000)
    assert p.predict("chat", 512, rng).p50 == pytest.approx(100, rel=0.2)
    feed(p, rng, "chat", 400, 1000)  # ~5 memory lengths of 1/(1-0.995) = 200
    assert p.predict("chat", 512, rng).p50 == pytest.approx(400, rel=0.2)


def test_drift_default_decay() -> None:
    rng = random.Random(6)
    p = OnlineQuantilePredictor()  # decay 0.999: memory ~1000 observations
    feed(p, rng, "chat", 100, 5000)
    feed(p, rng, "chat", 400, 1500)
    assert p.predict("chat", 512, rng).p50 > 250  # majority of weight is on the new data
    feed(p, rng, "chat", 400, 3500)
    assert p.predict("chat", 512, rng).p50 == pytest.approx(400, rel=0.2)


def test_no_decay_keeps_everything() -> None:
    rng = random.Random(8)
    p = OnlineQuantilePredictor(decay=1.0)
    feed(p, rng, "chat", 100, 2000)
    feed(p, rng, "chat", 400, 2000)
    assert 100 < p.predict("chat", 512, rng).p50 < 400


def test_long_run_renormalisation_is_stable() -> None:
    rng = random.Random(9)
    p = OnlineQuantilePredictor(decay=0.9)  # 1/0.9^n passes 1e100 after ~2200 observations
    feed(p, rng, "chat", 50, 6000)
    pred = p.predict("chat", 512, rng)
    assert all(math.isfinite(v) for v in (pred.mean, pred.p50, pred.p90, pred.std))
    assert pred.p50 == pytest.approx(50, rel=0.3)


def test_quantiles_clamped_to_range() -> None:
    p = OnlineQuantilePredictor(max_tokens=1024)
    for _ in range(500):
        p.observe("x", 10, 5000)  # beyond max_tokens
        p.observe("y", 10, 0)  # below 1
    x = p.predict("x", 10, random.Random(0))
    y = p.predict("y", 10, random.Random(0))
    assert x.p50 <= x.p90 <= 1024
    assert x.p90 > 900
    assert 1.0 <= y.p50 <= y.p90
    assert y.p50 < 2


def test_predict_ignores_rng_and_truth() -> None:
    p = OnlineQuantilePredictor()
    feed(p, random.Random(1), "chat", 100, 100)
    a = p.predict("chat", 512, random.Random(1), true_output=5)
    b = p.predict("chat", 512, random.Random(2), true_output=9999)
    assert a == b


def test_cache_is_refreshed_while_data_is_scarce() -> None:
    p = OnlineQuantilePredictor()
    before = p.predict("chat", 512, random.Random(0))
    p.observe("chat", 512, 10)
    after = p.predict("chat", 512, random.Random(0))
    assert after.mean < before.mean  # one observation is enough to move a cold key


def test_deterministic_given_seed() -> None:
    def run(seed: int) -> list[Prediction]:
        rng = random.Random(seed)
        p = OnlineQuantilePredictor()
        out = []
        for i in range(2000):
            cls = "a" if i % 3 else "b"
            prompt = rng.randint(1, 8000)
            out.append(p.predict(cls, prompt, rng))
            p.observe(cls, prompt, lognormal_int(rng, 80))
        return out

    assert run(123) == run(123)
    assert run(123) != run(124)  # the seed matters: a constant predictor would pass the first


# -- online: errors ----------------------------------------------------------------------------


def test_errors_first_prediction_is_the_prior() -> None:
    p = OnlineQuantilePredictor(prior_mean=128.0)
    prior = p.predict("code", 512, random.Random(0))
    p.observe("code", 512, 20)
    e = p.errors()
    assert e["count"] == 1.0
    assert e["mae_tokens"] == pytest.approx(abs(128.0 - 20))
    assert e["mean_abs_log2_error"] == pytest.approx(abs(math.log2(prior.p50) - math.log2(20)))
    # Second observation is scored against the prediction after the first one.
    second = p.predict("code", 512, random.Random(0))
    p.observe("code", 512, 20)
    assert p.errors()["mae_tokens"] == pytest.approx((108.0 + abs(second.mean - 20)) / 2)


def test_errors_decrease_after_learning() -> None:
    rng = random.Random(2)
    p = OnlineQuantilePredictor()
    feed(p, rng, "code", 15, 20)
    early = p.errors()
    assert early["count"] == 20.0
    p.reset_errors()
    feed(p, rng, "code", 15, 3000)
    p.reset_errors()
    feed(p, rng, "code", 15, 2000)
    late = p.errors()
    assert late["count"] == 2000.0
    assert late["mae_tokens"] < 0.3 * early["mae_tokens"]
    assert late["mean_abs_log2_error"] < 0.7 * early["mean_abs_log2_error"]
    # Irreducible error of a log-normal with sigma 0.5: E|log2 X/median| = 0.5/ln2*sqrt(2/pi).
    floor = 0.5 / math.log(2) * math.sqrt(2 / math.pi)
    assert late["mean_abs_log2_error"] == pytest.approx(floor, rel=0.2)


def test_errors_accumulate_over_all_observations() -> None:
    rng = random.Random(4)
    p = OnlineQuantilePredictor()
    feed(p, rng, "code", 15, 100)
    feed(p, rng, "chat", 150, 100)
    assert p.errors()["count"] == 200.0


# -- oracles -----------------------------------------------------------------------------------


def test_oracle_exact() -> None:
    o = OraclePredictor()
    assert o.name == "oracle"
    pred = o.predict("chat", 100, random.Random(0), true_output=321)
    assert pred == Prediction(mean=321.0, p50=321.0, p90=321.0, std=0.0)
    o.observe("chat", 100, 5)  # ignored
    assert o.predict("chat", 100, random.Random(0), true_output=321) == pred
    with pytest.raises(ValueError, match="true_output"):
        o.predict("chat", 100, random.Random(0))


def test_noisy_oracle_log_error_std() -> None:
    sigma = 0.5
    o = NoisyOraclePredictor(sigma)
    assert o.name == "noisy_oracle"
    rng = random.Random(99)
    logs = []
    for _ in range(20000):
        pred = o.predict("chat", 100, rng, true_output=200)
        logs.append(math.log(pred.mean / 200))
        assert pred.p50 == pred.mean < pred.p90
        assert pred.std == pytest.approx(pred.mean * sigma)
    assert statistics.fmean(logs) == pytest.approx(0.0, abs=0.02)
    assert statistics.stdev(logs) == pytest.approx(sigma, rel=0.03)
    with pytest.raises(ValueError, match="true_output"):
        o.predict("chat", 100, rng)


def test_noisy_oracle_deterministic_given_seed() -> None:
    o = NoisyOraclePredictor(0.3)
    a = [o.predict("c", 1, r, true_output=50) for r in [random.Random(7)] for _ in range(50)]
    o.observe("c", 1, 1)  # ignored
    b = [o.predict("c", 1, r, true_output=50) for r in [random.Random(7)] for _ in range(50)]
    assert a == b
    c = [o.predict("c", 1, random.Random(8), true_output=50) for _ in range(5)]
    assert c[0] != a[0]


def test_noisy_oracle_zero_sigma_is_exact_and_bad_sigma_rejected() -> None:
    pred = NoisyOraclePredictor(0.0).predict("c", 1, random.Random(0), true_output=40)
    assert pred == Prediction(mean=40.0, p50=40.0, p90=40.0, std=0.0)
    for bad in (-0.1, math.nan, math.inf):
        with pytest.raises(ValueError):
            NoisyOraclePredictor(bad)


# -- factory -----------------------------------------------------------------------------------


def test_make_predictor_specs() -> None:
    online = make_predictor("online")
    assert isinstance(online, OnlineQuantilePredictor) and online.name == "online"
    assert isinstance(make_predictor("oracle"), OraclePredictor)
    noisy = make_predictor("noisy:0.5")
    assert isinstance(noisy, NoisyOraclePredictor) and noisy.sigma == 0.5
    assert isinstance(make_predictor(" Noisy:0.25 "), NoisyOraclePredictor)
    predictors: list[OutputPredictor] = [online, noisy]  # structural typing
    assert [p.name for p in predictors] == ["online", "noisy_oracle"]


@pytest.mark.parametrize(
    "spec",
    ["", "magic", "oracle:1", "online:2", "noisy", "noisy:", "noisy:x", "noisy:-1", "noisy:nan"],
)
def test_make_predictor_rejects_bad_specs(spec: str) -> None:
    with pytest.raises(ValueError) as info:
        make_predictor(spec)
    msg = str(info.value)
    assert "online" in msg and "oracle" in msg and "noisy:" in msg
