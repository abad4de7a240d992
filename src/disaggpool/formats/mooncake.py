"""Traces with prefix structure, in the Mooncake JSON-lines format: read and write.

The Mooncake (Kimi) FAST'25 traces give one JSON object per line:

    {"timestamp": 0, "input_length": 7322, "output_length": 490, "hash_ids": [0, 14, 15, ...]}

``timestamp`` is the arrival in milliseconds, ``input_length`` / ``output_length`` the token
counts and ``hash_ids`` one id per block of the prompt (512 tokens; the last block may be
partial). Equal ids mean equal prompt content up to the end of that block, so two requests
share a cacheable prefix as long as their leading ids agree: the structure a prefix cache and a
prefix-aware router work on. A prompt of n tokens therefore has exactly ceil(n / 512) ids; any
other count is an error, as is a repeated id inside one prompt (a block's id names its whole
prefix, so it cannot appear twice in one prompt).

Requests come back as `TraceRequest` (`formats.trace_request`) with `blocks` (the ids) and
`block_tokens` (512 unless the caller says otherwise), re-based so that the first arrival is 0 s and
sorted by arrival (stable). One optional field is ours: ``slo_class`` (the Mooncake files have none;
then `default_class` applies). One block size holds for a whole file. `write_mooncake` writes the
same format (``.jsonl`` or ``.jsonl.gz``), so generated workloads can be saved and replayed.

Every problem is raised as `disaggpool.errors.InputError` naming the file, the line and the field
(for example ``trace.jsonl: line 4: hash_ids: 3 ids for input_length 2048, expected 4``).
"""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from disaggpool.errors import InputError
from disaggpool.formats.trace_request import TraceRequest

__all__ = ["MOONCAKE_BLOCK_TOKENS", "parse_mooncake", "read_mooncake", "write_mooncake"]

MOONCAKE_BLOCK_TOKENS = 512
"""Tokens per `hash_ids` block in the Mooncake traces."""

_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
_OPTIONAL = ("slo_class",)


def read_mooncake(
    path: str | Path, *, default_class: str = "", block_tokens: int = MOONCAKE_BLOCK_TOKENS
) -> list[TraceRequest]:
    """Read a ``.jsonl`` or ``.jsonl.gz`` trace (module docstring); `InputError` if malformed."""
    source = str(path)
    try:
        if source.endswith(".gz"):
            with gzip.open(path, "rt", encoding="utf-8") as fh:
                return parse_mooncake(
                    fh, source, default_class=default_class, block_tokens=block_tokens
                )
        with open(path, encoding="utf-8") as fh:
            return parse_mooncake(
                fh, source, default_class=default_class, block_tokens=block_tokens
            )
    except OSError as exc:  # also gzip's BadGzipFile
        raise InputError(source, "<file>", f"cannot read: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise InputError(source, "<file>", "not UTF-8 text") from exc


def parse_mooncake(
    lines: Iterable[str],
    source: str,
    *,
    default_class: str = "",
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
) -> list[TraceRequest]:
    """Parse JSON lines already opened by the caller; `source` names them in errors."""
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    rows: list[tuple[int, int, int, tuple[int, ...], str]] = []
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        rows.append(_parse_line(source, number, text, default_class, block_tokens))
    if not rows:
        raise InputError(source, "<file>", "no requests")
    origin = min(r[0] for r in rows)
    out = [
        TraceRequest((stamp - origin) / 1000.0, prompt, output, slo, blocks, block_tokens)
        for stamp, prompt, output, blocks, slo in rows
    ]
    out.sort(key=lambda r: r.arrival_s)
    return out


def write_mooncake(path: str | Path, requests: Iterable[TraceRequest]) -> None:
    """Write `requests` as Mooncake JSON lines (gzip when `path` ends in ``.gz``).

    Arrivals become integer milliseconds. Raises `ValueError` for a request without blocks, with
    a block size other than the first request's, or with arrivals out of order: what
    `read_mooncake` would not give back unchanged."""
    items = list(requests)
    if not items:
        raise ValueError("cannot write a trace with no requests")
    size = items[0].block_tokens
    lines = []
    previous = -math.inf
    for index, r in enumerate(items):
        if not r.blocks or r.block_tokens != size:
            raise ValueError(f"request {index}: needs prefix blocks of {size} tokens")
        if r.arrival_s < previous:
            raise ValueError(f"request {index}: arrivals must be non-decreasing")
        previous = r.arrival_s
        doc: dict[str, Any] = {
            "timestamp": round(r.arrival_s * 1000.0),
            "input_length": r.prompt_tokens,
            "output_length": r.output_tokens,
            "hash_ids": list(r.blocks),
        }
        if r.slo_class:
            doc["slo_class"] = r.slo_class
        lines.append(json.dumps(doc, separators=(", ", ": ")) + "\n")
    text = "".join(lines)
    if str(path).endswith(".gz"):
        # mtime 0: the same requests always give the same bytes.
        with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz:
            gz.write(text.encode())
    else:
        Path(path).write_text(text, encoding="utf-8")


# --- one line ------------------------------------------------------------------------------------


def _parse_line(
    source: str, number: int, text: str, default_class: str, block_tokens: int
) -> tuple[int, int, int, tuple[int, ...], str]:
    where = f"line {number}"
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(source, where, f"not a JSON object: {exc.msg}") from None
    if not isinstance(doc, dict):
        raise InputError(source, where, f"not a JSON object: {type(doc).__name__}")
    for name in _FIELDS:
        if name not in doc:
            raise InputError(source, f"{where}: {name}", "missing")
    unknown = sorted(set(doc) - set(_FIELDS) - set(_OPTIONAL))
    if unknown:
        raise InputError(
            source, f"{where}: {unknown[0]}", f"unknown field (known: {', '.join(_FIELDS)})"
        )
    stamp = _integer(source, where, "timestamp", doc["timestamp"], minimum=0)
    prompt = _integer(source, where, "input_length", doc["input_length"], minimum=1)
    output = _integer(source, where, "output_length", doc["output_length"], minimum=1)
    blocks = _blocks(source, where, doc["hash_ids"], prompt, block_tokens)
    slo = doc.get("slo_class", "")
    if not isinstance(slo, str):
        raise InputError(source, f"{where}: slo_class", f"must be a string, got {slo!r}")
    return stamp, prompt, output, blocks, slo.strip() or default_class


def _integer(source: str, where: str, field: str, value: Any, *, minimum: int) -> int:
    # bool is an int in Python; a JSON true is not a token count.
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(source, f"{where}: {field}", f"must be an integer, got {value!r}")
    if value < minimum:
        raise InputError(source, f"{where}: {field}", f"must be >= {minimum}, got {value}")
    return value


def _blocks(source: str, where: str, value: Any, prompt: int, block_tokens: int) -> tuple[int, ...]:
    field = f"{where}: hash_ids"
    if not isinstance(value, list):
        raise InputError(source, field, f"must be a list of integers, got {value!r}")
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int) or item < 0:
            raise InputError(source, field, f"must hold integers >= 0, got {item!r}")
    expected = -(-prompt // block_tokens)
    if len(value) != expected:
        raise InputError(
            source,
            field,
            f"{len(value)} ids for input_length {prompt}, expected {expected} "
            f"(one per {block_tokens}-token block)",
        )
    if len(set(value)) != len(value):
        raise InputError(source, field, "an id repeats within one prompt")
    return tuple(value)
