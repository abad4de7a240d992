"""Typed reading of a parsed YAML/JSON document, with errors naming the file and field path.

Shared by the scenario files (`sim.scenario`) and the sidecar's configuration (`sidecar.config`),
so that both say ``scen.yaml: slo_classes[1].ttft_s: must be > 0, got -1`` the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from disaggpool.core.contracts import SLOClass
from disaggpool.errors import InputError

__all__ = ["FieldReader", "read_slo_classes"]


class FieldReader:
    """Typed access to a parsed document; every failure is an `InputError` naming the field."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, path: str, message: str) -> InputError:
        return InputError(self.source, path, message)

    def mapping(self, value: Any, path: str) -> Mapping[str, Any]:
        if not isinstance(value, Mapping):
            raise self.fail(path, "must be a mapping")
        return value

    def number(
        self, value: Any, path: str, *, minimum: float = 0.0, positive: bool = False
    ) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(path, f"must be a number, got {value!r}")
        if value < minimum or (positive and value <= 0):
            raise self.fail(
                path, f"must be {'> 0' if positive else f'>= {minimum}'}, got {value!r}"
            )
        return float(value)

    def integer(self, value: Any, path: str, *, minimum: int = 1) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.fail(path, f"must be an integer >= {minimum}, got {value!r}")
        return value

    def string(self, value: Any, path: str) -> str:
        if not isinstance(value, str) or not value:
            raise self.fail(path, f"must be a non-empty string, got {value!r}")
        return value

    def known(self, data: Mapping[str, Any], path: str, allowed: set[str]) -> None:
        for key in data:
            if key not in allowed:
                prefix = f"{path}." if path else ""
                raise self.fail(
                    f"{prefix}{key}", f"unknown field (allowed: {', '.join(sorted(allowed))})"
                )


def read_slo_classes(rd: FieldReader, raw: Any, path: str = "slo_classes") -> tuple[SLOClass, ...]:
    """A non-empty list of ``{name, ttft_s, tpot_s[, default]}``; the default class comes first."""
    if not isinstance(raw, list) or not raw:
        raise rd.fail(path, "must be a non-empty list")
    classes = []
    default = None
    for i, item in enumerate(raw):
        at = f"{path}[{i}]"
        c = rd.mapping(item, at)
        rd.known(c, at, {"name", "ttft_s", "tpot_s", "default"})
        if not isinstance(c.get("name"), str) or not c["name"]:
            raise rd.fail(f"{at}.name", "missing or not a string")
        slo = SLOClass(
            c["name"],
            rd.number(c.get("ttft_s"), f"{at}.ttft_s", positive=True),
            rd.number(c.get("tpot_s"), f"{at}.tpot_s", positive=True),
        )
        if c.get("default"):
            default = slo
        classes.append(slo)
    if len({c.name for c in classes}) != len(classes):
        raise rd.fail(path, "class names must be unique")
    first = default or classes[0]
    return (first, *[c for c in classes if c is not first])
