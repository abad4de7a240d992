"""Tests of disaggpool.formats.fields: every typed getter under both strategies (raise at the first
problem, collect every problem), both conventions (config files, Kubernetes resources), keyed
sections, `read_slo_classes`, and the operator's spec reading through the collecting reader."""

from __future__ import annotations

from typing import Any

import pytest

from disaggpool.core.contracts import SLOClass
from disaggpool.errors import InputError
from disaggpool.formats.fields import (
    CONFIG_FILE,
    KUBERNETES,
    CollectProblems,
    FieldReader,
    Section,
    read_slo_classes,
)
from disaggpool.operator.spec import parse_spec


def _raising() -> FieldReader:
    return FieldReader("f.yaml")


def _collecting(kubernetes: bool = False) -> tuple[FieldReader, CollectProblems]:
    problems = CollectProblems()
    return FieldReader("f.yaml", problems, KUBERNETES if kubernetes else CONFIG_FILE), problems


def _messages(problems: CollectProblems) -> list[str]:
    return [str(p) for p in problems.problems]


# --- raise at the first problem: config files -------------------------------------------------

# (getter call, the exact error text)
RAISES: list[tuple[str, Any, str]] = [
    ("mapping", lambda r: r.mapping([1], "a.b"), "f.yaml: a.b: must be a mapping"),
    ("mapping none", lambda r: r.mapping(None, "a"), "f.yaml: a: must be a mapping"),
    ("string type", lambda r: r.string(3, "s"), "f.yaml: s: must be a non-empty string, got 3"),
    ("string empty", lambda r: r.string("", "s"), "f.yaml: s: must be a non-empty string, got ''"),
    (
        "integer type",
        lambda r: r.integer("4", "n"),
        "f.yaml: n: must be an integer >= 1, got '4'",
    ),
    (
        "integer bool",
        lambda r: r.integer(True, "n"),
        "f.yaml: n: must be an integer >= 1, got True",
    ),
    (
        "integer range",
        lambda r: r.integer(-1, "n", minimum=0),
        "f.yaml: n: must be an integer >= 0, got -1",
    ),
    ("integer float", lambda r: r.integer(1.5, "n"), "f.yaml: n: must be an integer >= 1, got 1.5"),
    ("number type", lambda r: r.number("x", "x"), "f.yaml: x: must be a number, got 'x'"),
    ("number bool", lambda r: r.number(False, "x"), "f.yaml: x: must be a number, got False"),
    ("number minimum", lambda r: r.number(-1, "x"), "f.yaml: x: must be >= 0.0, got -1"),
    (
        "number custom minimum",
        lambda r: r.number(1.5, "x", minimum=2),
        "f.yaml: x: must be >= 2, got 1.5",
    ),
    ("number positive", lambda r: r.number(0, "x", positive=True), "f.yaml: x: must be > 0, got 0"),
    ("boolean", lambda r: r.boolean("yes", "b"), "f.yaml: b: must be true or false, got 'yes'"),
    ("list empty", lambda r: r.nonempty_list([], "l"), "f.yaml: l: must be a non-empty list"),
    (
        "list of",
        lambda r: r.nonempty_list({"a": 1}, "l", of="integers"),
        "f.yaml: l: must be a non-empty list of integers",
    ),
    ("strings", lambda r: r.strings(["a", 1], "l"), "f.yaml: l: must be a list of strings"),
    ("strings type", lambda r: r.strings("a", "l"), "f.yaml: l: must be a list of strings"),
    ("mappings", lambda r: r.mappings([{}, 1], "l"), "f.yaml: l: must be a list of mappings"),
    ("string map", lambda r: r.string_map({"a": 1}, "m"), "f.yaml: m: must be a map of strings"),
    (
        "known",
        lambda r: r.known({"a": 1, "c": 2}, "top", {"a", "b"}),
        "f.yaml: top.c: unknown field (allowed: a, b)",
    ),
    (
        "known at root",
        lambda r: r.known({"z": 1}, "", {"b", "a"}),
        "f.yaml: z: unknown field (allowed: a, b)",
    ),
]


@pytest.mark.parametrize(
    ("call", "text"), [(c, t) for _, c, t in RAISES], ids=[i for i, *_ in RAISES]
)
def test_raising_reader_names_file_and_field(call: Any, text: str) -> None:
    with pytest.raises(InputError) as err:
        call(_raising())
    assert str(err.value) == text
    assert err.value.source == "f.yaml"
    assert err.value.field == text.split(": ")[1]


def test_valid_values_come_back_typed() -> None:
    r = _raising()
    assert r.mapping({"a": 1}, "m") == {"a": 1}
    assert r.string("x", "s") == "x"
    assert r.integer(0, "n", minimum=0) == 0 and r.integer(5, "n") == 5
    number = r.number(2, "x", positive=True)
    assert number == 2.0 and isinstance(number, float)
    assert r.number(0, "x") == 0.0
    assert r.boolean(False, "b") is False
    assert r.nonempty_list([1], "l") == [1]
    assert r.strings([], "l") == () and r.strings(["a", "b"], "l") == ("a", "b")
    assert r.mappings([{"a": 1}], "l") == ({"a": 1},)
    assert r.string_map({"a": "b"}, "m") == {"a": "b"}
    r.known({"a": 1}, "", {"a"})  # no problem, nothing raised


def test_fail_builds_the_error_for_the_caller_to_raise() -> None:
    problems = CollectProblems()
    err = FieldReader("f.yaml", problems).fail("a", "bad")
    assert isinstance(err, InputError) and str(err) == "f.yaml: a: bad"
    assert problems.problems == []  # fail does not go through the strategy


# --- collect every problem: the reader goes on with the defaults ------------------------------


def test_collecting_reader_records_every_problem_in_order_and_returns_defaults() -> None:
    r, problems = _collecting()
    assert r.mapping(3, "m") == {}
    assert r.string(None, "s", default="d") == "d"
    assert r.integer("x", "n", default=7) == 7
    assert r.number(-1, "x", positive=True, default=0.5) == 0.5
    assert r.boolean(1, "b", default=True) is True
    assert r.nonempty_list([], "l") == []
    assert r.strings([1], "ss") == ()
    assert r.mappings("x", "ms") == ()
    assert r.string_map([], "sm") == {}
    r.known({"q": 1, "w": 2}, "k", set())
    r.problem("own", "a caller's check")
    assert _messages(problems) == [
        "f.yaml: m: must be a mapping",
        "f.yaml: s: must be a non-empty string, got None",
        "f.yaml: n: must be an integer >= 1, got 'x'",
        "f.yaml: x: must be > 0, got -1",
        "f.yaml: b: must be true or false, got 1",
        "f.yaml: l: must be a non-empty list",
        "f.yaml: ss: must be a list of strings",
        "f.yaml: ms: must be a list of mappings",
        "f.yaml: sm: must be a map of strings",
        "f.yaml: k.q: unknown field (allowed: )",
        "f.yaml: k.w: unknown field (allowed: )",
        "f.yaml: own: a caller's check",
    ]


def test_collecting_reader_records_nothing_for_good_values() -> None:
    r, problems = _collecting(kubernetes=True)
    r.integer(3, "n")
    r.string("", "s")
    r.mapping(None, "m", optional=True)
    assert problems.problems == []


def test_raising_reader_stops_at_the_first_problem() -> None:
    r = _raising()
    with pytest.raises(InputError, match="first"):
        r.problem("first", "one")
        r.problem("second", "two")  # never reached


# --- conventions: Kubernetes resources --------------------------------------------------------


def test_kubernetes_conventions_wording() -> None:
    r, problems = _collecting(kubernetes=True)
    assert r.mapping([], "spec.x") == {}
    assert r.mappings([1], "l") == ()
    assert r.string("", "s") == ""  # "" is a string field's zero value, not a problem
    assert r.string(5, "s", default="d") == "d"
    assert r.integer(1.5, "n", default=2) == 2
    assert r.integer(0, "n", default=3) == 3
    assert r.integer(-2, "n", minimum=-2) == -2
    assert [(p.field, p.message) for p in problems.problems] == [
        ("spec.x", "must be an object"),
        ("l", "must be a list of objects"),
        ("s", "must be a string, got 5"),
        ("n", "must be an integer, got 1.5"),
        ("n", "must be >= 1, got 0"),
    ]


def test_optional_mapping_reads_none_as_empty_but_not_other_values() -> None:
    r, problems = _collecting()
    assert r.mapping(None, "m", optional=True) == {}
    assert r.mapping("x", "m", optional=True) == {}
    assert _messages(problems) == ["f.yaml: m: must be a mapping"]


# --- sections: keyed getters with defaults for missing keys -----------------------------------


def test_section_paths_defaults_and_nesting() -> None:
    r, problems = _collecting(kubernetes=True)
    doc = {
        "role": {
            "replicas": 2,
            "gpuType": "H100",
            "variants": [{"name": "a", "replicas": -1}, {"name": 3}],
            "nested": None,
            "labels": {"k": "v"},
        }
    }
    root = r.section(doc, "")
    role = root.section("role")
    assert isinstance(role, Section) and role.path == "role"
    assert role.at("replicas") == "role.replicas"
    assert role.integer("replicas", 1, minimum=0) == 2
    assert role.integer("missing", 9) == 9  # a missing key takes the default
    assert role.string("gpuType") == "H100" and role.string("gpuResource", "nvidia.com/gpu") == (
        "nvidia.com/gpu"
    )
    assert role.number("missing", 0.5, positive=True) == 0.5
    assert role.boolean("missing", True) is True
    assert role.strings("missing") == () and role.mappings("missing") == ()
    assert role.string_map("labels") == {"k": "v"} and role.string_map("missing") == {}
    assert not role.section("nested") and role.section("nested").path == "role.nested"
    assert "replicas" in role and "minReplicas" not in role and bool(role)
    variants = role.sections("variants")
    assert [v.path for v in variants] == ["role.variants[0]", "role.variants[1]"]
    assert variants[0].integer("replicas", 1, minimum=0) == 1
    assert variants[1].string("name", "fallback") == "fallback"
    variants[1].problem("name", "my own check")
    assert [str(p) for p in problems.problems] == [
        "f.yaml: role.variants[0].replicas: must be >= 0, got -1",
        "f.yaml: role.variants[1].name: must be a string, got 3",
        "f.yaml: role.variants[1].name: my own check",
    ]


def test_section_number_minimum_reads_as_written() -> None:
    r, problems = _collecting(kubernetes=True)
    sec = r.section({"x": -1, "y": 0}, "c")
    assert sec.number("x", 0.0) == 0.0
    assert sec.number("y", 1.0, positive=True) == 1.0
    assert _messages(problems) == [
        "f.yaml: c.x: must be >= 0, got -1",
        "f.yaml: c.y: must be > 0, got 0",
    ]


def test_section_of_a_non_mapping_is_empty_and_reported() -> None:
    r, problems = _collecting(kubernetes=True)
    sec = r.section({"router": [1]}, "").section("router")
    assert not sec and sec.integer("replicas", 4) == 4
    assert r.section({"v": "x"}, "").sections("v") == ()
    assert _messages(problems) == [
        "f.yaml: router: must be an object",
        "f.yaml: v: must be a list of objects",
    ]


def test_section_under_a_raising_reader_raises() -> None:
    sec = _raising().section({"n": 0}, "top")
    with pytest.raises(InputError) as err:
        sec.integer("n", 1)
    assert str(err.value) == "f.yaml: top.n: must be an integer >= 1, got 0"


# --- read_slo_classes -------------------------------------------------------------------------


def test_read_slo_classes_puts_the_default_first() -> None:
    raw = [
        {"name": "chat", "ttft_s": 1, "tpot_s": 0.1},
        {"name": "batch", "ttft_s": 10, "tpot_s": 1.0, "default": True},
    ]
    assert read_slo_classes(_raising(), raw) == (
        SLOClass("batch", 10.0, 1.0),
        SLOClass("chat", 1.0, 0.1),
    )
    assert read_slo_classes(_raising(), raw[:1])[0].name == "chat"


def test_a_class_may_be_sheddable_in_both_readers() -> None:
    raw = [{"name": "batch", "ttft_s": 10, "tpot_s": 1.0, "sheddable": True}]
    assert read_slo_classes(_raising(), raw) == (SLOClass("batch", 10.0, 1.0, sheddable=True),)
    with pytest.raises(InputError, match=r"slo_classes\[0\]\.sheddable: must be true or false"):
        read_slo_classes(_raising(), [{**raw[0], "sheddable": "yes"}])
    classes = [{"name": "batch", "ttftSeconds": 10, "tpotSeconds": 1, "sheddable": True}]
    spec, issues = parse_spec(
        {
            "model": {"name": "m"},
            "engine": {"image": "i"},
            "router": {"sloClasses": classes},
        },
        "img",
    )
    assert not issues and spec is not None
    assert spec.router.slo_classes[0].sheddable


@pytest.mark.parametrize(
    ("raw", "text"),
    [
        (None, "f.yaml: slo_classes: must be a non-empty list"),
        ([], "f.yaml: slo_classes: must be a non-empty list"),
        (["x"], "f.yaml: slo_classes[0]: must be a mapping"),
        ([{"ttft_s": 1, "tpot_s": 1}], "f.yaml: slo_classes[0].name: missing or not a string"),
        (
            [{"name": "a", "ttft_s": 0, "tpot_s": 1}],
            "f.yaml: slo_classes[0].ttft_s: must be > 0, got 0",
        ),
        ([{"name": "a", "ttft_s": 1}], "f.yaml: slo_classes[0].tpot_s: must be a number, got None"),
        (
            [{"name": "a", "ttft_s": 1, "tpot_s": 1, "tbt": 2}],
            "f.yaml: slo_classes[0].tbt: unknown field "
            "(allowed: default, name, sheddable, tpot_s, ttft_s)",
        ),
        (
            [{"name": "a", "ttft_s": 1, "tpot_s": 1}, {"name": "a", "ttft_s": 2, "tpot_s": 2}],
            "f.yaml: slo_classes: class names must be unique",
        ),
    ],
)
def test_read_slo_classes_errors(raw: Any, text: str) -> None:
    with pytest.raises(InputError) as err:
        read_slo_classes(_raising(), raw)
    assert str(err.value) == text


def test_read_slo_classes_with_a_collecting_reader_returns_none_for_an_empty_list() -> None:
    r, problems = _collecting()
    assert read_slo_classes(r, [], "classes") == ()
    assert _messages(problems) == ["f.yaml: classes: must be a non-empty list"]


# --- the operator's spec: every problem, with its CR field path, once -------------------------


def test_operator_spec_reports_every_problem_once_in_document_order() -> None:
    spec = {
        "model": {"name": "m", "maxModelLen": 0},
        "engine": {"image": "i", "startupTimeoutSeconds": 10, "resources": "lots"},
        "prefill": {"gpus": -1},  # 0 is a CPU engine
        "decode": {
            "variants": [
                {"name": "a", "replicas": "2", "extraArgs": "--x"},
                {"name": "b", "extraArgs": ["--port=1"]},
            ]
        },
        "router": {"sloClasses": [{"name": "c", "ttftSeconds": -1}], "maxInflight": 0},
        "calibration": {"enabled": "yes", "maxPredictionError": -1},
        "autoscaling": {"targetGoodput": 2},
    }
    result, issues = parse_spec(spec, "img")
    assert result is None
    assert [str(i) for i in issues] == [
        "spec.model.maxModelLen: must be >= 1, got 0",
        "spec.engine.resources: must be an object",
        "spec.engine.startupTimeoutSeconds: must be >= 60, got 10",
        "spec.prefill.gpus: must be >= 0, got -1",
        "spec.decode.variants[0].replicas: must be an integer, got '2'",
        "spec.decode.variants[0].extraArgs: must be a list of strings",
        "spec.decode.variants[1].extraArgs: --port is set by the operator; "
        "remove it from extraArgs",
        "spec.router.sloClasses[0].tpotSeconds: required",
        "spec.router.sloClasses[0].ttftSeconds: must be > 0, got -1",
        "spec.router.maxInflight: must be >= 1, got 0",
        "spec.calibration.enabled: must be true or false, got 'yes'",
        "spec.calibration.maxPredictionError: must be >= 0, got -1",
        "spec.autoscaling.targetGoodput: a fraction of requests in [0.5, 1)",
    ]
