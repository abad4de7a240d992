"""CalibrationProfile: the constants that describe one vLLM instance's speed and memory.

Everything that predicts or simulates time reads a profile: the cost model (what the router
*believes*), the engine model that the simulator and the emulator run (what the hardware *does*),
and the calibration probe (which writes one). This module is pure: it builds and validates
profiles from plain mappings; reading and writing files is `disaggpool.formats.profiles`.

The formulas (seconds; token counts are integers):

* prefill iteration over chunks c_i of prompt tokens, chunk i starting at offset o_i:
  ``p0 + p1 * sum(c_i) + p2 * sum((o_i + c_i)**2 - o_i**2)``; for whole prompts of lengths n_i
  this is ``p0 + p1 * sum(n_i) + p2 * sum(n_i**2)`` (DistServe's functional form);
* decode step with B running sequences holding K context tokens in total: ``d0 + d1 * B + d2 * K``;
* KV transfer of n prompt tokens: ``k0 + n * bytes_per_token / bandwidth_bytes_per_s``.

A profile is validated as physics, not only as a schema: every constant must lie within
`BOUNDS` (PROFILES.md, "Physical bounds"), so a decode step of no time, a link of no bandwidth or
a prefill that costs nothing is refused where it is read (`profile_from_dict` raises `InputError`
naming the field). A profile built in code is checked when it is built: one outside the bounds
keeps its constants but is never `trusted`, so the scorer prices it as it prices a pod without a
profile (`core.policies.calibrated`) and never divides by what it cannot trust.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from disaggpool.errors import InputError

__all__ = [
    "BOUNDS",
    "QUALITIES",
    "SOURCES",
    "UNMEASURABLE",
    "CalibrationProfile",
    "DecodeModel",
    "KVTransferModel",
    "PrefillModel",
    "physics_problem",
    "profile_from_dict",
    "profile_to_dict",
]

SCHEMA_VERSION = 1
SOURCES = ("builtin", "datasheet", "probe", "user")
QUALITIES = ("good", "fair", "poor", "unknown")
#: The terms a profile may mark as not measured (`metadata.unmeasured`): the probe always fits
#: prefill and decode or fails, but measures the KV transfer only with a prefill peer.
UNMEASURABLE = ("kv_transfer",)

#: The physically plausible range of every constant, inclusive: field -> (lowest, highest, unit,
#: why). Far wider than any engine (the built-in profiles and every probe in the repo sit orders of
#: magnitude inside them); what they refuse is a constant the scorer cannot use: one it divides by
#: that is zero, or one so small or large that it sends every request to one pod or none.
#: PROFILES.md ("Physical bounds") gives the reasoning behind each.
BOUNDS: dict[str, tuple[float, float, str, str]] = {
    "prefill.p0": (0.0, 60.0, "s", "an iteration's fixed cost"),
    "prefill.p1": (1e-9, 10.0, "s/token", "under 1 ns is a billion prompt tokens a second"),
    "prefill.p2": (0.0, 1e-3, "s/token^2", "attention's cost per squared prompt length"),
    "decode.d0": (1e-6, 60.0, "s", "every step reads all the weights: under 1 us is no engine"),
    "decode.d1": (0.0, 1.0, "s/sequence", "a running sequence's cost per step"),
    "decode.d2": (0.0, 1e-3, "s/token", "reading one context token's KV cache"),
    "kv_transfer.k0": (0.0, 60.0, "s", "a transfer's setup cost"),
    "kv_transfer.bytes_per_token": (1.0, 1e9, "bytes", "one token's KV cache"),
    "kv_transfer.bandwidth_bytes_per_s": (1e6, math.inf, "bytes/s", "under 1 MB/s is no link"),
    "kv_capacity_tokens": (1, 10**12, "tokens", "10^12 tokens of KV cache are petabytes"),
    "max_num_seqs": (1, 10**6, "sequences", "beyond any engine's batch"),
    "max_num_batched_tokens": (1, 10**9, "tokens", "beyond any engine's iteration"),
    "block_size": (1, 65536, "tokens", "beyond any engine's KV block"),
    "max_model_len": (1, 10**9, "tokens", "beyond any model's context"),
}


@dataclasses.dataclass(frozen=True, slots=True)
class PrefillModel:
    """Prefill iteration time: p0 + p1 * tokens + p2 * sum of squared lengths (seconds)."""

    p0: float
    p1: float
    p2: float

    def time(self, tokens: int, sum_sq: float) -> float:
        return self.p0 + self.p1 * tokens + self.p2 * sum_sq

    def prompt_time(self, n: int) -> float:
        """One whole prompt of n tokens alone in an iteration."""
        return self.p0 + self.p1 * n + self.p2 * n * n

    def partial_time(self, n: int, cached: int, max_batched_tokens: int) -> float:
        """A prompt of n tokens whose first `cached` are in the prefix cache, alone, in chunks of
        `max_batched_tokens`: the new tokens' linear work and their attention over the whole
        context (COSTMODEL.md, "The prefix cache"); `cached=0` is the whole prompt."""
        new = n - cached
        return (
            self.p0 * -(-new // max_batched_tokens)
            + self.p1 * new
            + self.p2 * (n * n - cached * cached)
        )


@dataclasses.dataclass(frozen=True, slots=True)
class DecodeModel:
    """Decode step time: d0 + d1 * running sequences + d2 * context tokens (seconds)."""

    d0: float
    d1: float
    d2: float

    def step(self, running: int, context_tokens: float) -> float:
        return self.d0 + self.d1 * running + self.d2 * context_tokens


@dataclasses.dataclass(frozen=True, slots=True)
class KVTransferModel:
    """Time to move the KV cache of n prompt tokens from a prefill to a decode instance."""

    k0: float
    bytes_per_token: float
    bandwidth_bytes_per_s: float

    def time(self, tokens: int) -> float:
        return self.k0 + tokens * self.bytes_per_token / self.bandwidth_bytes_per_s


@dataclasses.dataclass(frozen=True, slots=True)
class CalibrationProfile:
    """Per-instance constants plus where they came from and how far to trust them."""

    name: str
    prefill: PrefillModel
    decode: DecodeModel
    kv_transfer: KVTransferModel
    kv_capacity_tokens: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int = 16
    max_model_len: int = 8192
    gpu: str = ""
    model: str = ""
    source: str = "user"
    quality: str = "unknown"
    fitted_at: str = ""
    ttft_mape: float | None = None
    tpot_mape: float | None = None
    notes: str = ""
    #: Terms of `UNMEASURABLE` whose constants are defaults, not measurements (in that order).
    unmeasured: tuple[str, ...] = ()
    #: Why the router stopped trusting this profile ("" while it does): its predictions were
    #: contradicted by what the pod did (`sidecar.profile_trust`). Router state, not provenance:
    #: never written to a file, and two profiles differing only in it are equal.
    distrust: str = dataclasses.field(default="", compare=False, repr=False)
    #: "FIELD: why" for the first constant outside `BOUNDS`, "" when all are plausible; set when
    #: the profile is built (a profile read from a file never has one: it is refused instead).
    implausible: str = dataclasses.field(init=False, default="", compare=False, repr=False)
    #: A profile the router may score with: quality `good` or `fair` (a `poor` fit is never
    #: trusted), every constant plausible, and not distrusted. Computed once when the profile is
    #: built: the scorer reads it for every pod of every decision.
    trusted: bool = dataclasses.field(init=False, default=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        problem = physics_problem(self)
        implausible = f"{problem[0]}: {problem[1]}" if problem else ""
        object.__setattr__(self, "implausible", implausible)
        trusted = self.quality in ("good", "fair") and not implausible and not self.distrust
        object.__setattr__(self, "trusted", trusted)

    @property
    def transfer_measured(self) -> bool:
        """Whether `kv_transfer` was measured (else it holds defaults, which the router replaces
        by its pool's measured transfer where it has one)."""
        return "kv_transfer" not in self.unmeasured

    def scaled(self, speed: float, name: str | None = None) -> CalibrationProfile:
        """The same hardware running `speed` times as fast (compute terms only, not memory)."""
        if speed <= 0:
            raise ValueError("speed must be positive")
        inv = 1.0 / speed
        return dataclasses.replace(
            self,
            name=name or self.name,
            prefill=PrefillModel(
                self.prefill.p0 * inv, self.prefill.p1 * inv, self.prefill.p2 * inv
            ),
            decode=DecodeModel(self.decode.d0 * inv, self.decode.d1 * inv, self.decode.d2 * inv),
        )


# ----------------------------------------------------------------------------- physics


def physics_problem(p: CalibrationProfile) -> tuple[str, str] | None:
    """(field, message) for the first constant of `p` outside `BOUNDS` (in `BOUNDS`' order), or
    None. Takes whatever it is given: a profile built in code may hold NaN, infinities, negative
    numbers or strings, and each is a problem, never an exception."""
    values: dict[str, object] = {
        "prefill.p0": p.prefill.p0,
        "prefill.p1": p.prefill.p1,
        "prefill.p2": p.prefill.p2,
        "decode.d0": p.decode.d0,
        "decode.d1": p.decode.d1,
        "decode.d2": p.decode.d2,
        "kv_transfer.k0": p.kv_transfer.k0,
        "kv_transfer.bytes_per_token": p.kv_transfer.bytes_per_token,
        "kv_transfer.bandwidth_bytes_per_s": p.kv_transfer.bandwidth_bytes_per_s,
        "kv_capacity_tokens": p.kv_capacity_tokens,
        "max_num_seqs": p.max_num_seqs,
        "max_num_batched_tokens": p.max_num_batched_tokens,
        "block_size": p.block_size,
        "max_model_len": p.max_model_len,
    }
    for path, value in values.items():
        low, high, unit, why = BOUNDS[path]
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not low <= value <= high  # NaN compares false: refused here
            or (isinstance(value, float) and not math.isfinite(value))  # inf, where high is
        ):
            span = f"at least {low:g}" if high == math.inf else f"between {low:g} and {high:g}"
            return path, f"must be {span} {unit} ({why}), got {value!r}"
    return None


# ----------------------------------------------------------------------------- dict <-> profile

_FIELDS: dict[str, tuple[str, ...]] = {
    "prefill": ("p0", "p1", "p2"),
    "decode": ("d0", "d1", "d2"),
    "kv_transfer": ("k0", "bytes_per_token", "bandwidth_bytes_per_s"),
}
_POSITIVE = {"bytes_per_token", "bandwidth_bytes_per_s"}
_INTS = (
    "kv_capacity_tokens",
    "max_num_seqs",
    "max_num_batched_tokens",
    "block_size",
    "max_model_len",
)
_REQUIRED_INTS = ("kv_capacity_tokens", "max_num_seqs", "max_num_batched_tokens")
_METADATA = ("source", "quality", "fitted_at", "ttft_mape", "tpot_mape", "notes", "unmeasured")


def _number(value: Any, path: str, source: str, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InputError(source, path, f"must be a number, got {value!r}")
    x = float(value)
    if not math.isfinite(x) or x < 0 or (positive and x == 0):
        raise InputError(
            source,
            path,
            f"must be a finite {'positive' if positive else 'non-negative'} number, got {value!r}",
        )
    return x


def _integer(value: Any, path: str, source: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InputError(source, path, f"must be a positive integer, got {value!r}")
    return value


def _section(data: Mapping[str, Any], key: str, source: str) -> dict[str, float]:
    raw = data.get(key)
    if not isinstance(raw, Mapping):
        raise InputError(source, key, "missing or not a mapping")
    out = {}
    for f in _FIELDS[key]:
        if f not in raw:
            raise InputError(source, f"{key}.{f}", "missing")
        out[f] = _number(raw[f], f"{key}.{f}", source, positive=f in _POSITIVE)
    unknown = set(raw) - set(_FIELDS[key])
    if unknown:
        raise InputError(source, f"{key}.{min(map(str, unknown))}", "unknown field")
    return out


def profile_from_dict(data: Any, source: str = "<profile>") -> CalibrationProfile:
    """Validate a mapping (parsed YAML/JSON) into a profile; errors name `source` and the field."""
    if not isinstance(data, Mapping):
        raise InputError(source, "<root>", "a profile must be a mapping")
    version = data.get("schema_version", SCHEMA_VERSION)
    if version != SCHEMA_VERSION:
        raise InputError(
            source, "schema_version", f"unsupported version {version!r} (expected {SCHEMA_VERSION})"
        )
    name = data.get("name")
    if not isinstance(name, str) or not name:
        raise InputError(source, "name", "missing or not a non-empty string")
    ints: dict[str, int] = {}
    for key in _INTS:
        if key in data:
            ints[key] = _integer(data[key], key, source)
        elif key in _REQUIRED_INTS:
            raise InputError(source, key, "missing")
    meta = data.get("metadata") or {}
    if not isinstance(meta, Mapping):
        raise InputError(source, "metadata", "must be a mapping")
    unknown_meta = set(meta) - set(_METADATA)
    if unknown_meta:  # a typo such as `qualty` would otherwise silently make a profile untrusted
        raise InputError(source, f"metadata.{min(map(str, unknown_meta))}", "unknown field")
    src = meta.get("source", "user")
    if src not in SOURCES:
        raise InputError(
            source, "metadata.source", f"must be one of {', '.join(SOURCES)}, got {src!r}"
        )
    quality = meta.get("quality", "unknown")
    if quality not in QUALITIES:
        raise InputError(
            source, "metadata.quality", f"must be one of {', '.join(QUALITIES)}, got {quality!r}"
        )
    unmeasured = _unmeasured(meta.get("unmeasured"), source)
    errors = {}
    for key in ("ttft_mape", "tpot_mape"):
        if meta.get(key) is not None:
            errors[key] = _number(meta[key], f"metadata.{key}", source)
    known = {
        "schema_version",
        "name",
        "gpu",
        "model",
        "prefill",
        "decode",
        "kv_transfer",
        "metadata",
        *_INTS,
    }
    unknown = set(data) - known
    if unknown:
        raise InputError(source, min(map(str, unknown)), "unknown field")
    profile = CalibrationProfile(
        name=name,
        prefill=PrefillModel(**_section(data, "prefill", source)),
        decode=DecodeModel(**_section(data, "decode", source)),
        kv_transfer=KVTransferModel(**_section(data, "kv_transfer", source)),
        gpu=str(data.get("gpu", "")),
        model=str(data.get("model", "")),
        source=src,
        quality=quality,
        fitted_at=str(meta.get("fitted_at", "")),
        notes=str(meta.get("notes", "")),
        ttft_mape=errors.get("ttft_mape"),
        tpot_mape=errors.get("tpot_mape"),
        unmeasured=unmeasured,
        distrust="",  # router state, never read from a file
        **ints,
    )
    problem = physics_problem(profile)
    if problem is not None:  # well-formed, but no engine: refused rather than scored with
        raise InputError(source, *problem)
    return profile


def _unmeasured(value: Any, source: str) -> tuple[str, ...]:
    """`metadata.unmeasured`: a list of distinct `UNMEASURABLE` terms (absent or null: none),
    returned in `UNMEASURABLE`'s order so that equal sets make equal profiles."""
    path = "metadata.unmeasured"
    if value is None:
        return ()
    if not isinstance(value, list):
        raise InputError(source, path, f"must be a list of terms, got {value!r}")
    for term in value:
        if term not in UNMEASURABLE:
            raise InputError(
                source, path, f"terms must be among {', '.join(UNMEASURABLE)}, got {term!r}"
            )
    if len(set(value)) != len(value):
        raise InputError(source, path, f"lists a term twice: {value!r}")
    return tuple(t for t in UNMEASURABLE if t in value)


def profile_to_dict(p: CalibrationProfile) -> dict[str, Any]:
    """The file form of a profile (inverse of `profile_from_dict`)."""
    meta: dict[str, Any] = {"source": p.source, "quality": p.quality}
    if p.fitted_at:
        meta["fitted_at"] = p.fitted_at
    if p.ttft_mape is not None:
        meta["ttft_mape"] = p.ttft_mape
    if p.tpot_mape is not None:
        meta["tpot_mape"] = p.tpot_mape
    if p.notes:
        meta["notes"] = p.notes
    if p.unmeasured:
        meta["unmeasured"] = list(p.unmeasured)
    return {
        "schema_version": SCHEMA_VERSION,
        "name": p.name,
        "gpu": p.gpu,
        "model": p.model,
        "prefill": dataclasses.asdict(p.prefill),
        "decode": dataclasses.asdict(p.decode),
        "kv_transfer": dataclasses.asdict(p.kv_transfer),
        "kv_capacity_tokens": p.kv_capacity_tokens,
        "max_num_seqs": p.max_num_seqs,
        "max_num_batched_tokens": p.max_num_batched_tokens,
        "block_size": p.block_size,
        "max_model_len": p.max_model_len,
        "metadata": meta,
    }
