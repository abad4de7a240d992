"""Reading Prometheus text exposition (format 0.0.4): the samples of a few named series, fast.

The one parser of `/metrics` pages in the package. Callers: `sidecar.scrape` (every pod, every
scrape interval: the router's gauges), `calibration.client` (vLLM's KV cache configuration and
inter-token histogram) and `demo` (request counts of pods and of the sidecar).

Every caller wants a handful of series out of a page of hundreds of lines (vLLM's exposition
carries dozens of histograms), so `parse` picks the lines of the wanted series by exact name
with one string comparison each and parses only those. The full parse of `prometheus_client`
costs milliseconds per vLLM page, and about 2.5 times our parse even on the picked lines (its
label parsing is slow for vLLM's 40-label `vllm:cache_config_info`): `bench/prom_parse.py`
measures both. `tests/test_promtext.py` checks this parser against the library's on real pages
and on the format's corner cases (escaped label values, timestamps, NaN and infinities).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping

__all__ = ["PromTextError", "Sample", "parse", "total"]

# One sample line: name, optional {labels}, value, optional timestamp. Label values are quoted
# strings with backslash escapes; `+` inside the repetitions keeps the regex engine from
# backtracking per character on long label sets.
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_SAMPLE = re.compile(
    r"(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)"
    r'[ \t]*(?:\{(?P<labels>(?:[^"}\\]+|"(?:[^"\\]+|\\.)*")*)\})?'
    r"[ \t]*(?P<value>[^ \t\r]+)(?:[ \t]+(?P<timestamp>-?[0-9]+))?[ \t\r]*"
)
_LABEL = re.compile(
    r'[ \t]*(?P<key>[a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"(?P<value>(?:[^"\\]+|\\.)*)"[ \t]*(?:,|$)'
)
_ESCAPE = re.compile(r"\\(.)")
_UNESCAPED = {"\\": "\\", '"': '"', "n": "\n"}


class PromTextError(ValueError):
    """A line of a wanted series is not a valid sample line."""


@dataclasses.dataclass(frozen=True, slots=True)
class Sample:
    """One sample line: the sample's name (a histogram's `_sum`, `_count`, `_bucket` included),
    its labels and its value."""

    name: str
    labels: Mapping[str, str]
    value: float


def _unescape(value: str) -> str:
    # As the exposition format defines: \\, \" and \n; any other escape is kept as written.
    return _ESCAPE.sub(lambda m: _UNESCAPED.get(m.group(1), m.group(0)), value)


def _labels(raw: str, line: str) -> dict[str, str]:
    labels: dict[str, str] = {}
    pos = 0
    for m in _LABEL.finditer(raw):
        if m.start() != pos:
            break
        value = m.group("value")
        labels[m.group("key")] = _unescape(value) if "\\" in value else value
        pos = m.end()
    if raw[pos:].strip():
        raise PromTextError(f"malformed labels in sample line: {line[:120]!r}")
    return labels


def _name(line: str) -> str:
    m = _NAME.match(line)
    return m.group() if m else ""


def _sample(line: str) -> Sample:
    m = _SAMPLE.fullmatch(line)
    if m is None:
        raise PromTextError(f"malformed sample line: {line[:120]!r}")
    try:
        value = float(m.group("value"))
    except ValueError:
        raise PromTextError(f"malformed sample line: {line[:120]!r}") from None
    raw = m.group("labels")
    return Sample(m.group("name"), _labels(raw, line) if raw else {}, value)


def parse(text: str, names: Iterable[str]) -> list[Sample]:
    """The samples of the series named in `names`, in page order.

    Names are exact sample names: a histogram's `x_sum` and `x_count`, not `x`. Lines of other
    series are skipped unparsed; a line of a wanted series that is not a valid sample line
    raises `PromTextError`. A page that has none of them gives an empty list.
    """
    wanted = set(names)
    prefixes = tuple(wanted)
    # A prefix test first (one C call per line, most lines fail it), then the exact name, which
    # drops the longer names that share a prefix (`..._waiting_by_reason` for `..._waiting`).
    return [
        _sample(line)
        for line in text.split("\n")
        if line.startswith(prefixes) and _name(line) in wanted
    ]


def total(samples: Iterable[Sample], name: str, where: Mapping[str, str] | None = None) -> float:
    """Sum of the values of `name`'s samples whose labels include every pair in `where`
    (over the engines of a data-parallel pod, say); 0.0 when there are none."""
    pairs = (where or {}).items()
    return sum(
        (
            s.value
            for s in samples
            if s.name == name and all(s.labels.get(k) == v for k, v in pairs)
        ),
        0.0,
    )
