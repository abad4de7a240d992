"""Request-trace files: read and write the arrival/length traces that drive the simulator.

A trace is a list of `TraceRequest` (arrival time, prompt length, output length, optional SLO
class; defined in `formats.trace_request`, which the Mooncake format shares, and imported from
here), sorted by arrival. `read_trace` accepts two CSV dialects, detected from the header:

* our own format, ``arrival_s,prompt_tokens,output_tokens[,slo_class]``, which `write_trace`
  produces (arrival in seconds, non-decreasing);
* the Azure LLM inference trace 2023 format, ``TIMESTAMP,ContextTokens,GeneratedTokens``
  (wall-clock timestamps such as ``2023-11-16 18:17:03.9799600``), re-based so that the earliest
  request arrives at 0 s.

Callers: the CLI, the load generator and the scenario loader read traces with `read_trace`;
`formats.embedded` parses the traces shipped inside the package with `parse_trace`; workload
tools write derived traces with `write_trace`; `disaggpool.sim.workload` transforms the resulting
lists in memory.
Every problem with a file is raised as `disaggpool.errors.InputError` naming the file, the line
and the field (for example ``trace.csv: line 17: prompt_tokens: ...``).
"""

from __future__ import annotations

import csv
import datetime as dt
import math
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from disaggpool.errors import InputError
from disaggpool.formats.mooncake import read_mooncake
from disaggpool.formats.trace_request import TraceRequest

__all__ = [
    "AZURE_HEADER",
    "TRACE_HEADER",
    "TraceRequest",
    "parse_trace",
    "read_trace",
    "write_trace",
]

TRACE_HEADER = ("arrival_s", "prompt_tokens", "output_tokens")
"""Columns of our own trace format; an optional fourth column ``slo_class`` may follow."""

AZURE_HEADER = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
"""Columns of the Azure LLM inference trace 2023 (conversation and code services)."""

_CLASS_COLUMN = "slo_class"
_FILE_FIELD = "<file>"

# Azure timestamps carry 7 fractional digits (100 ns ticks) but datetime holds microseconds;
# older Pythons reject the 7th digit, so it is cut off before parsing (it is 0 in the real data).
_LONG_FRACTION = re.compile(r"(\.\d{6})\d+")


_Row = tuple[int, list[str]]
"""A CSV record with the (1-based) line number it ends on."""


def read_trace(path: str | Path, *, default_class: str = "") -> list[TraceRequest]:
    """Read a trace file in our format, the Azure 2023 format or (a name ending in ``.jsonl`` or
    ``.jsonl.gz``) the Mooncake format with prefix blocks, sorted by arrival (stable).

    `default_class` is the SLO class of requests whose file gives none (Azure and Mooncake files,
    our format without a ``slo_class`` column, or an empty ``slo_class`` cell).
    Raises `InputError` for an unreadable, empty or malformed file.
    """
    source = str(path)
    if source.endswith((".jsonl", ".jsonl.gz")):
        return read_mooncake(path, default_class=default_class)
    try:
        # utf-8-sig drops a byte-order mark that spreadsheet exports put before the header.
        with open(path, encoding="utf-8-sig", newline="") as fh:
            return parse_trace(fh, source, default_class=default_class)
    except OSError as exc:
        raise InputError(source, _FILE_FIELD, f"cannot read: {exc.strerror or exc}") from exc


def parse_trace(
    lines: Iterable[str], source: str, *, default_class: str = ""
) -> list[TraceRequest]:
    """Parse trace text already opened by the caller (`read_trace`, `formats.embedded`).

    `lines` is an iterable of decoded CSV lines as a file opened with ``encoding="utf-8-sig"``
    and ``newline=""`` yields them (a byte-order mark already dropped); `source` names it in
    errors. Same formats, checks and errors as `read_trace`.
    """
    rows = _read_rows(lines, source)
    if not rows:
        raise InputError(source, _FILE_FIELD, "no requests")
    header_line, header = rows[0]
    names = tuple(cell.strip() for cell in header)
    body = rows[1:]
    if names in (TRACE_HEADER, (*TRACE_HEADER, _CLASS_COLUMN)):
        requests = _parse_ours(source, body, names, default_class)
    elif names == AZURE_HEADER:
        requests = _parse_azure(source, body, default_class)
    else:
        raise InputError(
            source,
            f"line {header_line}: header",
            f"unknown header {','.join(names)!r}; expected "
            f"{','.join(TRACE_HEADER)!r} (optionally followed by ',{_CLASS_COLUMN}') "
            f"or {','.join(AZURE_HEADER)!r}",
        )
    if not requests:
        raise InputError(source, _FILE_FIELD, "no requests")
    return requests


def write_trace(path: str | Path, requests: Iterable[TraceRequest]) -> None:
    """Write `requests` in our CSV format, with a ``slo_class`` column if any request has a class.

    Arrivals are written with 6 decimals (microseconds), so the output is byte-for-byte
    deterministic. Raises `ValueError` for requests that `read_trace` would reject (no requests,
    invalid values, decreasing arrivals), so a written trace can always be read back.
    """
    items = list(requests)
    _check_writable(items)
    if any(r.blocks for r in items):
        raise ValueError("prefix blocks do not fit the CSV format: use formats.mooncake")
    with_class = any(r.slo_class for r in items)
    header = [*TRACE_HEADER, _CLASS_COLUMN] if with_class else list(TRACE_HEADER)
    with open(path, "w", encoding="utf-8", newline="") as fh:
        writer = csv.writer(fh, lineterminator="\n")
        writer.writerow(header)
        for r in items:
            row = [f"{r.arrival_s:.6f}", str(r.prompt_tokens), str(r.output_tokens)]
            if with_class:
                row.append(r.slo_class)
            writer.writerow(row)


# --- reading -----------------------------------------------------------------------------------


def _read_rows(lines: Iterable[str], source: str) -> list[_Row]:
    """All non-blank CSV records with their line numbers."""
    try:
        reader = csv.reader(lines)
        return [(reader.line_num, row) for row in reader if any(c.strip() for c in row)]
    except OSError as exc:
        raise InputError(source, _FILE_FIELD, f"cannot read: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise InputError(source, _FILE_FIELD, "not UTF-8 text") from exc
    except csv.Error as exc:
        raise InputError(source, _FILE_FIELD, f"malformed CSV: {exc}") from exc


def _parse_ours(
    source: str, body: Sequence[_Row], names: tuple[str, ...], default_class: str
) -> list[TraceRequest]:
    """Rows of our format; arrivals must already be non-decreasing (it is a generated format)."""
    has_class = len(names) == len(TRACE_HEADER) + 1
    out: list[TraceRequest] = []
    previous = 0.0
    for line, row in body:
        _check_width(source, line, row, names)
        arrival = _parse_seconds(source, line, names[0], row[0])
        if arrival < previous:
            raise InputError(
                source,
                f"line {line}: {names[0]}",
                f"{arrival!r} is earlier than the previous arrival {previous!r} "
                "(arrivals must be non-decreasing)",
            )
        previous = arrival
        prompt = _parse_count(source, line, names[1], row[1])
        output = _parse_count(source, line, names[2], row[2])
        slo_class = (row[3].strip() if has_class else "") or default_class
        out.append(TraceRequest(arrival, prompt, output, slo_class))
    return out


def _parse_azure(source: str, body: Sequence[_Row], default_class: str) -> list[TraceRequest]:
    """Rows of the Azure 2023 format, re-based to the earliest timestamp and sorted by it."""
    names = AZURE_HEADER
    stamps: list[dt.datetime] = []
    lengths: list[tuple[int, int]] = []
    for line, row in body:
        _check_width(source, line, row, names)
        stamp = _parse_timestamp(source, line, names[0], row[0])
        if stamps and (stamp.tzinfo is None) != (stamps[0].tzinfo is None):
            raise InputError(
                source, f"line {line}: {names[0]}", "mixes timestamps with and without time zone"
            )
        stamps.append(stamp)
        # The 2023 files have no zero-length rows (checked: min ContextTokens 2, min
        # GeneratedTokens 6), so zeros are rejected here exactly as in our own format.
        lengths.append(
            (
                _parse_count(source, line, names[1], row[1]),
                _parse_count(source, line, names[2], row[2]),
            )
        )
    if not stamps:
        return []
    origin = min(stamps)
    tick = dt.timedelta(microseconds=1)
    # Integer microseconds first, then one division: exact for any trace shorter than ~285 years.
    out = [
        TraceRequest(((stamp - origin) // tick) / 1e6, prompt, output, default_class)
        for stamp, (prompt, output) in zip(stamps, lengths, strict=True)
    ]
    # The published files are already in time order; sorting (stable) makes others usable too.
    out.sort(key=lambda r: r.arrival_s)
    return out


def _check_width(source: str, line: int, row: Sequence[str], names: Sequence[str]) -> None:
    """Reject a record whose column count differs from the header's."""
    if len(row) < len(names):
        raise InputError(
            source,
            f"line {line}: {names[len(row)]}",
            f"missing (got {len(row)} of {len(names)} columns: {','.join(names)})",
        )
    if len(row) > len(names):
        raise InputError(
            source,
            f"line {line}: row",
            f"{len(row)} columns, expected {len(names)} ({','.join(names)})",
        )


def _parse_seconds(source: str, line: int, field: str, text: str) -> float:
    """A non-negative finite number of seconds."""
    try:
        value = float(text)
    except ValueError:
        raise InputError(source, f"line {line}: {field}", f"not a number: {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise InputError(
            source, f"line {line}: {field}", f"must be a finite number >= 0, got {text.strip()!r}"
        )
    return value


def _parse_count(source: str, line: int, field: str, text: str) -> int:
    """A token count: an integer >= 1 (every request has a prompt and produces a token)."""
    try:
        value = int(text)
    except ValueError:
        raise InputError(source, f"line {line}: {field}", f"not an integer: {text!r}") from None
    if value < 1:
        raise InputError(source, f"line {line}: {field}", f"must be >= 1, got {value}")
    return value


def _parse_timestamp(source: str, line: int, field: str, text: str) -> dt.datetime:
    """An ISO-like wall-clock timestamp; fractional seconds beyond microseconds are truncated."""
    cleaned = _LONG_FRACTION.sub(r"\1", text.strip(), count=1)
    try:
        return dt.datetime.fromisoformat(cleaned)
    except ValueError:
        raise InputError(
            source,
            f"line {line}: {field}",
            f"not a timestamp like '2023-11-16 18:17:03.9799600': {text!r}",
        ) from None


# --- writing -----------------------------------------------------------------------------------


def _check_writable(items: Sequence[TraceRequest]) -> None:
    """Raise `ValueError` unless `read_trace` would accept `items` once written."""
    if not items:
        raise ValueError("cannot write a trace with no requests")
    previous = 0.0
    for index, r in enumerate(items):
        if not math.isfinite(r.arrival_s) or r.arrival_s < 0:
            raise ValueError(f"request {index}: arrival_s must be finite and >= 0: {r.arrival_s}")
        if r.arrival_s < previous:
            raise ValueError(f"request {index}: arrivals must be non-decreasing")
        if r.prompt_tokens < 1 or r.output_tokens < 1:
            raise ValueError(f"request {index}: token counts must be >= 1")
        if r.slo_class != r.slo_class.strip():
            # read_trace strips cells; refuse what would not survive the round trip.
            raise ValueError(f"request {index}: slo_class has surrounding spaces")
        previous = r.arrival_s
