"""The load generator against real endpoints: every request accounted for, lengths honoured."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from sidecar_testkit import A40

from disaggpool.cli import main
from disaggpool.core.contracts import SLOClass
from disaggpool.formats.traces import TraceRequest, write_trace
from disaggpool.loadgen import replay

TRACE = [TraceRequest(0.05 * i, 20 + 10 * i, 3 + i % 5) for i in range(12)]


def test_replay_through_the_front_door(start_pool, start_sidecar) -> None:
    pool = start_pool([A40], [A40, A40])
    sc = start_sidecar(pool)
    slo = SLOClass("interactive", 5.0, 0.5)
    report = asyncio.run(replay(sc.url, TRACE, [slo]))
    summary = report.summary()
    assert summary["requests"] == summary["completed"] == 12 and summary["errors"] == 0
    assert [r.output_tokens for r in report.results] == [t.output_tokens for t in TRACE]
    # Generous targets on an idle pool: nearly all met (a stalled machine may miss one or two).
    assert summary["goodput"] >= 0.75
    assert 0 < summary["ttft_p50_s"] <= summary["ttft_p99_s"] < 5.0
    # An impossible target: the same run scores zero, so goodput really is judged.
    strict = asyncio.run(replay(sc.url, TRACE, [SLOClass("interactive", 1e-6, 1e-6)]))
    assert strict.summary()["goodput"] == 0.0


def test_refusals_count_as_errors(start_pool, start_sidecar) -> None:
    pool = start_pool([A40], [A40.scaled(0.2)])
    sc = start_sidecar(pool, max_inflight=1)
    burst = [TraceRequest(0.0, 10, 30) for _ in range(5)]
    summary = asyncio.run(replay(sc.url, burst, [SLOClass("interactive", 5, 1)])).summary()
    assert summary["requests"] == 5
    assert summary["errors_by_status"] == {"429": 4}
    assert summary["goodput"] == pytest.approx(0.2)


def test_cli_writes_json(start_pool, start_sidecar, tmp_path: Path, capsys) -> None:
    pool = start_pool([A40], [A40])
    sc = start_sidecar(pool)
    trace = tmp_path / "t.csv"
    write_trace(trace, TRACE[:4])
    out = tmp_path / "out.json"
    code = main(["loadgen", "--target", sc.url, "--trace", str(trace), "--rate-scale", "4",
                 "--slo", "interactive:5:0.5", "--json", str(out)])  # fmt: skip
    assert code == 0
    data = json.loads(out.read_text())
    assert data["summary"]["requests"] == 4 and len(data["requests"]) == 4
    assert "goodput" in capsys.readouterr().out
    assert main(["loadgen", "--target", sc.url, "--trace", str(trace), "--slo", "bad"]) == 2
