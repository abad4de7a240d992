"""Tests of disaggpool.formats.profiles: YAML/JSON files, built-in names, malformed files."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from disaggpool.core.hardware import BUILTIN_PROFILES
from disaggpool.core.profile import profile_from_dict, profile_to_dict
from disaggpool.errors import InputError
from disaggpool.formats.profiles import dump_profile, load_profile, resolve_profile, save_profile

A40 = BUILTIN_PROFILES["a40-llama3-8b"]
CUSTOM = dataclasses.replace(
    BUILTIN_PROFILES["h100-llama3-8b"],
    name="my-h100",
    source="probe",
    quality="fair",
    fitted_at="2025-03-01T12:00:00Z",
    ttft_mape=0.042,
    tpot_mape=0.018,
    notes="line one\nline two: with a colon",
)


# --- round trips -------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".yaml", ".yml", ".json"])
@pytest.mark.parametrize("profile", [*BUILTIN_PROFILES.values(), CUSTOM], ids=lambda p: p.name)
def test_save_load_round_trip(tmp_path: Path, suffix: str, profile: object) -> None:
    path = tmp_path / f"profile{suffix}"
    save_profile(profile, path)  # type: ignore[arg-type]
    assert load_profile(path) == profile
    assert load_profile(str(path)) == profile


def test_save_format_follows_suffix(tmp_path: Path) -> None:
    save_profile(A40, tmp_path / "p.json")
    save_profile(A40, tmp_path / "p.yaml")
    assert json.loads((tmp_path / "p.json").read_text()) == profile_to_dict(A40)
    assert yaml.safe_load((tmp_path / "p.yaml").read_text()) == profile_to_dict(A40)
    with pytest.raises(json.JSONDecodeError):
        json.loads((tmp_path / "p.yaml").read_text())


@pytest.mark.parametrize("fmt", ["yaml", "json"])
@pytest.mark.parametrize("name", sorted(BUILTIN_PROFILES))
def test_dump_profile_parses_back(fmt: str, name: str) -> None:
    text = dump_profile(BUILTIN_PROFILES[name], fmt)
    assert text.endswith("\n")
    data = json.loads(text) if fmt == "json" else yaml.safe_load(text)
    assert data == profile_to_dict(BUILTIN_PROFILES[name])
    assert profile_from_dict(data) == BUILTIN_PROFILES[name]


def test_dump_yaml_keeps_field_order() -> None:
    keys = list(yaml.safe_load(dump_profile(A40)))
    assert keys[:4] == ["schema_version", "name", "gpu", "model"]
    assert keys[-1] == "metadata"


def test_hand_written_yaml(tmp_path: Path) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text(
        """
name: mine
prefill: {p0: 0.002, p1: 1.0e-4, p2: 0}
decode: {d0: 0.02, d1: 0, d2: 2.0e-7}
kv_transfer: {k0: 0, bytes_per_token: 131072, bandwidth_bytes_per_s: 25.0e9}
kv_capacity_tokens: 100000
max_num_seqs: 128
max_num_batched_tokens: 4096
metadata: {source: user, quality: good}
""",
        encoding="utf-8",
    )
    p = load_profile(path)
    assert (p.name, p.max_num_seqs, p.block_size, p.trusted) == ("mine", 128, 16, True)
    assert p.kv_transfer.bandwidth_bytes_per_s == 25e9


# --- resolve_profile ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(BUILTIN_PROFILES))
def test_resolve_builtin_name(name: str, tmp_path: Path) -> None:
    assert resolve_profile(name) is BUILTIN_PROFILES[name]
    assert resolve_profile(name, tmp_path) is BUILTIN_PROFILES[name]


def test_resolve_relative_path_with_base(tmp_path: Path) -> None:
    (tmp_path / "profiles").mkdir()
    save_profile(CUSTOM, tmp_path / "profiles" / "custom.yaml")
    assert resolve_profile("profiles/custom.yaml", tmp_path) == CUSTOM
    assert resolve_profile(str(tmp_path / "profiles" / "custom.yaml")) == CUSTOM
    # An absolute path ignores the base.
    other = tmp_path / "elsewhere"
    other.mkdir()
    assert resolve_profile(str(tmp_path / "profiles" / "custom.yaml"), other) == CUSTOM


def test_resolve_relative_path_is_relative_to_base(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_profile(CUSTOM, tmp_path / "custom.json")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    with pytest.raises(InputError):
        resolve_profile("custom.json")
    assert resolve_profile("custom.json", tmp_path) == CUSTOM


def test_resolve_unknown_name(tmp_path: Path) -> None:
    with pytest.raises(InputError) as info:
        resolve_profile("nope-gpu", tmp_path)
    assert info.value.source == "nope-gpu"
    assert "a40-llama3-8b" in info.value.message  # lists the built-ins


# --- malformed files ---------------------------------------------------------------------------


def test_invalid_yaml_names_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("name: [unclosed\nprefill: {p0: 1", encoding="utf-8")
    with pytest.raises(InputError) as info:
        load_profile(path)
    assert info.value.source == str(path)
    assert info.value.field == "<file>"
    assert "YAML" in info.value.message


def test_invalid_json_names_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text('{"name": "x",}', encoding="utf-8")
    with pytest.raises(InputError) as info:
        load_profile(path)
    assert info.value.source == str(path)
    assert info.value.field == "<file>"
    assert "JSON" in info.value.message


def test_missing_file_names_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.yaml"
    with pytest.raises(InputError) as info:
        load_profile(path)
    assert info.value.source == str(path)
    assert info.value.field == "<file>"
    with pytest.raises(InputError) as info2:
        resolve_profile("absent.yaml", tmp_path)
    assert "absent.yaml" in str(info2.value)


def test_empty_file_is_not_a_profile(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("", encoding="utf-8")
    with pytest.raises(InputError) as info:
        load_profile(path)
    assert info.value.source == str(path)
    assert info.value.field == "<root>"


def test_invalid_field_in_file_names_file_and_field(tmp_path: Path) -> None:
    data = profile_to_dict(A40)
    del data["decode"]["d1"]
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    with pytest.raises(InputError) as info:
        resolve_profile("p.yaml", tmp_path)
    assert info.value.source == str(path)
    assert info.value.field == "decode.d1"
    assert str(info.value) == f"{path}: decode.d1: missing"


@pytest.mark.parametrize(
    ("text", "value"), [("20e9", 20e9), ("2.5e+10", 2.5e10), ("1E9", 1e9), ("25.0e9", 25e9)]
)
def test_yaml_exponent_without_dot_or_sign_is_a_number(
    tmp_path: Path, text: str, value: float
) -> None:
    # PyYAML's YAML 1.1 resolver reads `20e9` as a string; profile files accept it as a number.
    data = profile_to_dict(A40)
    body = yaml.safe_dump(data).replace("20000000000.0", text)
    assert text in body
    path = tmp_path / "p.yaml"
    path.write_text(body, encoding="utf-8")
    assert load_profile(path).kv_transfer.bandwidth_bytes_per_s == value


# --- every profile the repo ships passes the physics ------------------------------------------

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def _profiles_in(doc: object, where: str) -> list[tuple[str, dict[str, object]]]:
    """Every mapping shaped like a whole profile inside a parsed JSON/YAML document."""
    found: list[tuple[str, dict[str, object]]] = []
    if isinstance(doc, dict):
        if {"prefill", "decode", "kv_transfer", "kv_capacity_tokens"} <= set(doc):
            found.append((where, doc))
        for key, value in doc.items():
            found += _profiles_in(value, f"{where}/{key}")
    elif isinstance(doc, list):
        for i, value in enumerate(doc):
            found += _profiles_in(value, f"{where}[{i}]")
    return found


def _repo_profiles() -> list[tuple[str, dict[str, object]]]:
    """Probe results recorded by the benchmarks (and earlier fits on real vLLM kept beside this
    file), golden files, and every YAML block of the docs that is a profile (PROFILES.md's example
    among them)."""
    found = []
    recorded = [*REPO.glob("bench/*.json"), *REPO.glob("docs/**/*.json"), *HERE.glob("*.json")]
    for path in sorted(recorded):
        found += _profiles_in(json.loads(path.read_text(encoding="utf-8")), path.name)
    for path in sorted([*REPO.glob("tests/operator/golden/*.yaml"), *REPO.glob("examples/*.yaml")]):
        for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")):
            found += _profiles_in(doc, path.name)
    docs = [*REPO.glob("*.md"), *REPO.glob("docs/**/*.md"), *REPO.glob("src/disaggpool/**/*.md")]
    for path in sorted(docs):
        for block in path.read_text(encoding="utf-8").split("```yaml")[1:]:
            try:
                doc = yaml.safe_load(block.split("```")[0])
            except yaml.YAMLError:
                continue  # an excerpt with placeholders, not a document
            found += _profiles_in(doc, path.name)
    return found


def test_every_profile_in_the_repo_is_plausible() -> None:
    """The physical bounds are generous enough for every real profile: the built-ins, what the
    probe fitted on real vLLM and on the emulators (bench/*.json), the docs' examples."""
    found = _repo_profiles()
    assert len(found) >= 20, [w for w, _ in found]  # the walk found the benchmarks' probes
    assert any(w == "PROFILES.md" for w, _ in found)
    for where, data in found:
        profile_from_dict(data, source=where)  # raises InputError naming the field
    for profile in BUILTIN_PROFILES.values():
        profile_from_dict(profile_to_dict(profile), source=profile.name)
