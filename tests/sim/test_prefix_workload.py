"""Tests of disaggpool.sim.prefix_workload (hand-worked block ids, popularity, session lengths),
its scenario form (`trace.generate.prefix`, `trace.embedded`) and the load generator's prompts
for block ids."""

from __future__ import annotations

import random
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml

from disaggpool.errors import InputError
from disaggpool.formats.traces import TraceRequest
from disaggpool.loadgen import block_prompt
from disaggpool.sim.prefix_workload import PrefixShape, prefix_sessions
from disaggpool.sim.scenario import load_scenario


def _messages(*lengths: tuple[int, int]) -> list[TraceRequest]:
    return [TraceRequest(0.0, p, o, "chat") for p, o in lengths]


def test_hand_worked_sessions() -> None:
    """Blocks of 4 tokens, one tenant with a 6-token system prompt (s), messages m, replies r.

    One session of three turns:
      turn 0: s6 + m3 = 9 tokens            -> [s0-3] [s4-5 m0-1] [m2]
      turn 1: + r2 + m1 = 12                -> [s0-3] [s4-5 m0-1] [m2 r0-1 m'0]
      turn 2: + r5 + m2 = 19                -> ... [r'0-3] [r'4 m''0-1]
    A second session of one turn: s6 + n2 = 8 -> [s0-3] [s4-5 n0-1]
    """
    shape = PrefixShape(tenants=1, system_tokens=6, turns_mean=1e9, think_s=0.0, block_tokens=4)
    out = prefix_sessions([0.0], _messages((3, 2), (1, 5), (2, 1)), shape, random.Random(1))
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in out] == [
        (0.0, 9, 2),
        (0.0, 12, 5),
        (0.0, 19, 1),
    ]
    a, b, c = (r.blocks for r in out)
    assert (len(a), len(b), len(c)) == (3, 3, 5)
    assert a[:2] == b[:2] == c[:2]  # each turn resends the conversation so far
    assert a[2] != b[2]  # a partial block is shared only by identical prompts
    assert c[2] == b[2]  # ... while a full one is shared by every longer prompt
    assert len(set(c)) == 5 and all(r.block_tokens == 4 and r.slo_class == "chat" for r in out)

    shape = PrefixShape(tenants=1, system_tokens=6, turns_mean=1.0, block_tokens=4)
    one, other = prefix_sessions([0.0, 10.0], _messages((3, 2), (2, 1)), shape, random.Random(1))
    assert (other.arrival_s, other.prompt_tokens) == (10.0, 8)
    assert other.blocks[0] == one.blocks[0]  # the tenant's system prompt
    assert other.blocks[1] != one.blocks[1]  # its last two tokens, then another message


def test_tenants_documents_and_turns() -> None:
    rng = random.Random(7)
    msgs = _messages(*[(100, 50)] * 6000)
    shape = PrefixShape(
        tenants=4, system_tokens=1024, tenant_skew=0.0, documents=10, document_tokens=1024,
        turns_mean=3.0, think_s=5.0, block_tokens=512,
    )  # fmt: skip
    starts = [float(i) for i in range(6000)]
    out = prefix_sessions(starts, msgs, shape, rng)
    assert len(out) == 6000
    assert all(len(r.blocks) == -(-r.prompt_tokens // 512) for r in out)
    assert [r.arrival_s for r in out] == sorted(r.arrival_s for r in out)
    # Uniform tenants: each first block (the system prompt) about a quarter of the requests.
    firsts = Counter(r.blocks[0] for r in out)
    assert len(firsts) == 4 and all(1200 < n < 1800 for n in firsts.values())
    # 10 documents, one per session, after the tenant's system prompt: the third block (the
    # document's first) names both, 4 x 10 values.
    assert len({r.blocks[2] for r in out}) == 40
    # Geometric turns with mean 3: the prompt of turn k holds k earlier message + reply pairs.
    turns = [(r.prompt_tokens - 2048 - 100) // 150 + 1 for r in out]
    sessions = turns.count(1)
    assert 6000 / sessions == pytest.approx(3.0, rel=0.08)


def test_skewed_popularity_favours_the_first_tenant() -> None:
    shape = PrefixShape(tenants=8, system_tokens=512, tenant_skew=1.2, turns_mean=1.0)
    out = prefix_sessions([0.0] * 4000, _messages(*[(10, 1)] * 4000), shape, random.Random(3))
    counts = sorted(Counter(r.blocks[0] for r in out).values(), reverse=True)
    # Zipf(1.2) over 8 ranks: the top tenant has 1 / sum(k^-1.2) = 0.429 of the sessions.
    assert counts[0] / 4000 == pytest.approx(1 / sum(k**-1.2 for k in range(1, 9)), abs=0.03)
    assert counts[0] > 3 * counts[-1]


@pytest.mark.parametrize(
    ("field", "value"),
    [("tenants", 0), ("turns_mean", 0.5), ("block_tokens", 0), ("think_s", -1.0)],
)
def test_bad_shapes(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=field):
        PrefixShape(**{field: value})


def _scenario(tmp_path: Path, trace: dict[str, Any]) -> Path:
    doc = {
        "pool": {
            "prefill": [{"count": 1, "profile": "a40-llama3-8b"}],
            "decode": [{"count": 1, "profile": "a40-llama3-8b"}],
        },
        "slo_classes": [{"name": "chat", "ttft_s": 2.0, "tpot_s": 0.1}],
        "trace": trace,
    }
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_scenario_generates_prefix_sessions(tmp_path: Path) -> None:
    gen = {
        "process": "poisson", "rate": 2.0, "n": 3000, "prompt_mean": 200, "output_mean": 100,
        "prefix": {"tenants": 3, "system_tokens": 800, "turns_mean": 4, "think_s": 2.0},
    }  # fmt: skip
    s = load_scenario(_scenario(tmp_path, {"generate": gen}))
    assert len(s.trace) == 3000
    assert len({r.blocks[0] for r in s.trace}) == 3
    # The process starts sessions at rate / turns_mean: requests arrive at about `rate`.
    span = s.trace[-1].arrival_s - s.trace[0].arrival_s
    assert 3000 / span == pytest.approx(2.0, rel=0.15)
    assert statistics.mean(r.prompt_tokens for r in s.trace) > 800 + 200


def test_scenario_reads_the_embedded_mooncake_trace(tmp_path: Path) -> None:
    s = load_scenario(
        _scenario(tmp_path, {"embedded": "mooncake-conversation", "limit": 50, "rate": 5.0})
    )
    assert len(s.trace) == 50 and all(r.blocks and r.block_tokens == 512 for r in s.trace)


@pytest.mark.parametrize(
    ("trace", "field"),
    [
        ({"embedded": "nope"}, "trace.embedded"),
        ({"embedded": "azure-conv", "generate": {}}, "trace"),
        ({"generate": {"prefix": {"tenants": 0}}}, "trace.generate.prefix"),
        ({"generate": {"prefix": {"tenant": 2}}}, "trace.generate.prefix.tenant"),
        ({"generate": {"prefix": {"tenants": 2.5}}}, "trace.generate.prefix.tenants"),
    ],
)
def test_scenario_errors_name_the_field(tmp_path: Path, trace: dict[str, Any], field: str) -> None:
    with pytest.raises(InputError) as err:
        load_scenario(_scenario(tmp_path, trace))
    assert f"{field}:" in str(err.value) or f"{field} " in str(err.value), str(err.value)


def test_block_prompts_share_exactly_the_shared_blocks() -> None:
    runs: dict[int, list[int]] = {}
    a = block_prompt(TraceRequest(0.0, 1100, 1, "", (4, 9, 11), 512), 500, runs)
    b = block_prompt(TraceRequest(0.0, 1030, 1, "", (4, 9, 12), 512), 500, runs)
    c = block_prompt(TraceRequest(0.0, 600, 1, "", (5, 9), 512), 500, {})
    assert (len(a), len(b), len(c)) == (1100, 1030, 600)
    assert a[:1024] == b[:1024] and a[1024:1030] != b[1024:1030]
    assert c[:512] != a[:512]  # another first block: nothing shared, whatever follows
    assert all(3 <= t < 500 for t in a + b + c)
    # The run of an id does not depend on what else was generated before it.
    assert block_prompt(TraceRequest(0.0, 512, 1, "", (9,), 512), 500, {}) == a[512:1024]


def test_prefix_rules_need_the_router_index(tmp_path: Path) -> None:
    path = _scenario(tmp_path, {"embedded": "mooncake-conversation", "limit": 30})
    doc = yaml.safe_load(path.read_text())
    doc["policies"] = ["cache_aware", "calibrated"]
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(InputError, match=r"router\.prefix_index: must be true for cache_aware"):
        load_scenario(path)
    doc["router"] = {"prefix_index": True}
    doc["pool"]["prefix_caching"] = True
    path.write_text(yaml.safe_dump(doc))
    s = load_scenario(path)
    assert s.router.prefix_index and s.prefix_caching
    assert all(spec.prefix_caching and spec.router.prefix_index for spec in s.specs())
