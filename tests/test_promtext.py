"""`promtext`, the package's one Prometheus text parser, checked against `prometheus_client`'s:
on the emulator's whole `/metrics` page (whose names and labels tests/emulator checks against
real vLLM's) and on the format's corner cases; plus what it must refuse and what it must skip."""

from __future__ import annotations

import math
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from disaggpool import promtext
from disaggpool.core.hardware import builtin_profile
from disaggpool.emulator.config import EmulatorConfig
from disaggpool.emulator.harness import EmulatorThread

Triple = tuple[str, dict[str, str], float]


def library(text: str) -> list[Triple]:
    return [
        (s.name, dict(s.labels), float(s.value))
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    ]


def ours(text: str, names: list[str]) -> list[Triple]:
    return [(s.name, dict(s.labels), s.value) for s in promtext.parse(text, names)]


def key(t: Triple) -> tuple[str, tuple[tuple[str, str], ...]]:
    return t[0], tuple(sorted(t[1].items()))


@pytest.fixture(scope="module")
def emulator_page() -> str:
    cfg = EmulatorConfig(builtin_profile("a40-llama3-8b"), port=0, side_channel_port=0)
    with EmulatorThread(cfg) as emu:
        return urllib.request.urlopen(f"{emu.url}/metrics", timeout=10).read().decode()


def test_every_sample_of_the_emulators_page_reads_as_the_library_reads_it(
    emulator_page: str,
) -> None:
    expected = library(emulator_page)
    names = sorted({name for name, _, _ in expected})
    got = ours(emulator_page, names)
    assert len(got) == len(expected) > 100  # every histogram bucket of the page
    assert sorted(got, key=key) == sorted(expected, key=key)
    # And vLLM's 40-label line in particular, values exactly as served.
    (info,) = promtext.parse(emulator_page, ["vllm:cache_config_info"])
    assert info.labels["block_size"] == "16" and int(info.labels["num_gpu_blocks"]) > 0


@pytest.mark.parametrize(
    "line",
    [
        'a{x="q\\"uote",y="back\\\\slash",z="new\\nline"} 1.5',
        'a{x="\\q"} 6',  # an unknown escape is kept as written
        'a{x="a,b}c"} 5',  # a brace and a comma inside a quoted value
        'a{x="1",} 2',  # a trailing comma
        'a{ x = "1" , y="2" } 4',
        "a{} 8",
        "a 3 1700000000000",  # a timestamp
        "a  7",
        "a 1e-3",
        "a +Inf",
        "a -Inf",
    ],
)
def test_corner_cases_read_as_the_library_reads_them(line: str) -> None:
    assert ours(line, ["a"]) == library(line + "\n")


def test_nan_is_a_value() -> None:
    (s,) = promtext.parse("a NaN", ["a"])
    assert math.isnan(s.value)


def test_only_the_named_series_are_read_in_page_order() -> None:
    text = "\n".join(
        [
            "# HELP w Waiting.",
            "# TYPE w gauge",
            'w{engine="0"} 1',
            'w_by_reason{reason="x"} 100',  # shares the prefix: not w
            "broken{ this is not a sample line",  # another series: never parsed
            'w{engine="1"} 2',
            "w_sum 9\r",  # a CRLF page
            "h_count 4",
        ]
    )
    assert ours(text, ["w", "w_sum"]) == [
        ("w", {"engine": "0"}, 1.0),
        ("w", {"engine": "1"}, 2.0),
        ("w_sum", {}, 9.0),
    ]
    assert promtext.parse(text, []) == []
    assert promtext.parse("<html>not metrics</html>", ["w"]) == []


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ('a{x="1"} lots', "malformed sample line"),
        ('a{x="1" 3', "malformed sample line"),
        ('a{x="1"}', "malformed sample line"),
        ("a", "malformed sample line"),
        ('a{x="1"} 1 notats', "malformed sample line"),
        ("a{x=1} 3", "malformed labels"),
        ('a{x="1" y="2"} 3', "malformed labels"),
        ('a{x="1",,y="2"} 3', "malformed labels"),
    ],
)
def test_a_malformed_line_of_a_wanted_series_is_refused(line: str, match: str) -> None:
    with pytest.raises(promtext.PromTextError, match=match):
        promtext.parse(f"b 1\n{line}\n", ["a"])
    assert isinstance(promtext.PromTextError(), ValueError)


def test_total_sums_the_matching_samples() -> None:
    text = "\n".join(
        [
            'd{role="decode",pod="d1"} 3',
            'd{role="decode",pod="d2"} 4',
            'd{role="prefill",pod="p1"} 5',
            'other{role="decode"} 100',
        ]
    )
    samples = promtext.parse(text, ["d", "other"])
    assert promtext.total(samples, "d") == 12.0
    assert promtext.total(samples, "d", {"role": "decode"}) == 7.0
    assert promtext.total(samples, "d", {"role": "decode", "pod": "d2"}) == 4.0
    assert promtext.total(samples, "d", {"role": "nobody"}) == 0.0
    assert promtext.total(samples, "missing") == 0.0
