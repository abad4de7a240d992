"""Tests of disaggpool.sim.scenario: the example files, field semantics, malformed scenarios."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from disaggpool.core.hardware import BUILTIN_PROFILES
from disaggpool.core.policies.registry import POLICY_NAMES
from disaggpool.core.profile import profile_to_dict
from disaggpool.errors import InputError
from disaggpool.sim.scenario import Scenario, load_scenario

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
A40 = BUILTIN_PROFILES["a40-llama3-8b"]

TRACE_CSV = """arrival_s,prompt_tokens,output_tokens,slo_class
0.0,100,10,chat
0.5,200,20,code
1.0,300,30,
"""


def _base() -> dict[str, Any]:
    """A small valid scenario that reads trace.csv next to the scenario file."""
    return {
        "name": "test",
        "pool": {
            "prefill": [{"count": 1, "profile": "a40-llama3-8b"}],
            "decode": [
                {"count": 2, "profile": "a40-llama3-8b"},
                {"profile": "a40-llama3-8b", "speed": 0.8},
            ],
        },
        "datasheet": "a40-llama3-8b-datasheet",
        "slo_classes": [
            {"name": "chat", "ttft_s": 1.7, "tpot_s": 0.065},
            {"name": "code", "ttft_s": 3.5, "tpot_s": 0.13},
        ],
        "trace": {"file": "trace.csv"},
        "policies": ["round_robin", "calibrated", "uncalibrated"],
        "seeds": [1, 2],
    }


def _write(tmp_path: Path, doc: Any, name: str = "scenario.yaml") -> Path:
    if not (tmp_path / "trace.csv").exists():
        (tmp_path / "trace.csv").write_text(TRACE_CSV, encoding="utf-8")
    path = tmp_path / name
    text = json.dumps(doc) if name.endswith(".json") else yaml.safe_dump(doc, sort_keys=False)
    path.write_text(text, encoding="utf-8")
    return path


def _load(tmp_path: Path, doc: Any) -> Scenario:
    return load_scenario(_write(tmp_path, doc))


# --- the examples ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["scenario.yaml", "scenario_trace.yaml"])
def test_examples_load(name: str) -> None:
    s = load_scenario(EXAMPLES / name)
    assert s.trace
    assert len(s.specs()) == len(s.policies) * len(s.seeds)
    assert {c.name for c in s.slo_classes} == {"chat", "code"}
    assert s.datasheet is BUILTIN_PROFILES["a40-llama3-8b-datasheet"]


def test_main_example_contents() -> None:
    s = load_scenario(EXAMPLES / "scenario.yaml")
    assert [i.name for i in s.instances] == [
        "prefill-0",
        "prefill-1",
        "decode-0",
        "decode-1",
        "decode-2",
        "decode-3",
    ]
    slow = s.instances[-1]
    assert slow.true_profile.decode.d0 == pytest.approx(A40.decode.d0 / 0.8)
    assert slow.believed_profile == slow.true_profile  # perfect calibration by default
    assert s.policies == ("round_robin", "least_loaded", "length", "calibrated", "uncalibrated")
    assert s.seeds == (1,)
    assert len(s.trace) == 1500
    assert {r.slo_class for r in s.trace} == {"chat", "code"}
    assert s.slo_classes[0].name == "chat"
    assert (s.slo_classes[0].ttft_s, s.slo_classes[0].tpot_s) == (1.7, 0.065)


def test_trace_example_matches_csv() -> None:
    s = load_scenario(EXAMPLES / "scenario_trace.yaml")
    assert len(s.trace) == 20
    assert all(r.slo_class in ("chat", "code") for r in s.trace)  # empty cells -> default_class
    assert [i.name for i in s.instances] == ["prefill-0", "fast", "slow"]


def test_examples_are_deterministic(tmp_path: Path) -> None:
    first = load_scenario(EXAMPLES / "scenario.yaml")
    assert load_scenario(EXAMPLES / "scenario.yaml") == first
    # Another seed generates another trace: the example's trace is drawn, not constant.
    doc = yaml.safe_load((EXAMPLES / "scenario.yaml").read_text(encoding="utf-8"))
    assert load_scenario(_write(tmp_path, {**doc, "seeds": [2]})).trace != first.trace


# --- field semantics ---------------------------------------------------------------------------


def test_specs_policies_times_seeds(tmp_path: Path) -> None:
    s = _load(tmp_path, _base())
    specs = s.specs()
    assert len(specs) == 3 * 2
    assert [(x.seed, x.policy) for x in specs] == [
        (seed, policy)
        for seed in (1, 2)
        for policy in ("round_robin", "calibrated", "uncalibrated")
    ]
    assert all(x.trace == s.trace and x.instances == s.instances for x in specs)
    assert all(x.experiment == "run" and x.trace_name == "test" for x in specs)
    assert all(x.datasheet is s.datasheet and x.jitter == 0.03 for x in specs)


def test_defaults(tmp_path: Path) -> None:
    doc = _base()
    for key in ("name", "policies", "seeds", "datasheet"):
        del doc[key]
    s = _load(tmp_path, doc)
    assert s.name == "scenario"  # file stem
    assert s.policies == ("round_robin", "least_loaded", "length", "calibrated")
    assert s.seeds == (1,)
    assert s.predictor == "online"
    assert s.jitter == 0.03
    assert s.datasheet is None
    assert len(s.specs()) == 4


def test_pool_names_counts_and_believed(tmp_path: Path) -> None:
    doc = _base()
    doc["pool"]["decode"] = [
        {"name": "big", "profile": "h100-llama3-8b", "believed": "h100-llama3-8b-datasheet"},
        {"count": 2, "profile": "a40-llama3-8b", "speed": 1.25, "believed": "none"},
    ]
    s = _load(tmp_path, doc)
    decode = [i for i in s.instances if i.role == "decode"]
    assert [i.name for i in decode] == ["big", "decode-1", "decode-2"]
    assert decode[0].believed_profile is BUILTIN_PROFILES["h100-llama3-8b-datasheet"]
    assert decode[1].true_profile.prefill.p1 == pytest.approx(A40.prefill.p1 / 1.25)
    assert decode[1].believed_profile == decode[1].true_profile


def test_profile_file_relative_to_scenario(tmp_path: Path) -> None:
    (tmp_path / "profiles").mkdir()
    data = profile_to_dict(A40)
    data["name"] = "my-a40"
    (tmp_path / "profiles" / "my.yaml").write_text(yaml.safe_dump(data), encoding="utf-8")
    doc = _base()
    doc["pool"]["prefill"][0]["profile"] = "profiles/my.yaml"
    s = _load(tmp_path, doc)
    assert s.instances[0].true_profile.name == "my-a40"


def test_default_class(tmp_path: Path) -> None:
    doc = _base()
    doc["slo_classes"][1]["default"] = True
    s = _load(tmp_path, doc)
    assert [c.name for c in s.slo_classes] == ["code", "chat"]
    doc["trace"]["default_class"] = "code"
    s = _load(tmp_path, doc)
    assert [r.slo_class for r in s.trace] == ["chat", "code", "code"]


def test_limit_and_rate(tmp_path: Path) -> None:
    doc = _base()
    doc["trace"].update({"limit": 2, "rate": 4.0})
    s = _load(tmp_path, doc)
    assert len(s.trace) == 2
    assert [r.arrival_s for r in s.trace] == pytest.approx([0.0, 0.25])


def test_generated_trace(tmp_path: Path) -> None:
    doc = _base()
    doc["trace"] = {
        "generate": {
            "process": "gamma",
            "rate": 5.0,
            "cv": 1.5,
            "n": 300,
            "prompt_mean": 800,
            "output_mean": 100,
            "sigma": 0.5,
            "classes": {"chat": 3, "code": 1},
        }
    }
    s = _load(tmp_path, doc)
    assert len(s.trace) == 300
    assert s.trace[0].arrival_s == 0.0
    arrivals = [r.arrival_s for r in s.trace]
    assert arrivals == sorted(arrivals)
    assert {r.slo_class for r in s.trace} == {"chat", "code"}
    assert _load(tmp_path, doc).trace == s.trace  # seeded by the first seed
    doc["seeds"] = [7]
    assert _load(tmp_path, doc).trace != s.trace


def test_generated_poisson_without_classes(tmp_path: Path) -> None:
    doc = _base()
    doc["trace"] = {"generate": {"n": 50, "rate": 2.0}}
    s = _load(tmp_path, doc)
    assert len(s.trace) == 50
    assert all(r.slo_class == "" for r in s.trace)


def test_json_scenario_and_predictor(tmp_path: Path) -> None:
    doc = _base()
    doc.update(predictor="noisy:0.5", jitter=0)
    s = load_scenario(_write(tmp_path, doc, "scenario.json"))
    assert s.predictor == "noisy:0.5"
    assert s.jitter == 0.0


def test_yaml_exponent_floats(tmp_path: Path) -> None:
    path = _write(tmp_path, _base())
    path.write_text(path.read_text() + "jitter: 1e-2\n", encoding="utf-8")
    assert load_scenario(path).jitter == 0.01


# --- malformed scenarios -----------------------------------------------------------------------

Mutation = Callable[[dict[str, Any]], Any]


def _set(path: str, value: Any) -> Mutation:
    """Set a value at a dotted path; integer parts index lists."""

    def mutate(d: dict[str, Any]) -> None:
        *parents, leaf = path.split(".")
        target: Any = d
        for p in parents:
            target = target[int(p)] if isinstance(target, list) else target[p]
        if isinstance(target, list):
            target[int(leaf)] = value
        else:
            target[leaf] = value

    return mutate


def _drop(path: str) -> Mutation:
    def mutate(d: dict[str, Any]) -> None:
        *parents, leaf = path.split(".")
        target: Any = d
        for p in parents:
            target = target[int(p)] if isinstance(target, list) else target[p]
        del target[leaf]

    return mutate


def _both_trace_sources(d: dict[str, Any]) -> None:
    d["trace"]["generate"] = {"n": 10}


MALFORMED: list[tuple[str, Mutation, str]] = [
    ("unknown policy", _set("policies", ["round_robin", "fastest"]), "policies[1]"),
    ("policies not a list", _set("policies", "calibrated"), "policies"),
    ("empty policies", _set("policies", []), "policies"),
    ("missing pool.decode", _drop("pool.decode"), "pool.decode"),
    ("empty pool.prefill", _set("pool.prefill", []), "pool.prefill"),
    ("missing pool", _drop("pool"), "pool"),
    ("zero count", _set("pool.decode.0.count", 0), "pool.decode[0].count"),
    ("float count", _set("pool.decode.0.count", 1.5), "pool.decode[0].count"),
    ("bool count", _set("pool.decode.0.count", True), "pool.decode[0].count"),
    ("zero speed", _set("pool.decode.1.speed", 0), "pool.decode[1].speed"),
    ("missing profile", _drop("pool.prefill.0.profile"), "pool.prefill[0].profile"),
    ("unknown profile", _set("pool.prefill.0.profile", "b200"), "pool.prefill[0].profile"),
    ("profile not a string", _set("pool.prefill.0.profile", 3), "pool.prefill[0].profile"),
    ("bad believed", _set("pool.decode.0.believed", "tpu"), "pool.decode[0].believed"),
    ("group not a mapping", _set("pool.decode.0", "a40"), "pool.decode[0]"),
    ("unknown top-level field", _set("colour", "blue"), "colour"),
    ("unknown pool field", _set("pool.router", "x"), "pool.router"),
    ("unknown group field", _set("pool.decode.1.sped", 0.8), "pool.decode[1].sped"),
    ("unknown slo field", _set("slo_classes.0.ttft", 1), "slo_classes[0].ttft"),
    ("unknown trace field", _set("trace.files", "t.csv"), "trace.files"),
    ("negative ttft", _set("slo_classes.0.ttft_s", -1.0), "slo_classes[0].ttft_s"),
    ("zero ttft", _set("slo_classes.0.ttft_s", 0), "slo_classes[0].ttft_s"),
    ("string ttft", _set("slo_classes.0.ttft_s", "fast"), "slo_classes[0].ttft_s"),
    ("missing tpot", _drop("slo_classes.1.tpot_s"), "slo_classes[1].tpot_s"),
    ("missing class name", _drop("slo_classes.0.name"), "slo_classes[0].name"),
    ("duplicate class", _set("slo_classes.1.name", "chat"), "slo_classes"),
    ("no slo classes", _set("slo_classes", []), "slo_classes"),
    ("file and generate", _both_trace_sources, "trace"),
    ("neither file nor generate", _set("trace", {"rate": 1.0}), "trace"),
    ("trace not a mapping", _set("trace", "trace.csv"), "trace"),
    ("zero trace rate", _set("trace.rate", 0), "trace.rate"),
    ("zero limit", _set("trace.limit", 0), "trace.limit"),
    ("uncalibrated without datasheet", _drop("datasheet"), "datasheet"),
    ("bad datasheet", _set("datasheet", "nope"), "datasheet"),
    ("unknown predictor", _set("predictor", "psychic"), "predictor"),
    ("noisy predictor without sigma", _set("predictor", "noisy"), "predictor"),
    ("negative jitter", _set("jitter", -0.1), "jitter"),
    ("empty seeds", _set("seeds", []), "seeds"),
    ("negative seed", _set("seeds", [1, -2]), "seeds[1]"),
    ("string seed", _set("seeds", ["1"]), "seeds[0]"),
    ("class not in slo_classes", _set("slo_classes.1.name", "batch"), "trace"),
    ("default_class not in slo_classes", _set("trace.default_class", "gold"), "trace"),
    ("duplicate instance names", _set("pool.decode.1.name", "decode-0"), "pool"),
]


@pytest.mark.parametrize(
    ("mutate", "field"), [(m, f) for _, m, f in MALFORMED], ids=[i for i, _, _ in MALFORMED]
)
def test_malformed_scenario_names_field(tmp_path: Path, mutate: Mutation, field: str) -> None:
    doc = copy.deepcopy(_base())
    mutate(doc)
    path = _write(tmp_path, doc)
    with pytest.raises(InputError) as info:
        load_scenario(path)
    assert info.value.source == str(path)
    assert info.value.field == field
    assert str(info.value).startswith(f"{path}: {field}: ")


def test_unknown_policy_message_lists_valid(tmp_path: Path) -> None:
    doc = _base()
    doc["policies"] = ["round_robin", "fastest"]
    with pytest.raises(InputError) as info:
        _load(tmp_path, doc)
    assert "'fastest'" in info.value.message
    assert all(p in info.value.message for p in POLICY_NAMES)


def test_class_not_in_slo_classes_message(tmp_path: Path) -> None:
    doc = _base()
    doc["slo_classes"][1]["name"] = "batch"
    with pytest.raises(InputError, match="request 1 has SLO class 'code'"):
        _load(tmp_path, doc)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (_set("seeds", []), "seeds: must be a non-empty list of integers"),
        (_set("policies", "calibrated"), "policies: must be a non-empty list"),
        (_set("pool.decode", []), "pool.decode: must be a non-empty list of instance groups"),
        (_set("pool.decode.0.count", 0), "pool.decode[0].count: must be an integer >= 1, got 0"),
        (_set("jitter", -0.1), "jitter: must be >= 0.0, got -0.1"),
        (_set("pool.decode.0", "a40"), "pool.decode[0]: must be a mapping"),
    ],
)
def test_malformed_scenario_messages(tmp_path: Path, mutate: Mutation, message: str) -> None:
    """The wording SCENARIOS.md shows users (``pool.decode[1].count: must be an integer >= 1``)."""
    doc = copy.deepcopy(_base())
    mutate(doc)
    path = _write(tmp_path, doc)
    with pytest.raises(InputError) as info:
        load_scenario(path)
    assert str(info.value) == f"{path}: {message}"


def test_generate_errors(tmp_path: Path) -> None:
    doc = _base()
    doc["trace"] = {"generate": {"process": "hawkes"}}
    with pytest.raises(InputError) as info:
        _load(tmp_path, doc)
    assert info.value.field == "trace.generate.process"
    doc["trace"] = {"generate": {"classes": {"chat": 0}}}
    with pytest.raises(InputError) as info:
        _load(tmp_path, doc)
    assert info.value.field == "trace.generate.classes.chat"
    doc["trace"] = {"generate": {"n": 5, "lambda": 2}}
    with pytest.raises(InputError) as info:
        _load(tmp_path, doc)
    assert info.value.field == "trace.generate.lambda"


def test_bad_trace_file_names_trace_file(tmp_path: Path) -> None:
    path = _write(tmp_path, _base())
    (tmp_path / "trace.csv").write_text(
        "arrival_s,prompt_tokens,output_tokens\n0.0,100,10\n0.1,-5,10\n", encoding="utf-8"
    )
    with pytest.raises(InputError) as info:
        load_scenario(path)
    assert info.value.source == str(tmp_path / "trace.csv")
    assert info.value.field == "line 3: prompt_tokens"


def test_missing_trace_file(tmp_path: Path) -> None:
    doc = _base()
    doc["trace"]["file"] = "absent.csv"
    with pytest.raises(InputError) as info:
        _load(tmp_path, doc)
    assert info.value.source == str(tmp_path / "absent.csv")


def test_profile_file_error_is_reported_at_the_referring_field(tmp_path: Path) -> None:
    data = profile_to_dict(A40)
    del data["decode"]["d1"]
    (tmp_path / "broken.yaml").write_text(yaml.safe_dump(data), encoding="utf-8")
    doc = _base()
    doc["pool"]["decode"][1]["profile"] = "broken.yaml"
    with pytest.raises(InputError) as info:
        _load(tmp_path, doc)
    assert info.value.field == "pool.decode[1].profile"
    assert "decode.d1: missing" in info.value.message
    assert "broken.yaml" in info.value.message


@pytest.mark.parametrize(
    ("text", "field"),
    [("pool: [unclosed\n", "<file>"), ("- a\n- b\n", "<root>"), ("", "<root>")],
)
def test_unparseable_scenario(tmp_path: Path, text: str, field: str) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(InputError) as info:
        load_scenario(path)
    assert (info.value.source, info.value.field) == (str(path), field)


def test_missing_scenario_file(tmp_path: Path) -> None:
    with pytest.raises(InputError) as info:
        load_scenario(tmp_path / "nope.yaml")
    assert info.value.field == "<file>"


def test_onoff_generated_trace(tmp_path: Path) -> None:
    path = tmp_path / "onoff.yaml"
    path.write_text(
        "pool:\n  prefill: [{profile: a40-llama3-8b}]\n"
        "  decode: [{profile: a40-llama3-8b, count: 2}]\n"
        "slo_classes: [{name: chat, ttft_s: 2, tpot_s: 0.07}]\n"
        "trace: {generate: {process: onoff, rate: 3, n: 300, burst_factor: 6,"
        " on_s: 5, off_s: 20}}\n"
    )
    scenario = load_scenario(path)
    arrivals = [r.arrival_s for r in scenario.trace]
    assert len(arrivals) == 300 and arrivals == sorted(arrivals)
    bad = tmp_path / "bad.yaml"
    bad.write_text(path.read_text().replace("burst_factor: 6", "burst_factor: -1"))
    with pytest.raises(InputError) as err:
        load_scenario(bad)
    assert err.value.field == "trace.generate.burst_factor"


def test_router_block_sets_what_the_router_knows_and_its_switches(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    doc = {
        "pool": {"prefill": [{"count": 1, "profile": "a40-llama3-8b"}],
                 "decode": [{"count": 2, "profile": "a40-llama3-8b"}]},
        "slo_classes": [{"name": "chat", "ttft_s": 2.0, "tpot_s": 0.1}],
        "trace": {"generate": {"n": 20, "rate": 2.0}},
        "policies": ["length", "calibrated"],
        "router": {"scrape_interval_s": 0.5, "replicas": 2, "decode_binding": "late",
                   "pd_decider": True, "local_prefill_below": 64, "priority_scheduling": True},
    }  # fmt: skip
    path.write_text(yaml.safe_dump(doc))
    scen = load_scenario(path)
    specs = {s.policy: s for s in scen.specs()}
    assert specs["calibrated"].router.replicas == 2 and specs["calibrated"].router.late_binding
    assert specs["calibrated"].options.pd_decider
    assert not specs["length"].options.pd_decider  # no cost model to price it with
    assert specs["calibrated"].options.priority_scheduling
    assert not specs["length"].options.priority_scheduling
    assert specs["length"].options.local_prefill_below == 64
    doc["router"] = {"decode_binding": "sometimes"}
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(InputError, match=r"router\.decode_binding: must be arrival or late"):
        load_scenario(path)
    doc["router"] = {"replicas": 0}
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(InputError, match=r"router\.replicas"):
        load_scenario(path)


def test_router_shared_books_and_bus_delay(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    doc = {
        "pool": {"prefill": [{"count": 1, "profile": "a40-llama3-8b"}],
                 "decode": [{"count": 2, "profile": "a40-llama3-8b"}]},
        "slo_classes": [{"name": "chat", "ttft_s": 2.0, "tpot_s": 0.1}],
        "trace": {"generate": {"n": 20, "rate": 2.0}},
        "policies": ["calibrated"],
        "router": {"replicas": 4, "shared_books": True, "bus_delay_s": 0.005},
    }  # fmt: skip
    path.write_text(yaml.safe_dump(doc))
    router = load_scenario(path).specs()[0].router
    assert (router.shared_books, router.bus_delay_s) == (True, 0.005)
    for bad, field in (
        ({"shared_books": "yes"}, r"router\.shared_books: must be true or false"),
        ({"shared_books": True, "bus_delay_s": -1}, r"router\.bus_delay_s: must be >= 0"),
        ({"bus_delay_s": 0.01}, r"router\.bus_delay_s: needs router\.shared_books"),
    ):
        doc["router"] = bad
        path.write_text(yaml.safe_dump(doc))
        with pytest.raises(InputError, match=field):
            load_scenario(path)
