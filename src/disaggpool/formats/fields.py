"""The one typed-field reader for configuration documents, with errors naming the field path.

Every configuration document is read through `FieldReader`: the scenario files (`sim.scenario`),
the sidecar's configuration (`sidecar.config`) and the `DisaggPool` custom resource's spec
(`operator.spec`). The type and range checks live here once; what happens at a problem is the
reader's strategy:

* `raise_at_first` (the default): the first problem raises `InputError` naming the file and field
  (``scen.yaml: slo_classes[1].ttft_s: must be > 0, got -1``); the CLI turns it into exit code 2.
* `CollectProblems`: every problem is recorded and the getter returns the field's default, so the
  caller can report them all at once (the operator puts them into a status condition).

`Conventions` holds how a kind of document talks to its users: a config file says "mapping" and
treats an empty string as an error; a Kubernetes resource says "object", treats "" as a string
field's zero value, and reports an integer's type and range separately.

`Section` is the keyed view of one mapping: ``section.integer("replicas", 1)`` reads the field
``<section path>.replicas``, taking the default when the key is missing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

from disaggpool.core.contracts import SLOClass
from disaggpool.errors import InputError

__all__ = [
    "CONFIG_FILE",
    "KUBERNETES",
    "CollectProblems",
    "Conventions",
    "FieldReader",
    "ProblemHandler",
    "Section",
    "nats_url_problem",
    "raise_at_first",
    "read_slo_classes",
]


class ProblemHandler(Protocol):
    """The reader's strategy: called with each problem; raising stops the read there."""

    def __call__(self, problem: InputError) -> None: ...


def raise_at_first(problem: InputError) -> None:
    """Strategy for files a person fixes and re-runs: stop at the first problem."""
    raise problem


class CollectProblems:
    """Strategy for documents whose every problem is reported together: record and go on."""

    def __init__(self) -> None:
        self.problems: list[InputError] = []

    def __call__(self, problem: InputError) -> None:
        self.problems.append(problem)


@dataclasses.dataclass(frozen=True, slots=True)
class Conventions:
    """How a kind of document names things and what counts as a value in it."""

    mapping: str  # what its users call a mapping: "mapping" (YAML files) or "object" (Kubernetes)
    empty_strings: bool  # "" is a value (a Kubernetes string field's zero value), not an error
    split_integer_messages: bool  # an integer's type and range problems get separate messages

    @property
    def a_mapping(self) -> str:
        return f"{'an' if self.mapping[0] in 'aeiou' else 'a'} {self.mapping}"


CONFIG_FILE = Conventions("mapping", empty_strings=False, split_integer_messages=False)
KUBERNETES = Conventions("object", empty_strings=True, split_integer_messages=True)


class FieldReader:
    """Typed access to a parsed YAML/JSON document; problems go to the `on_problem` strategy.

    Each getter checks one value read from the document at `path` and returns it; when it is
    wrong and the strategy does not raise, the getter returns its `default` instead.
    """

    def __init__(
        self,
        source: str,
        on_problem: ProblemHandler = raise_at_first,
        conventions: Conventions = CONFIG_FILE,
    ) -> None:
        self.source = source
        self.on_problem = on_problem
        self.conventions = conventions

    def fail(self, path: str, message: str) -> InputError:
        """The error for a problem the caller cannot read past; it raises it, whatever the
        strategy (``raise rd.fail(...)``)."""
        return InputError(self.source, path, message)

    def problem(self, path: str, message: str) -> None:
        """Report a problem found by the caller's own checks through the strategy."""
        self.on_problem(self.fail(path, message))

    def mapping(self, value: Any, path: str, *, optional: bool = False) -> Mapping[str, Any]:
        """A mapping; `optional`: a missing (None) one reads as empty."""
        if value is None and optional:
            return {}
        if not isinstance(value, Mapping):
            self.problem(path, f"must be {self.conventions.a_mapping}")
            return {}
        return value

    def section(self, value: Any, path: str, *, optional: bool = False) -> Section:
        """`mapping`, as a keyed `Section` whose fields are named ``path.key``."""
        return Section(self, self.mapping(value, path, optional=optional), path)

    def string(self, value: Any, path: str, *, default: str = "") -> str:
        """A string; non-empty unless the conventions accept "" as a value."""
        if self.conventions.empty_strings:
            if not isinstance(value, str):
                self.problem(path, f"must be a string, got {value!r}")
                return default
        elif not isinstance(value, str) or not value:
            self.problem(path, f"must be a non-empty string, got {value!r}")
            return default
        return value

    def integer(self, value: Any, path: str, *, minimum: int = 1, default: int = 0) -> int:
        """An integer >= `minimum` (a boolean is not an integer here)."""
        if isinstance(value, int) and not isinstance(value, bool) and value >= minimum:
            return value
        if not self.conventions.split_integer_messages:
            self.problem(path, f"must be an integer >= {minimum}, got {value!r}")
        elif isinstance(value, bool) or not isinstance(value, int):
            self.problem(path, f"must be an integer, got {value!r}")
        else:
            self.problem(path, f"must be >= {minimum}, got {value!r}")
        return default

    def number(
        self,
        value: Any,
        path: str,
        *,
        minimum: float = 0.0,
        positive: bool = False,
        default: float = 0.0,
    ) -> float:
        """An int or float >= `minimum`, or > 0 when `positive`; `minimum` prints as given."""
        if isinstance(value, bool) or not isinstance(value, int | float):
            self.problem(path, f"must be a number, got {value!r}")
            return default
        if value < minimum or (positive and value <= 0):
            self.problem(path, f"must be {'> 0' if positive else f'>= {minimum}'}, got {value!r}")
            return default
        return float(value)

    def path(self, value: Any, path: str, base: Path | None) -> str:
        """A string naming a file: relative to `base` (the document's folder) unless absolute."""
        text = self.string(value, path)
        p = Path(text)
        return str(p if p.is_absolute() or base is None else base / p)

    def boolean(self, value: Any, path: str, *, default: bool = False) -> bool:
        if not isinstance(value, bool):
            self.problem(path, f"must be true or false, got {value!r}")
            return default
        return value

    def nonempty_list(self, value: Any, path: str, *, of: str = "") -> list[Any]:
        """A list with at least one item; `of` names the items in the message."""
        if not isinstance(value, list) or not value:
            self.problem(path, f"must be a non-empty list{f' of {of}' if of else ''}")
            return []
        return value

    def strings(self, value: Any, path: str) -> tuple[str, ...]:
        """A list of strings (possibly empty); () on a problem."""
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            self.problem(path, "must be a list of strings")
            return ()
        return tuple(value)

    def mappings(self, value: Any, path: str) -> tuple[Mapping[str, Any], ...]:
        """A list of mappings (possibly empty); () on a problem."""
        if not isinstance(value, list) or not all(isinstance(v, Mapping) for v in value):
            self.problem(path, f"must be a list of {self.conventions.mapping}s")
            return ()
        return tuple(value)

    def string_map(self, value: Any, path: str) -> dict[str, str]:
        """A mapping of strings to strings (labels, node selectors); {} on a problem."""
        if not isinstance(value, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()
        ):
            self.problem(path, "must be a map of strings")
            return {}
        return dict(value)

    def known(self, data: Mapping[str, Any], path: str, allowed: set[str]) -> None:
        """Every key of `data` is in `allowed` (a typo is a problem, not a silent default)."""
        for key in data:
            if key not in allowed:
                self.problem(
                    _join(path, key), f"unknown field (allowed: {', '.join(sorted(allowed))})"
                )


def _join(path: str, key: str) -> str:
    """The path of field `key` inside the mapping at `path` ("" is the document's root)."""
    return f"{path}.{key}" if path else key


class Section:
    """One mapping of a document at `path`: keyed getters, a missing key takes its default."""

    def __init__(self, reader: FieldReader, data: Mapping[str, Any], path: str) -> None:
        self.reader = reader
        self.data = data
        self.path = path

    def at(self, key: str) -> str:
        """The field path of `key` in this section (``decode.variants[0].name``)."""
        return _join(self.path, key)

    def problem(self, key: str, message: str) -> None:
        """Report a problem with field `key` found by the caller's own checks."""
        self.reader.problem(self.at(key), message)

    def __contains__(self, key: object) -> bool:
        return key in self.data

    def __bool__(self) -> bool:
        return bool(self.data)

    def section(self, key: str) -> Section:
        """A nested mapping; missing or null reads as an empty section."""
        return self.reader.section(self.data.get(key), self.at(key), optional=True)

    def sections(self, key: str) -> tuple[Section, ...]:
        """A list of mappings, each a section named ``key[i]``; missing reads as none."""
        return tuple(
            Section(self.reader, item, f"{self.at(key)}[{i}]")
            for i, item in enumerate(self.mappings(key))
        )

    def string(self, key: str, default: str = "") -> str:
        return self.reader.string(self.data.get(key, default), self.at(key), default=default)

    def integer(self, key: str, default: int, *, minimum: int = 1) -> int:
        value = self.data.get(key, default)
        return self.reader.integer(value, self.at(key), minimum=minimum, default=default)

    def number(
        self, key: str, default: float, *, minimum: float = 0, positive: bool = False
    ) -> float:
        value = self.data.get(key, default)
        return self.reader.number(
            value, self.at(key), minimum=minimum, positive=positive, default=default
        )

    def boolean(self, key: str, default: bool) -> bool:
        return self.reader.boolean(self.data.get(key, default), self.at(key), default=default)

    def strings(self, key: str) -> tuple[str, ...]:
        return self.reader.strings(self.data.get(key, []), self.at(key))

    def mappings(self, key: str) -> tuple[Mapping[str, Any], ...]:
        return self.reader.mappings(self.data.get(key, []), self.at(key))

    def string_map(self, key: str) -> dict[str, str]:
        return self.reader.string_map(self.data.get(key, {}), self.at(key))


def read_slo_classes(rd: FieldReader, raw: Any, path: str = "slo_classes") -> tuple[SLOClass, ...]:
    """A non-empty list of ``{name, ttft_s, tpot_s[, default, sheddable]}``; the default class
    comes first.

    For the config files (scenario, sidecar); it raises at problems it cannot read past. The
    operator's ``router.sloClasses`` differ (camelCase keys, defaulted when absent, a separate
    ``defaultSloClass``) and are read in `operator.spec`.
    """
    classes = []
    default = None
    for i, item in enumerate(rd.nonempty_list(raw, path)):
        at = f"{path}[{i}]"
        c = rd.mapping(item, at)
        rd.known(c, at, {"name", "ttft_s", "tpot_s", "default", "sheddable"})
        if not isinstance(c.get("name"), str) or not c["name"]:
            raise rd.fail(f"{at}.name", "missing or not a string")
        slo = SLOClass(
            c["name"],
            rd.number(c.get("ttft_s"), f"{at}.ttft_s", positive=True),
            rd.number(c.get("tpot_s"), f"{at}.tpot_s", positive=True),
            rd.boolean(c.get("sheddable", False), f"{at}.sheddable"),
        )
        if c.get("default"):
            default = slo
        classes.append(slo)
    if not classes:  # a collecting reader has recorded the problem already
        return ()
    if len({c.name for c in classes}) != len(classes):
        raise rd.fail(path, "class names must be unique")
    first = default or classes[0]
    return (first, *[c for c in classes if c is not first])


def nats_url_problem(url: str) -> str | None:
    """What is wrong with a NATS server's URL (the shared-books bus), or None. Read by the
    sidecar's config and the operator's `router.sharedBooks`, so both say the same."""
    parsed = urlparse(url)
    if parsed.scheme not in ("nats", "tls") or not parsed.hostname:
        return f"must be nats://HOST:PORT or tls://HOST:PORT, got {url!r}"
    if parsed.username or parsed.password:
        return "carries credentials: give them as a token or credentials file (a Secret)"
    return None
