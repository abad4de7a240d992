"""Tests of disaggpool.core.profile: dict round trips, scaling, trust, malformed profiles."""

from __future__ import annotations

import copy
import dataclasses
import pickle
from collections.abc import Callable
from typing import Any

import pytest

from disaggpool.core.hardware import BUILTIN_PROFILES, builtin_profile
from disaggpool.core.profile import (
    BOUNDS,
    QUALITIES,
    CalibrationProfile,
    DecodeModel,
    KVTransferModel,
    PrefillModel,
    physics_problem,
    profile_from_dict,
    profile_to_dict,
)
from disaggpool.errors import InputError


def _valid() -> dict[str, Any]:
    return profile_to_dict(BUILTIN_PROFILES["a40-llama3-8b"])


# --- round trips -------------------------------------------------------------------------------


def test_builtin_profiles() -> None:
    assert set(BUILTIN_PROFILES) == {
        "a40-llama3-8b",
        "h100-llama3-8b",
        "a40-qwen2.5-3b",
        "a40-llama3-8b-datasheet",
        "h100-llama3-8b-datasheet",
        "a40-qwen2.5-3b-datasheet",
    }


def test_qwen_profile_is_the_roofline_of_its_model() -> None:
    """The study's hardware: Qwen2.5-3B on an A40 with a 60k-token KV budget. Every decode step
    streams the 6.17 GB of weights at the A40's achieved 0.56 TB/s plus 3 ms of overhead; the
    datasheet twin reads them at the peak 696 GB/s with no overhead (the gap calibration closes)."""
    measured = BUILTIN_PROFILES["a40-qwen2.5-3b"]
    sheet = BUILTIN_PROFILES["a40-qwen2.5-3b-datasheet"]
    assert measured.kv_capacity_tokens == sheet.kv_capacity_tokens == 60_000
    assert measured.decode.d0 == pytest.approx(0.003 + 6.17e9 / 0.56e12)
    assert sheet.decode.d0 == pytest.approx(6.17e9 / 696e9)
    assert measured.kv_transfer.bytes_per_token == 36 * 2 * 128 * 2 * 2
    # a 1,024-token prompt: 5.55 GFLOP per token at 100 achieved TFLOPS, plus overhead
    assert measured.prefill.prompt_time(1024) == pytest.approx(
        0.003 + 1024 * 5.55e9 / 100e12 + 1024**2 * 1.47e5 / 70e12
    )
    llama = BUILTIN_PROFILES["a40-llama3-8b"]
    assert measured.decode.step(32, 32_000) < 0.6 * llama.decode.step(32, 32_000)


@pytest.mark.parametrize("name", sorted(BUILTIN_PROFILES))
def test_builtin_round_trip(name: str) -> None:
    profile = BUILTIN_PROFILES[name]
    data = profile_to_dict(profile)
    assert data["schema_version"] == 1
    back = profile_from_dict(data, source=name)
    assert back == profile
    assert profile_to_dict(back) == data


def test_round_trip_with_optional_metadata() -> None:
    profile = dataclasses.replace(
        BUILTIN_PROFILES["h100-llama3-8b"],
        name="probed",
        source="probe",
        quality="poor",
        fitted_at="2025-01-02T03:04:05Z",
        ttft_mape=0.07,
        tpot_mape=0.031,
        notes="fitted on node 7",
        block_size=32,
        max_model_len=4096,
        unmeasured=("kv_transfer",),
    )
    data = profile_to_dict(profile)
    assert data["metadata"] == {
        "source": "probe",
        "quality": "poor",
        "fitted_at": "2025-01-02T03:04:05Z",
        "ttft_mape": 0.07,
        "tpot_mape": 0.031,
        "notes": "fitted on node 7",
        "unmeasured": ["kv_transfer"],
    }
    assert profile_from_dict(data) == profile
    assert not profile.transfer_measured


def test_unmeasured_through_yaml_and_absent_when_everything_was_measured() -> None:
    """`metadata.unmeasured` survives the file format (YAML text, not only dicts), and a profile
    that measured everything writes no such key (files written before it existed still read)."""
    yaml = pytest.importorskip("yaml")
    probed = dataclasses.replace(
        BUILTIN_PROFILES["a40-llama3-8b"], source="probe", unmeasured=("kv_transfer",)
    )
    text = yaml.safe_dump(profile_to_dict(probed))
    assert "unmeasured:\n  - kv_transfer\n" in text
    back = profile_from_dict(yaml.safe_load(text), source="probed.yaml")
    assert back == probed and back.unmeasured == ("kv_transfer",)
    full = BUILTIN_PROFILES["a40-llama3-8b"]
    assert full.transfer_measured and "unmeasured" not in profile_to_dict(full)["metadata"]
    data = _valid()
    data["metadata"]["unmeasured"] = None  # null: nothing unmeasured, as when absent
    assert profile_from_dict(data).unmeasured == ()
    data["metadata"]["unmeasured"] = []
    assert profile_from_dict(data).unmeasured == ()


def test_defaults_for_optional_fields() -> None:
    data = _valid()
    for key in ("schema_version", "gpu", "model", "block_size", "max_model_len", "metadata"):
        del data[key]
    p = profile_from_dict(data)
    assert (p.block_size, p.max_model_len, p.gpu, p.model) == (16, 8192, "", "")
    assert (p.source, p.quality, p.trusted) == ("user", "unknown", False)
    assert p.ttft_mape is None and p.tpot_mape is None


def test_integers_accepted_for_coefficients() -> None:
    data = _valid()
    data["prefill"] = {"p0": 0, "p1": 1, "p2": 0}
    p = profile_from_dict(data)
    assert p.prefill == PrefillModel(0.0, 1.0, 0.0)
    assert isinstance(p.prefill.p1, float)


def test_builtin_profile_lookup() -> None:
    assert builtin_profile("a40-llama3-8b") is BUILTIN_PROFILES["a40-llama3-8b"]
    with pytest.raises(KeyError, match="valid: a40-llama3-8b"):
        builtin_profile("nope")


# --- the models --------------------------------------------------------------------------------


def test_model_formulas() -> None:
    pf = PrefillModel(0.01, 1e-4, 1e-8)
    assert pf.prompt_time(1000) == pytest.approx(0.01 + 0.1 + 0.01)
    assert pf.time(1500, 1000**2 + 500**2) == pytest.approx(0.01 + 0.15 + 0.0125)
    dm = DecodeModel(0.03, 1e-4, 2e-7)
    assert dm.step(10, 5000) == pytest.approx(0.03 + 0.001 + 0.001)
    kv = KVTransferModel(0.002, 131072, 20e9)
    assert kv.time(1000) == pytest.approx(0.002 + 1000 * 131072 / 20e9)


# --- scaled ------------------------------------------------------------------------------------


def test_scaled_divides_compute_terms_only() -> None:
    base = BUILTIN_PROFILES["a40-llama3-8b"]
    slow = base.scaled(0.8, name="slow")
    assert slow.name == "slow"
    for f in ("p0", "p1", "p2"):
        assert getattr(slow.prefill, f) == pytest.approx(getattr(base.prefill, f) / 0.8)
    for f in ("d0", "d1", "d2"):
        assert getattr(slow.decode, f) == pytest.approx(getattr(base.decode, f) / 0.8)
    assert slow.kv_transfer == base.kv_transfer
    assert slow.kv_capacity_tokens == base.kv_capacity_tokens
    assert slow.max_num_seqs == base.max_num_seqs
    assert slow.max_num_batched_tokens == base.max_num_batched_tokens
    assert (slow.source, slow.quality) == (base.source, base.quality)
    assert slow.prefill.prompt_time(2000) == pytest.approx(base.prefill.prompt_time(2000) / 0.8)


def test_scaled_keeps_name_and_identity_speed() -> None:
    base = BUILTIN_PROFILES["h100-llama3-8b"]
    assert base.scaled(2.0).name == base.name
    same = base.scaled(1.0)
    assert same.prefill == base.prefill and same.decode == base.decode
    assert base.scaled(2.0).scaled(0.5).decode.d0 == pytest.approx(base.decode.d0)


@pytest.mark.parametrize("speed", [0.0, -1.0])
def test_scaled_rejects_non_positive_speed(speed: float) -> None:
    with pytest.raises(ValueError, match="positive"):
        BUILTIN_PROFILES["a40-llama3-8b"].scaled(speed)


# --- trusted -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("quality", "trusted"), [("good", True), ("fair", True), ("poor", False), ("unknown", False)]
)
def test_trusted(quality: str, trusted: bool) -> None:
    p = dataclasses.replace(BUILTIN_PROFILES["a40-llama3-8b"], quality=quality)
    assert p.trusted is trusted


def test_every_quality_is_covered() -> None:
    assert set(QUALITIES) == {"good", "fair", "poor", "unknown"}


def test_builtins_are_trusted() -> None:
    assert all(p.trusted for p in BUILTIN_PROFILES.values())


def test_profile_is_frozen() -> None:
    p: CalibrationProfile = BUILTIN_PROFILES["a40-llama3-8b"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.name = "x"  # type: ignore[misc]


# --- malformed profiles ------------------------------------------------------------------------

Mutation = Callable[[dict[str, Any]], Any]


def _drop_d1(d: dict[str, Any]) -> None:
    del d["decode"]["d1"]


def _set(path: str, value: Any) -> Mutation:
    def mutate(d: dict[str, Any]) -> None:
        *parents, leaf = path.split(".")
        target = d
        for p in parents:
            target = target[p]
        target[leaf] = value

    return mutate


def _drop(key: str) -> Mutation:
    def mutate(d: dict[str, Any]) -> None:
        del d[key]

    return mutate


BW, BPT = "kv_transfer.bandwidth_bytes_per_s", "kv_transfer.bytes_per_token"

MALFORMED: list[tuple[str, Mutation, str]] = [
    ("missing decode.d1", _drop_d1, "decode.d1"),
    ("negative p1", _set("prefill.p1", -1e-4), "prefill.p1"),
    (
        "zero bandwidth",
        _set("kv_transfer.bandwidth_bytes_per_s", 0),
        "kv_transfer.bandwidth_bytes_per_s",
    ),
    (
        "zero bytes per token",
        _set("kv_transfer.bytes_per_token", 0.0),
        "kv_transfer.bytes_per_token",
    ),
    ("string coefficient", _set("decode.d0", "fast"), "decode.d0"),
    ("bool coefficient", _set("prefill.p0", True), "prefill.p0"),
    ("infinite coefficient", _set("decode.d2", float("inf")), "decode.d2"),
    ("nan coefficient", _set("prefill.p2", float("nan")), "prefill.p2"),
    ("float capacity", _set("kv_capacity_tokens", 1.5e5), "kv_capacity_tokens"),
    ("zero max_num_seqs", _set("max_num_seqs", 0), "max_num_seqs"),
    ("string block_size", _set("block_size", "16"), "block_size"),
    ("missing capacity", _drop("kv_capacity_tokens"), "kv_capacity_tokens"),
    ("missing decode section", _drop("decode"), "decode"),
    ("section not a mapping", _set("prefill", [1, 2, 3]), "prefill"),
    ("missing name", _drop("name"), "name"),
    ("empty name", _set("name", ""), "name"),
    ("unknown top-level field", _set("colour", "blue"), "colour"),
    ("unknown section field", _set("decode.d3", 0.1), "decode.d3"),
    ("unknown metadata field", _set("metadata.qualty", "good"), "metadata.qualty"),
    ("bad metadata.quality", _set("metadata.quality", "great"), "metadata.quality"),
    ("bad metadata.source", _set("metadata.source", "guess"), "metadata.source"),
    ("negative ttft_mape", _set("metadata.ttft_mape", -0.1), "metadata.ttft_mape"),
    ("metadata not a mapping", _set("metadata", ["good"]), "metadata"),
    ("unmeasured not a list", _set("metadata.unmeasured", "kv_transfer"), "metadata.unmeasured"),
    ("unknown unmeasured term", _set("metadata.unmeasured", ["kv_link"]), "metadata.unmeasured"),
    ("unmeasured non-string", _set("metadata.unmeasured", [1]), "metadata.unmeasured"),
    (
        "unmeasured twice",
        _set("metadata.unmeasured", ["kv_transfer", "kv_transfer"]),
        "metadata.unmeasured",
    ),
    ("bad schema_version", _set("schema_version", 2), "schema_version"),
    ("string schema_version", _set("schema_version", "1"), "schema_version"),
    # Well-formed, but no engine: a fit can come out like this, and `good` would route by it.
    ("zero decode step", _set("decode", {"d0": 0, "d1": 0, "d2": 0}), "decode.d0"),
    ("sub-microsecond decode step", _set("decode.d0", 5e-7), "decode.d0"),
    ("free prefill tokens", _set("prefill.p1", 0.0), "prefill.p1"),
    ("a decode step of minutes", _set("decode.d0", 3600.0), "decode.d0"),
    ("1 kB/s link", _set(BW, 1e3), BW),
    ("fractional byte per token", _set(BPT, 0.5), BPT),
    ("petabyte KV cache", _set("kv_capacity_tokens", 10**13), "kv_capacity_tokens"),
    ("million-token blocks", _set("block_size", 10**6), "block_size"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("mutate", "field"), [(m, f) for _, m, f in MALFORMED], ids=[i for i, _, _ in MALFORMED]
)
def test_malformed_profile_names_field(mutate: Mutation, field: str) -> None:
    data = copy.deepcopy(_valid())
    mutate(data)
    with pytest.raises(InputError) as info:
        profile_from_dict(data, source="bad.yaml")
    assert info.value.field == field
    assert info.value.source == "bad.yaml"
    assert str(info.value).startswith(f"bad.yaml: {field}: ")


def test_a_bad_unmeasured_value_says_what_is_allowed() -> None:
    data = _valid()
    data["metadata"]["unmeasured"] = ["decode"]
    with pytest.raises(InputError, match=r"metadata\.unmeasured: terms must be among kv_transfer"):
        profile_from_dict(data, source="bad.yaml")


@pytest.mark.parametrize("root", [None, [], ["name"], "a40-llama3-8b", 42])
def test_non_mapping_root(root: Any) -> None:
    with pytest.raises(InputError) as info:
        profile_from_dict(root, source="root.yaml")
    assert info.value.field == "<root>"
    assert info.value.source == "root.yaml"


def test_input_error_is_value_error() -> None:
    with pytest.raises(ValueError):
        profile_from_dict({}, source="x")


def test_partial_prefill_time_charges_the_new_tokens_over_the_whole_context() -> None:
    pf = PrefillModel(0.01, 1e-4, 1e-8)
    assert pf.partial_time(3000, 0, 8192) == pytest.approx(pf.prompt_time(3000))
    # 1000 new tokens in two chunks of 512, attending over all 3000
    expected = 2 * 0.01 + 1e-4 * 1000 + 1e-8 * (3000**2 - 2000**2)
    assert pf.partial_time(3000, 2000, 512) == pytest.approx(expected)


# --- physics -----------------------------------------------------------------------------------


def _numeric_fields() -> set[str]:
    out = {f"{sec}.{f.name}" for sec in ("prefill", "decode", "kv_transfer")
           for f in dataclasses.fields(getattr(A40, sec))}  # fmt: skip
    return out | {f.name for f in dataclasses.fields(CalibrationProfile) if f.type in ("int", int)}


A40 = BUILTIN_PROFILES["a40-llama3-8b"]


def test_every_constant_has_physical_bounds() -> None:
    """A constant added to the profile without a bound would escape the physics check."""
    assert set(BOUNDS) == _numeric_fields()


@pytest.mark.parametrize("path", sorted(BOUNDS))
def test_each_bound_is_inclusive_and_refuses_beyond_it(path: str) -> None:
    low, high, unit, _ = BOUNDS[path]
    integer = isinstance(low, int)
    for edge in (low, high if high != float("inf") else 1e30):
        data = _valid()
        _set(path, int(edge) if integer else float(edge))(data)
        profile_from_dict(data, source="edge.yaml")  # at the bound: accepted
    beyond = [high + 1 if integer else high * 1.01] if high != float("inf") else []
    if low > 0:
        beyond.append(low - 1 if integer else low * 0.99)
    for value in beyond:
        data = _valid()
        _set(path, value)(data)
        with pytest.raises(InputError) as info:
            profile_from_dict(data, source="bad.yaml")
        assert info.value.field == path
        if value > 0:  # 0 and below fail the schema check first, with its own message
            assert f" {unit} (" in info.value.message
            assert info.value.message.endswith(repr(value))


def test_a_zero_decode_step_is_refused_naming_the_field_and_the_physics() -> None:
    data = _valid()
    data["decode"]["d0"] = 0.0
    with pytest.raises(InputError) as info:
        profile_from_dict(data, source="zero.yaml")
    assert str(info.value) == (
        "zero.yaml: decode.d0: must be between 1e-06 and 60 s "
        "(every step reads all the weights: under 1 us is no engine), got 0.0"
    )


def test_schema_errors_come_before_physics() -> None:
    """A negative or non-finite constant keeps its schema message (PROFILES.md quotes them)."""
    data = _valid()
    data["prefill"]["p1"] = -0.1
    with pytest.raises(InputError, match=r"must be a finite non-negative number, got -0\.1"):
        profile_from_dict(data)


@pytest.mark.parametrize(
    "broken",
    [
        DecodeModel(0.0, 0.0, 0.0),
        DecodeModel(float("nan"), 1e-4, 2e-7),
        DecodeModel(float("inf"), 1e-4, 2e-7),
        DecodeModel(-0.03, 1e-4, 2e-7),
        DecodeModel(1e-300, 0.0, 0.0),
        DecodeModel(0.03, 1e300, 2e-7),
        DecodeModel("fast", 1e-4, 2e-7),  # type: ignore[arg-type]
    ],
    ids=["zero", "nan", "inf", "negative", "subnormal", "huge", "string"],
)
def test_a_profile_built_in_code_outside_the_bounds_is_never_trusted(broken: DecodeModel) -> None:
    """The scorer reads `trusted`: a profile that no file could carry keeps its constants but
    is priced like a pod without a profile (core.policies.calibrated)."""
    p = dataclasses.replace(A40, decode=broken)
    assert p.quality == "good" and not p.trusted
    assert p.implausible.startswith("decode.d")
    assert physics_problem(p) is not None
    assert physics_problem(A40) is None and A40.implausible == ""


def test_huge_integers_are_a_problem_not_an_overflow() -> None:
    p = dataclasses.replace(A40, kv_capacity_tokens=10**400, max_num_batched_tokens=0)
    assert p.implausible.startswith("kv_capacity_tokens: must be between 1 and 1e+12 tokens")


def test_distrust_makes_a_profile_untrusted_without_changing_what_it_is() -> None:
    distrusted = dataclasses.replace(A40, distrust="drift error 0.8 > 0.5")
    assert not distrusted.trusted and A40.trusted
    assert distrusted == A40 and hash(distrusted) == hash(A40)  # the same profile, re-delivered
    assert "distrust" not in profile_to_dict(distrusted)["metadata"]  # router state, not a file's
    assert dataclasses.replace(distrusted, name="x").distrust  # kept by copies
    assert "distrust" not in repr(distrusted) and "implausible" not in repr(distrusted)


def test_trust_survives_pickling() -> None:
    """The simulator's worker processes receive profiles pickled."""
    for p in (
        A40,
        dataclasses.replace(A40, quality="poor"),
        dataclasses.replace(A40, distrust="x"),
    ):
        back = pickle.loads(pickle.dumps(p))
        assert (back.trusted, back.implausible, back.distrust) == (
            p.trusted, p.implausible, p.distrust
        )  # fmt: skip


@pytest.mark.parametrize("name", sorted(BUILTIN_PROFILES))
def test_builtins_sit_inside_the_bounds_scaled_tenfold_either_way(name: str) -> None:
    """Generous bounds: the shipped profiles stay plausible on a card ten times faster or
    slower (`scaled`, as scenarios' `speed` does)."""
    for speed in (0.1, 1.0, 10.0):
        assert BUILTIN_PROFILES[name].scaled(speed).implausible == ""
