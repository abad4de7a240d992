"""Tests of disaggpool.formats.mooncake: the embedded Mooncake conversation trace, round trips,
and malformed lines named by file, line and field."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from disaggpool.errors import InputError
from disaggpool.formats.embedded import EMBEDDED_TRACES, embedded_trace
from disaggpool.formats.mooncake import read_mooncake, write_mooncake
from disaggpool.formats.traces import TraceRequest, read_trace, write_trace
from disaggpool.sim.workload import clip_lengths

GOOD = {"timestamp": 5, "input_length": 1030, "output_length": 7, "hash_ids": [4, 9, 11]}


def _lines(tmp_path: Path, *docs: object, name: str = "t.jsonl") -> Path:
    path = tmp_path / name
    text = "".join((d if isinstance(d, str) else json.dumps(d)) + "\n" for d in docs)
    path.write_text(text, encoding="utf-8")
    return path


def prefix_hit_share(trace: list[TraceRequest]) -> float:
    """Prompt tokens an infinite shared prefix cache would hit (leading blocks seen before)."""
    seen: set[int] = set()
    hit = total = 0
    for r in trace:
        leading = True
        for i, block in enumerate(r.blocks):
            tokens = min(r.block_tokens, r.prompt_tokens - i * r.block_tokens)
            total += tokens
            if leading and block in seen:
                hit += tokens
            else:
                leading = False
        seen.update(r.blocks)
    return hit / total


def test_the_embedded_conversation_trace() -> None:
    trace = embedded_trace("mooncake-conversation")
    assert len(trace) == 12_031
    assert trace[0].arrival_s == 0.0 and 3536.0 < trace[-1].arrival_s < 3537.0
    assert trace[1] == TraceRequest(0.0, 7322, 490, "", (0, *range(14, 28)), 512)
    assert all(len(r.blocks) == -(-r.prompt_tokens // 512) for r in trace)
    # The trace's own README: an infinite shared cache would hit 37% of the prompt tokens.
    assert prefix_hit_share(trace) == pytest.approx(0.374, abs=0.001)


def test_embedded_names_are_checked() -> None:
    assert set(EMBEDDED_TRACES) == {"azure-conv", "azure-code", "mooncake-conversation"}
    with pytest.raises(KeyError, match="mooncake-conversation"):
        embedded_trace("mooncake")


@pytest.mark.parametrize("name", ["t.jsonl", "t.jsonl.gz"])
def test_round_trip(tmp_path: Path, name: str) -> None:
    requests = [
        TraceRequest(0.0, 1030, 7, "chat", (4, 9, 11), 512),
        TraceRequest(0.25, 512, 1, "", (4,), 512),
        TraceRequest(1.5, 600, 90, "code", (4, 12), 512),
    ]
    path = tmp_path / name
    write_mooncake(path, requests)
    assert read_trace(path) == requests  # read_trace dispatches on the name
    first = path.read_bytes()
    write_mooncake(path, requests)
    assert path.read_bytes() == first  # deterministic, gzip included
    if name.endswith(".gz"):
        assert gzip.decompress(first).startswith(b'{"timestamp": 0, ')


def test_arrivals_are_rebased_and_sorted(tmp_path: Path) -> None:
    late = {**GOOD, "timestamp": 2500}
    path = _lines(tmp_path, late, GOOD)
    trace = read_mooncake(path, default_class="chat")
    assert [r.arrival_s for r in trace] == [0.0, 2.495]
    assert {r.slo_class for r in trace} == {"chat"}


def test_writers_refuse_what_they_cannot_give_back(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="prefix blocks"):
        write_trace(tmp_path / "t.csv", [TraceRequest(0.0, 10, 5, "", (1,), 512)])
    with pytest.raises(ValueError, match="request 0: needs prefix blocks"):
        write_mooncake(tmp_path / "t.jsonl", [TraceRequest(0.0, 10, 5)])
    with pytest.raises(ValueError, match="request 1: needs prefix blocks of 512"):
        write_mooncake(
            tmp_path / "t.jsonl",
            [TraceRequest(0.0, 10, 5, "", (1,), 512), TraceRequest(0.0, 10, 5, "", (1,), 16)],
        )


def test_clipping_a_prompt_keeps_the_blocks_it_covers() -> None:
    r = TraceRequest(0.0, 1030, 7, "", (4, 9, 11), 512)
    assert clip_lengths([r], 600, 100)[0].blocks == (4, 9)
    assert clip_lengths([r], 512, 100)[0].blocks == (4,)
    assert clip_lengths([r], 2000, 100)[0] is r


@pytest.mark.parametrize(
    ("doc", "field", "message"),
    [
        ("{not json", "line 2", "not a JSON object"),
        ("[1, 2]", "line 2", "not a JSON object: list"),
        ({k: v for k, v in GOOD.items() if k != "hash_ids"}, "line 2: hash_ids", "missing"),
        ({**GOOD, "extra": 1}, "line 2: extra", "unknown field"),
        ({**GOOD, "timestamp": -1}, "line 2: timestamp", "must be >= 0"),
        ({**GOOD, "timestamp": 1.5}, "line 2: timestamp", "must be an integer"),
        ({**GOOD, "input_length": 0}, "line 2: input_length", "must be >= 1"),
        ({**GOOD, "output_length": True}, "line 2: output_length", "must be an integer"),
        ({**GOOD, "hash_ids": "4 9 11"}, "line 2: hash_ids", "must be a list"),
        ({**GOOD, "hash_ids": [4, -9, 11]}, "line 2: hash_ids", "integers >= 0"),
        ({**GOOD, "hash_ids": [4, 9]}, "line 2: hash_ids", "2 ids for input_length 1030, expected"),
        ({**GOOD, "hash_ids": [4, 9, 4]}, "line 2: hash_ids", "repeats"),
        ({**GOOD, "slo_class": 3}, "line 2: slo_class", "must be a string"),
    ],
)
def test_malformed_lines_name_file_line_and_field(
    tmp_path: Path, doc: object, field: str, message: str
) -> None:
    path = _lines(tmp_path, GOOD, doc)
    with pytest.raises(InputError) as err:
        read_trace(path)
    assert str(path) in str(err.value) and field in str(err.value) and message in str(err.value)


def test_broken_files(tmp_path: Path) -> None:
    empty = _lines(tmp_path, "", name="empty.jsonl")
    with pytest.raises(InputError, match="no requests"):
        read_trace(empty)
    fake_gz = tmp_path / "fake.jsonl.gz"
    fake_gz.write_text(json.dumps(GOOD))
    with pytest.raises(InputError, match="cannot read"):
        read_trace(fake_gz)
    with pytest.raises(InputError, match="cannot read"):
        read_trace(tmp_path / "absent.jsonl")
