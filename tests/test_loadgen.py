"""Tests of `disaggpool.loadgen`: every request accounted for, lengths honoured, goodput judged,
and the per-request rows a user bootstraps an interval from (`met`, the pods that served it).

Against an emulated vLLM (a real OpenAI endpoint) and a stub endpoint whose refusals, timing and
pod headers the test sets.
"""

from __future__ import annotations

import asyncio
import json
import statistics
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web

from disaggpool.cli import main
from disaggpool.core.contracts import SLOClass
from disaggpool.core.hardware import builtin_profile
from disaggpool.emulator.config import EmulatorConfig
from disaggpool.emulator.harness import EmulatorThread
from disaggpool.formats.traces import TraceRequest, write_trace
from disaggpool.loadgen import replay
from disaggpool.loopthread import LoopThread
from disaggpool.pdwire import DECODE_POD_HEADER, PREFILL_POD_HEADER

TRACE = [TraceRequest(0.05 * i, 20 + 10 * i, 3 + i % 5) for i in range(12)]
SLOW_GAP_S = 0.06  # the stub's decode pod "d1" streams a token every this long; "d0" at once


class Stub:
    """An OpenAI streaming endpoint: the n-th request (from 0) is refused with a 429 when
    `refuse(n)`; the others stream `max_tokens` tokens from decode pod d{n % 2}, named in the
    response headers (prefill pod p0), d1 slowly. It records the `X-SLO-Class` headers."""

    def __init__(self, refuse: bool = False) -> None:
        self.refuse = refuse
        self.count = 0
        self.classes: list[str] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> Stub:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        return self

    async def close(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def _models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "stub"}]})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        n, self.count = self.count, self.count + 1
        self.classes.append(request.headers.get("X-SLO-Class", ""))
        body = await request.json()
        if self.refuse and n % 2:
            return web.json_response({"error": {"message": "busy"}}, status=429)
        decode = f"d{n % 2}" if not self.refuse else "d0"
        headers = {PREFILL_POD_HEADER: "p0", DECODE_POD_HEADER: decode}
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", **headers})
        await resp.prepare(request)
        tokens = int(body["max_tokens"])
        for _ in range(tokens):
            if decode == "d1":
                await asyncio.sleep(SLOW_GAP_S)
            await resp.write(b'data: {"choices": [{"index": 0, "text": " w"}]}\n\n')
        usage = {"choices": [], "usage": {"completion_tokens": tokens}}
        await resp.write(f"data: {json.dumps(usage)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp


@pytest.fixture
def stub() -> Iterator[Stub]:
    thread = LoopThread(Stub().start, name="stub").start()
    yield thread.service
    thread.stop()


@pytest.fixture
def refusing_stub() -> Iterator[Stub]:
    thread = LoopThread(Stub(refuse=True).start, name="stub").start()
    yield thread.service
    thread.stop()


@pytest.fixture
def emulator() -> Iterator[EmulatorThread]:
    config = EmulatorConfig(
        builtin_profile("a40-llama3-8b"),
        port=0,
        side_channel_port=0,
        side_channel_host="127.0.0.1",
        jitter=0.0,
    )
    with EmulatorThread(config) as emu:
        yield emu


def test_replay_against_an_emulated_vllm(emulator: EmulatorThread) -> None:
    slo = SLOClass("interactive", 5.0, 0.5)
    report = asyncio.run(replay(emulator.url, TRACE, [slo]))
    summary = report.summary()
    assert summary["requests"] == summary["completed"] == 12 and summary["errors"] == 0
    assert [r.output_tokens for r in report.results] == [t.output_tokens for t in TRACE]
    # Generous targets on an idle pod: nearly all met (a stalled machine may miss one or two).
    assert summary["goodput"] >= 0.75
    assert 0 < summary["ttft_p50_s"] <= summary["ttft_p99_s"] < 5.0
    # vLLM names no pods: the rows say so with empty names, not made-up ones.
    assert {(r.prefill_pod, r.decode_pod) for r in report.results} == {("", "")}
    # An impossible target: the same run scores zero, so goodput really is judged.
    strict = asyncio.run(replay(emulator.url, TRACE, [SLOClass("interactive", 1e-6, 1e-6)]))
    assert strict.summary()["goodput"] == 0.0
    assert not any(row["met"] for row in strict.rows())


def test_refusals_count_as_errors(refusing_stub: Stub) -> None:
    burst = [TraceRequest(0.0, 10, 3) for _ in range(6)]
    report = asyncio.run(replay(refusing_stub.url, burst, [SLOClass("interactive", 5, 1)]))
    summary = report.summary()
    assert summary["requests"] == 6
    assert summary["errors_by_status"] == {"429": 3}
    assert summary["goodput"] == pytest.approx(0.5)
    assert [row["met"] for row in report.rows()].count(True) == 3  # a refusal never meets its SLO


def test_cli_writes_every_request_with_its_verdict_and_pods(
    stub: Stub, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The rows carry what a user needs to bootstrap goodput or split it by pod: `met`, scored
    as the summary scores it, and the pods the server named in its response headers."""
    trace = tmp_path / "t.csv"
    write_trace(trace, TRACE[:8])
    out = tmp_path / "out.json"
    tpot = SLOW_GAP_S / 2  # d0 streams at once and meets it; d1 misses it
    code = main(["loadgen", "--target", stub.url, "--trace", str(trace), "--rate-scale", "4",
                 "--slo", f"interactive:5:{tpot}", "--json", str(out)])  # fmt: skip
    assert code == 0
    data = json.loads(out.read_text())
    rows = data["requests"]
    assert data["summary"]["requests"] == len(rows) == 8
    assert {row["prefill_pod"] for row in rows} == {"p0"}
    assert {row["decode_pod"] for row in rows} == {"d0", "d1"}
    assert all(row["met"] == (row["decode_pod"] == "d0") for row in rows), rows
    assert statistics.fmean(row["met"] for row in rows) == data["summary"]["goodput"]
    assert set(stub.classes) == {"interactive"}  # --slo given: the class goes with each request
    assert "goodput" in capsys.readouterr().out
    assert main(["loadgen", "--target", stub.url, "--trace", str(trace), "--slo", "bad"]) == 2


def test_several_targets_take_every_nth_request(tmp_path: Path) -> None:
    """`--target` twice: request i goes to the (i mod 2)-th, each row names its target, and the
    report still counts every request once."""
    a = LoopThread(Stub().start, name="stub-a").start()
    b = LoopThread(Stub().start, name="stub-b").start()
    try:
        trace = tmp_path / "t.csv"
        write_trace(trace, TRACE[:7])
        out = tmp_path / "out.json"
        urls = [a.service.url, b.service.url]
        code = main(["loadgen", "--target", urls[0], "--target", urls[1] + "/",
                     "--trace", str(trace), "--rate-scale", "4", "--json", str(out)])  # fmt: skip
        assert code == 0
        data = json.loads(out.read_text())
        assert [row["index"] for row in data["requests"]] == list(range(7))
        assert [row["target"] for row in data["requests"]] == [urls[i % 2] for i in range(7)]
        assert (a.service.count, b.service.count) == (4, 3)
        assert data["summary"]["completed"] == 7
    finally:
        a.stop()
        b.stop()
