"""Tests of disaggpool.formats.traces and formats.embedded: round trips, the Azure 2023 traces
embedded in the package, malformed files."""

from __future__ import annotations

import gzip
import importlib.resources
import io
import itertools
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from disaggpool.errors import InputError
from disaggpool.formats.embedded import (
    AZURE_2023_FILES,
    SERVICE_CLASSES,
    azure_services,
    read_embedded_trace,
)
from disaggpool.formats.traces import TraceRequest, parse_trace, read_trace, write_trace


def _write(tmp_path: Path, text: str, name: str = "trace.csv") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8", newline="")
    return path


# --- round trips -------------------------------------------------------------------------------


def test_round_trip_without_classes(tmp_path: Path) -> None:
    requests = [TraceRequest(0.0, 10, 5), TraceRequest(0.25, 300, 1), TraceRequest(0.25, 7, 90)]
    path = tmp_path / "t.csv"
    write_trace(path, requests)
    assert path.read_text().splitlines()[0] == "arrival_s,prompt_tokens,output_tokens"
    assert read_trace(path) == requests


def test_round_trip_with_classes_and_default(tmp_path: Path) -> None:
    requests = [TraceRequest(0.0, 10, 5, "chat"), TraceRequest(1.5, 20, 6, "")]
    path = tmp_path / "t.csv"
    write_trace(path, requests)
    assert path.read_text().splitlines() == [
        "arrival_s,prompt_tokens,output_tokens,slo_class",
        "0.000000,10,5,chat",
        "1.500000,20,6,",
    ]
    assert read_trace(path) == requests
    # An empty class cell takes the default class.
    assert read_trace(path, default_class="batch")[1].slo_class == "batch"


def test_default_class_without_class_column(tmp_path: Path) -> None:
    path = _write(tmp_path, "arrival_s,prompt_tokens,output_tokens\n0,1,1\n")
    assert read_trace(path, default_class="gold") == [TraceRequest(0.0, 1, 1, "gold")]


def test_write_is_deterministic(tmp_path: Path) -> None:
    requests = [TraceRequest(1 / 3, 4, 5, "a,b"), TraceRequest(2 / 3, 6, 7, "c")]
    first, second = tmp_path / "a.csv", tmp_path / "b.csv"
    write_trace(first, requests)
    write_trace(second, requests)
    assert first.read_bytes() == second.read_bytes()
    assert [r.slo_class for r in read_trace(first)] == ["a,b", "c"]


@pytest.mark.parametrize(
    "requests",
    [
        [],
        [TraceRequest(1.0, 1, 1), TraceRequest(0.5, 1, 1)],
        [TraceRequest(-1.0, 1, 1)],
        [TraceRequest(math.nan, 1, 1)],
        [TraceRequest(0.0, 0, 1)],
        [TraceRequest(0.0, 1, 1, " padded ")],
    ],
)
def test_write_rejects_unreadable_traces(tmp_path: Path, requests: list[TraceRequest]) -> None:
    with pytest.raises(ValueError):
        write_trace(tmp_path / "t.csv", requests)


_requests = st.lists(
    st.tuples(
        st.floats(0, 1e6, allow_nan=False),
        st.integers(1, 10**6),
        st.integers(1, 10**6),
        st.sampled_from(["", "chat", "code"]),
    ),
    min_size=1,
    max_size=30,
)


@settings(max_examples=50, deadline=None)
@given(_requests)
def test_round_trip_property(tmp_path_factory: pytest.TempPathFactory, rows: list[tuple]) -> None:
    arrivals = sorted(row[0] for row in rows)
    requests = [TraceRequest(t, p, o, c) for t, (_, p, o, c) in zip(arrivals, rows, strict=True)]
    path = tmp_path_factory.mktemp("rt") / "t.csv"
    write_trace(path, requests)
    back = read_trace(path)
    assert [(r.prompt_tokens, r.output_tokens, r.slo_class) for r in back] == [
        (r.prompt_tokens, r.output_tokens, r.slo_class) for r in requests
    ]
    # Arrivals are written with microsecond resolution.
    assert all(abs(a.arrival_s - b.arrival_s) <= 5e-7 for a, b in zip(back, requests, strict=True))


# --- Azure format ------------------------------------------------------------------------------


def test_azure_small_file_is_rebased_sorted_and_truncated(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "TIMESTAMP,ContextTokens,GeneratedTokens\r\n"
        "2023-11-16 18:15:47.0000009,20,2\r\n"
        "2023-11-16 18:15:46.5000000,10,1\r\n"
        "2023-11-16 18:15:47.0000000,30,3",
    )
    got = read_trace(path, default_class="conv")
    assert got == [
        TraceRequest(0.0, 10, 1, "conv"),
        # The 7th fractional digit is dropped, so these two tie; the stable sort keeps file order.
        TraceRequest(0.5, 20, 2, "conv"),
        TraceRequest(0.5, 30, 3, "conv"),
    ]


@pytest.mark.parametrize(
    ("service", "rows", "duration_s", "first"),
    [
        ("conv", 19366, 3501.721937, (374, 44)),
        ("code", 8819, 3435.948056, (4808, 10)),
    ],
)
def test_embedded_azure_traces(
    service: str, rows: int, duration_s: float, first: tuple[int, int]
) -> None:
    requests = read_embedded_trace(AZURE_2023_FILES[service], default_class="azure")
    # The published files have a header and no final newline, so `wc -l` of the decompressed
    # file also gives these numbers of data rows.
    assert len(requests) == rows
    assert requests[0].arrival_s == 0.0
    assert (requests[0].prompt_tokens, requests[0].output_tokens) == first
    assert requests[-1].arrival_s == pytest.approx(duration_s, abs=1e-9)
    assert all(a.arrival_s <= b.arrival_s for a, b in itertools.pairwise(requests))
    assert all(r.prompt_tokens >= 1 and r.output_tokens >= 1 for r in requests)
    assert {r.slo_class for r in requests} == {"azure"}


def test_embedded_trace_reads_like_the_decompressed_file(tmp_path: Path) -> None:
    name = AZURE_2023_FILES["code"]
    data = importlib.resources.files("disaggpool.data").joinpath(name).read_bytes()
    path = tmp_path / name.removesuffix(".gz")
    path.write_bytes(gzip.decompress(data))
    assert read_embedded_trace(name, default_class="x") == read_trace(path, default_class="x")


def test_azure_services_label_each_service_with_its_class() -> None:
    services = azure_services()
    assert set(services) == set(SERVICE_CLASSES) == {"chat", "code"}
    for slo_class, requests in services.items():
        assert {r.slo_class for r in requests} == {slo_class}
    assert len(services["chat"]) == 19366 and len(services["code"]) == 8819


def test_unknown_embedded_trace() -> None:
    with pytest.raises(FileNotFoundError):
        read_embedded_trace("absent.csv.gz")


def test_parse_trace_names_its_source_in_errors() -> None:
    text = io.StringIO("arrival_s,prompt_tokens,output_tokens\n0,1,1\n1,x,1\n", newline="")
    with pytest.raises(InputError) as info:
        parse_trace(text, "inline")
    assert (info.value.source, info.value.field) == ("inline", "line 3: prompt_tokens")
    ok = io.StringIO("arrival_s,prompt_tokens,output_tokens\n0,1,1\n", newline="")
    assert parse_trace(ok, "inline", default_class="c") == [TraceRequest(0.0, 1, 1, "c")]


# --- malformed files ---------------------------------------------------------------------------

_OURS = "arrival_s,prompt_tokens,output_tokens\n"
_AZURE = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


@pytest.mark.parametrize(
    ("text", "field", "fragment"),
    [
        ("", "<file>", "no requests"),
        ("\n\n", "<file>", "no requests"),
        (_OURS, "<file>", "no requests"),
        (_AZURE, "<file>", "no requests"),
        ("time,prompt,output\n0,1,1\n", "line 1: header", "arrival_s,prompt_tokens"),
        (_OURS + "0,1,1\n0.5,abc,3\n", "line 3: prompt_tokens", "not an integer"),
        (_OURS + "0,1.5,3\n", "line 2: prompt_tokens", "not an integer"),
        (_OURS + "-1,2,3\n", "line 2: arrival_s", ">= 0"),
        (_OURS + "nan,2,3\n", "line 2: arrival_s", "finite"),
        (_OURS + "x,2,3\n", "line 2: arrival_s", "not a number"),
        (_OURS + "0,1,1\n2,1,1\n1,1,1\n", "line 4: arrival_s", "non-decreasing"),
        (_OURS + "0,1\n", "line 2: output_tokens", "missing"),
        (_OURS + "0,1,1,gold\n", "line 2: row", "4 columns"),
        (_OURS + "0,1,0\n", "line 2: output_tokens", ">= 1"),
        (_OURS + "0,0,5\n", "line 2: prompt_tokens", ">= 1"),
        (_OURS + "0,1,1\n\n1,2\n", "line 4: output_tokens", "missing"),
        (_AZURE + "yesterday,1,1\n", "line 2: TIMESTAMP", "not a timestamp"),
        (_AZURE + "2023-11-16 18:15:46.68,1,x\n", "line 2: GeneratedTokens", "not an integer"),
        (
            _AZURE + "2023-11-16 18:15:46,1,1\n2023-11-16 18:15:47+00:00,1,1\n",
            "line 3: TIMESTAMP",
            "time zone",
        ),
    ],
)
def test_malformed_files(tmp_path: Path, text: str, field: str, fragment: str) -> None:
    path = _write(tmp_path, text, name="bad_trace.csv")
    with pytest.raises(InputError) as info:
        read_trace(path)
    err = info.value
    assert err.source == str(path)
    assert err.field == field
    assert fragment in err.message
    assert str(err).startswith(f"{path}: {field}: ")


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.csv"
    with pytest.raises(InputError) as info:
        read_trace(path)
    assert (info.value.source, info.value.field) == (str(path), "<file>")


def test_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "binary.csv"
    path.write_bytes(b"\xff\xfe\x00\x81garbage")
    with pytest.raises(InputError) as info:
        read_trace(path)
    assert info.value.field == "<file>"
