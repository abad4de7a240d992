"""One change to a router replica's books, as the other replicas receive it (`core.shared_books`).

A `BookEvent` is plain data (strings, numbers, None), so that it can travel as JSON over a bus
(NATS, later): `to_dict` and `from_dict` are each other's inverse, and `from_dict` checks every
field by name, so a malformed message is refused with an error that names the field.

Its `kind` says which fields it uses:

* ``booked``: a request routed by `owner`: `prefill` (None: its decode instance prefills it),
  `decode` (None: chosen later, a ``bound`` event follows), `prompt_tokens`,
  `predicted_output`, `cached_tokens`, `priority`, its SLO class (`slo`, `ttft_s`, `tpot_s`)
  and `routed_at` (the owner's clock);
* ``bound``: its decode instance was chosen (`decode`);
* ``prefilled``: its prefill leg answered;
* ``progress``: `generated` output tokens so far, the first seen at `first_token_at`;
* ``finished``: it left the owner's books (finished, failed, refused or expired).

Every event names its `request_id` and its `owner`, the replica that routed it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Literal, get_args

__all__ = ["KINDS", "BookEvent", "BookEventError", "Kind"]

Kind = Literal["booked", "bound", "prefilled", "progress", "finished"]
KINDS: tuple[str, ...] = get_args(Kind)


class BookEventError(ValueError):
    """A book event with a missing, unknown or malformed field (`field` names it)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"book event field {field!r}: {message}")
        self.field = field


@dataclasses.dataclass(frozen=True, slots=True)
class BookEvent:
    """One change to `owner`'s books about `request_id` (module docstring)."""

    kind: Kind
    request_id: str
    owner: str
    prefill: str | None = None
    decode: str | None = None
    prompt_tokens: int = 0
    predicted_output: float = 0.0
    cached_tokens: int = 0
    priority: int = 0
    slo: str = ""
    ttft_s: float = 0.0
    tpot_s: float = 0.0
    routed_at: float = 0.0
    generated: int = 0
    first_token_at: float = 0.0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _check(f.name, getattr(self, f.name))
        if self.kind == "booked":
            if self.prefill is None and self.decode is None:
                raise BookEventError("decode", "a booked request with no prefill needs a decode")
            if not self.slo:
                raise BookEventError("slo", "a booked request needs its SLO class")
            if self.cached_tokens > self.prompt_tokens:
                raise BookEventError("cached_tokens", "more than prompt_tokens")
        elif self.kind == "bound" and self.decode is None:
            raise BookEventError("decode", "a bound event needs its decode instance")

    def to_dict(self) -> dict[str, Any]:
        """The event as plain data, the fields at their defaults left out (`from_dict` reads it
        back): a progress event, the most frequent, is then a third of its full size."""
        out = {}
        for f in _DATACLASS_FIELDS:
            value = getattr(self, f.name)
            if f.name in _REQUIRED or value != f.default:
                out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BookEvent:
        """The event `data` describes; `BookEventError` names the first field that is missing,
        unknown or malformed."""
        if not isinstance(data, Mapping):
            raise BookEventError("(event)", f"must be a mapping, got {type(data).__name__}")
        unknown = sorted(set(data) - _FIELDS.keys())
        if unknown:
            raise BookEventError(str(unknown[0]), "unknown field")
        for name in _REQUIRED:
            if name not in data:
                raise BookEventError(name, "missing")
        for name, value in data.items():
            _check(name, value)
        # Numbers arrive as JSON numbers: an integral float field may come as an int.
        fields: dict[str, Any] = {
            k: float(v) if _FIELDS[k] == "float" else v for k, v in data.items()
        }
        return cls(**fields)


_FIELDS: dict[str, str] = {
    "kind": "kind",
    "request_id": "id",
    "owner": "id",
    "prefill": "name?",
    "decode": "name?",
    "prompt_tokens": "count",
    "predicted_output": "float",
    "cached_tokens": "count",
    "priority": "int",
    "slo": "str",
    "ttft_s": "float",
    "tpot_s": "float",
    "routed_at": "float",
    "generated": "count",
    "first_token_at": "float",
}
_REQUIRED = ("kind", "request_id", "owner")


def _check(name: str, value: Any) -> None:
    """Raise `BookEventError` unless `value` is what field `name` holds."""
    kind = _FIELDS[name]
    if kind == "kind":
        if value not in KINDS:
            raise BookEventError(name, f"must be one of {', '.join(KINDS)}, got {value!r}")
    elif kind == "id":
        if not isinstance(value, str) or not value:
            raise BookEventError(name, f"must be a non-empty string, got {value!r}")
    elif kind == "name?":
        if value is not None and (not isinstance(value, str) or not value):
            raise BookEventError(name, f"must be a non-empty string or null, got {value!r}")
    elif kind == "str":
        if not isinstance(value, str):
            raise BookEventError(name, f"must be a string, got {value!r}")
    elif kind in ("count", "int"):
        if not isinstance(value, int) or isinstance(value, bool):
            raise BookEventError(name, f"must be an integer, got {value!r}")
        if kind == "count" and value < 0:
            raise BookEventError(name, f"must be >= 0, got {value!r}")
    elif (
        not isinstance(value, int | float)
        or isinstance(value, bool)
        or not math.isfinite(value)
        or value < 0
    ):
        raise BookEventError(name, f"must be a finite number >= 0, got {value!r}")


_DATACLASS_FIELDS = dataclasses.fields(BookEvent)
