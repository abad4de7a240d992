"""The scorer whatever it is fed: hypothesis over profiles and pool states.

Profiles come valid, at the very edges of `core.profile.BOUNDS`, or built in code the way no file
could make them (zeros, negatives, subnormals, 1e300, infinities, NaN, zero or astronomically
large integers). Pool states are any non-negative counts up to far beyond an engine. Whatever
they are, every policy returns a decision naming healthy pods with finite, non-negative
predictions, or raises its documented `NoCapacityError`: never ZeroDivisionError, OverflowError,
ValueError from a NaN or infinity, and never a NaN that makes every comparison false (which would
silently pick whichever pod came last). Zero decode constants with two decode pods are the case
that reaches the scarcity guard's division.
"""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from disaggpool.core.contracts import (
    InstanceSnapshot,
    PoolSnapshot,
    RequestFeatures,
    RouteDecision,
    SLOClass,
    TpotBudgets,
)
from disaggpool.core.hardware import BUILTIN_PROFILES
from disaggpool.core.policies.base import DecodeChoice, NoCapacityError
from disaggpool.core.policies.calibrated import CalibratedPolicy
from disaggpool.core.policies.registry import (
    NEEDS_DATASHEET,
    POLICY_NAMES,
    PolicyOptions,
    make_policy,
)
from disaggpool.core.profile import (
    BOUNDS,
    CalibrationProfile,
    DecodeModel,
    KVTransferModel,
    PrefillModel,
)

A40 = BUILTIN_PROFILES["a40-llama3-8b"]
SLO = SLOClass("chat", 2.0, 0.1)

# ----------------------------------------------------------------------------- strategies

_WILD_FLOATS = st.one_of(
    st.sampled_from(
        [
            0.0,
            -0.0,
            -1.0,
            5e-324,
            1e-300,
            1e-12,
            1e-7,
            1e300,
            1.7e308,
            math.inf,
            -math.inf,
            math.nan,
        ]
    ),
    st.floats(allow_nan=True, allow_infinity=True),
)
_WILD_INTS = st.one_of(
    st.sampled_from([0, -1, 1, 2, 10**12, 10**13, 10**400]),
    st.integers(min_value=-5, max_value=10**7),
)
_INT_FIELDS = (
    "kv_capacity_tokens",
    "max_num_seqs",
    "max_num_batched_tokens",
    "block_size",
    "max_model_len",
)


def _real(path: str, p: CalibrationProfile) -> float:
    section, _, name = path.partition(".")
    return float(getattr(getattr(p, section), name) if name else getattr(p, section))


@st.composite
def _value(draw: st.DrawFn, path: str, base: CalibrationProfile, mode: str) -> Any:
    """One constant: the base profile's, scaled, at a bound (`edge`) or anything (`wild`)."""
    low, high, _, _ = BOUNDS[path]
    integer = path in _INT_FIELDS
    real = _real(path, base)
    choice = draw(
        st.sampled_from(["real", "scaled", "edge"] + (["wild"] if mode == "wild" else []))
    )
    if choice == "real":
        value: Any = real
    elif choice == "scaled":
        value = min(high, max(low, real * draw(st.floats(0.01, 100.0))))
    elif choice == "edge":
        value = draw(st.sampled_from([low, high if high != math.inf else 1e30]))
    else:
        return draw(_WILD_INTS if integer else _WILD_FLOATS)
    return int(value) if integer else float(value)


@st.composite
def profiles(draw: st.DrawFn) -> CalibrationProfile | None:
    """A profile as a pod might carry one, or None. `plausible`: every constant within BOUNDS
    (at the bounds, often); `wild`: any of them may be anything a float or an int can be."""
    if draw(st.integers(0, 9)) == 0:
        return None
    base = draw(st.sampled_from(list(BUILTIN_PROFILES.values())))
    mode = draw(st.sampled_from(["plausible", "plausible", "wild"]))
    v = {path: draw(_value(path, base, mode)) for path in BOUNDS}
    return CalibrationProfile(
        name=base.name,
        prefill=PrefillModel(v["prefill.p0"], v["prefill.p1"], v["prefill.p2"]),
        decode=DecodeModel(v["decode.d0"], v["decode.d1"], v["decode.d2"]),
        kv_transfer=KVTransferModel(
            v["kv_transfer.k0"],
            v["kv_transfer.bytes_per_token"],
            v["kv_transfer.bandwidth_bytes_per_s"],
        ),
        **{f: v[f] for f in _INT_FIELDS},
        quality=draw(st.sampled_from(["good", "good", "fair", "poor", "unknown"])),
        unmeasured=draw(st.sampled_from([(), ("kv_transfer",)])),
    )


def _count(top: int) -> st.SearchStrategy[int]:
    return st.one_of(st.sampled_from([0, 1, top]), st.integers(0, top))


def _amount(top: float) -> st.SearchStrategy[float]:
    return st.one_of(st.sampled_from([0.0, 1.0, top]), st.floats(0.0, top))


@st.composite
def instances(draw: st.DrawFn, name: str, role: str) -> InstanceSnapshot:
    queued_tokens = draw(_count(10**9))
    queued_sq = draw(_amount(1e18))
    groups = draw(
        st.lists(
            st.tuples(st.floats(-10.0, 10.0), st.integers(1, 10**6), st.integers(1, 10**4)),
            max_size=4,
        )
    )
    return InstanceSnapshot(
        name=name,
        role=role,  # type: ignore[arg-type]
        running=draw(_count(10**6)),
        waiting=draw(_count(10**6)),
        kv_tokens_used=draw(_count(10**9)),
        inflight=draw(_count(10**6)),
        queued=draw(_count(10**6)),
        queued_tokens=queued_tokens,
        queued_sq_tokens=queued_sq,
        yielded_tokens=draw(st.integers(0, queued_tokens)),
        yielded_sq_tokens=draw(st.floats(0.0, queued_sq)),
        remaining_output_tokens=draw(_amount(1e9)),
        tpot_budgets=TpotBudgets.of(groups),
        local_prefill_tokens=draw(_count(10**9)),
        local_prefill_sq_tokens=draw(_amount(1e18)),
        ttft_slack_s=tuple(sorted(draw(st.lists(st.floats(-100.0, 100.0), max_size=4)))),
        foreign=draw(_count(10**6)),
        healthy=draw(st.integers(0, 5)) > 0,
        profile=draw(profiles()),
    )


@st.composite
def pools(draw: st.DrawFn) -> PoolSnapshot:
    n_p, n_d = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    return PoolSnapshot(
        now=0.0,
        prefill=[draw(instances(f"p{i}", "prefill")) for i in range(n_p)],
        decode=[draw(instances(f"d{i}", "decode")) for i in range(n_d)],
        unbound_kv_tokens=draw(_amount(1e9)),
    )


@st.composite
def requests(draw: st.DrawFn, pool: PoolSnapshot) -> RequestFeatures:
    n = draw(st.one_of(st.sampled_from([1, 2, 10**6]), st.integers(1, 200_000)))
    hits = {i.name: draw(st.integers(0, n)) for i in pool.prefill if draw(st.booleans())}
    slo = SLOClass(
        "c",
        draw(st.floats(0.001, 1000.0)),
        draw(st.floats(0.0001, 10.0)),
        sheddable=draw(st.booleans()),
    )
    return RequestFeatures("r", n, draw(_amount(1e5)), draw(_amount(1e5)), slo, prefix_hits=hits)


# ----------------------------------------------------------------------------- checks


def _valid(decision: RouteDecision, pool: PoolSnapshot, *, local_ok: bool = False) -> None:
    healthy_d = {i.name for i in pool.decode if i.healthy}
    healthy_p = {i.name for i in pool.prefill if i.healthy}
    assert decision.decode in healthy_d
    if decision.prefill is None:
        assert local_ok, "only the P/D decider prefills on a decode pod"
    else:
        assert decision.prefill in healthy_p
    for value in (decision.predicted_ttft_s, decision.predicted_tpot_s):
        assert value is None or (math.isfinite(value) and value >= 0.0), decision


def _scored_with(decision: RouteDecision, pool: PoolSnapshot, *, late: bool = False) -> None:
    """A pod without a trusted profile never goes unnoticed: the decision says what it fell
    back on, and with every healthy pod trusted it falls back on nothing."""
    roles = [pool.decode] if late else [pool.prefill, pool.decode]
    healthy = [i for role in roles for i in role if i.healthy]
    if all(i.profile is not None and i.profile.trusted for i in healthy):
        assert decision.fallback is None
    else:
        assert decision.fallback in ("median-profile", "least-loaded")


# ----------------------------------------------------------------------------- tests


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    pool=pools(),
    slack=st.sampled_from([0.5, None]),
    decider=st.booleans(),
    priority=st.booleans(),
)
def test_the_calibrated_policy_decides_whatever_it_is_fed(
    data: st.DataObject,
    pool: PoolSnapshot,
    slack: float | None,
    decider: bool,
    priority: bool,
) -> None:
    req = data.draw(requests(pool))
    policy = CalibratedPolicy(guard_slack=slack, pd_decider=decider, priority_scheduling=priority)
    rng = random.Random(0)
    try:
        decision = policy.route(req, pool, rng)
    except NoCapacityError:
        assert not all(any(i.healthy for i in role) for role in (pool.prefill, pool.decode))
    else:
        _valid(decision, pool, local_ok=decider)
        _scored_with(decision, pool)
    # Late binding: the decode pod alone, once the prefill leg on some prefill pod has returned.
    prefill = data.draw(st.sampled_from([i.name for i in pool.prefill]))
    elapsed = data.draw(_amount(1e4))
    try:
        late = policy.route_decode(DecodeChoice(req, pool, prefill, elapsed), rng)
    except NoCapacityError:
        assert not any(i.healthy for i in pool.decode)
    else:
        assert late.prefill == prefill
        assert late.decode in {i.name for i in pool.decode if i.healthy}
        for value in (late.predicted_ttft_s, late.predicted_tpot_s):
            assert value is None or (math.isfinite(value) and value >= 0.0), late
        _scored_with(late, pool, late=True)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), pool=pools(), name=st.sampled_from(POLICY_NAMES))
def test_every_policy_decides_whatever_it_is_fed(
    data: st.DataObject, pool: PoolSnapshot, name: str
) -> None:
    """The peers and baselines too: they price with the profiles to report predictions, and
    some divide by a block size or a capacity."""
    req = data.draw(requests(pool))
    datasheet = None
    if name in NEEDS_DATASHEET:
        datasheet = {i.name: data.draw(profiles()) or A40 for i in (*pool.prefill, *pool.decode)}
    policy = make_policy(name, datasheet=datasheet, options=PolicyOptions())
    try:
        decision = policy.route(req, pool, random.Random(0))
    except NoCapacityError:
        assert not all(any(i.healthy for i in role) for role in (pool.prefill, pool.decode))
    else:
        _valid(decision, pool)


# ----------------------------------------------------------------------------- the reported case


def _decode_pool(*decode: CalibrationProfile) -> PoolSnapshot:
    return PoolSnapshot(
        now=0.0,
        prefill=[InstanceSnapshot("p0", "prefill", profile=A40)],
        decode=[
            InstanceSnapshot(f"d{i}", "decode", inflight=i, profile=p) for i, p in enumerate(decode)
        ],
    )


@pytest.mark.parametrize(
    "decode",
    [DecodeModel(0.0, 0.0, 0.0), DecodeModel(1e-12, 1e-15, 1e-18)],
    ids=["zero", "near-zero"],
)
def test_a_decode_pod_with_no_step_time_is_scored_as_one_without_a_profile(
    decode: DecodeModel,
) -> None:
    """Zero decode constants marked `good`, built in code (a file is refused), with two decode
    pods: the guard's throughput weight would divide by zero, and near-zero constants would look
    infinitely fast and take every request. The pod is scored with the median trusted profile
    instead, and the decision says so."""
    broken = dataclasses.replace(A40, name="broken", decode=decode)
    assert broken.quality == "good" and not broken.trusted
    assert broken.implausible.startswith("decode.d0: ")
    pool = _decode_pool(A40, broken)
    policy = CalibratedPolicy(pd_decider=True)
    chosen = []
    for k in range(8):
        req = RequestFeatures(f"r{k}", 1000, 200.0, 100.0, SLO)
        decision = policy.route(req, pool, random.Random(k))
        assert decision.fallback == "median-profile"
        _valid(decision, pool, local_ok=True)
        chosen.append(decision.decode)
        late = policy.route_decode(DecodeChoice(req, pool, "p0", 0.5), random.Random(k))
        assert late.fallback == "median-profile"
    # Scored with the same (median) constants, the idle pod d0 is preferred to d1, which holds
    # a request: the broken pod no longer looks infinitely fast.
    assert set(chosen) == {"d0"}


def test_with_only_broken_profiles_the_policy_routes_least_loaded() -> None:
    broken = dataclasses.replace(A40, decode=DecodeModel(0.0, 0.0, 0.0))
    pool = _decode_pool(broken, broken)
    pool = dataclasses.replace(pool, prefill=[InstanceSnapshot("p0", "prefill", profile=broken)])
    decision = CalibratedPolicy().route(
        RequestFeatures("r", 100, 10.0, 5.0, SLO), pool, random.Random(0)
    )
    assert decision.fallback == "least-loaded" and decision.decode == "d0"
    assert decision.predicted_ttft_s is None  # an implausible profile predicts nothing


def test_datasheet_profiles_outside_the_bounds_count_as_missing() -> None:
    """`uncalibrated` scores with the profiles it is given, unless they are not physics."""
    broken = dataclasses.replace(A40, kv_transfer=KVTransferModel(0.0, 131072, 0.0))
    pool = _decode_pool(A40, A40)
    datasheet = {"p0": A40, "d0": A40, "d1": broken}
    decision = make_policy("uncalibrated", datasheet=datasheet).route(
        RequestFeatures("r", 100, 10.0, 5.0, SLO), pool, random.Random(0)
    )
    assert decision.fallback == "least-loaded"
