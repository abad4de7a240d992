"""Tests of disaggpool.studies.paper_traces: the paper's mixed traces and synthetic sweep traces."""

from __future__ import annotations

import statistics

import pytest

from disaggpool.formats.embedded import azure_services
from disaggpool.formats.traces import TraceRequest
from disaggpool.sim import workload
from disaggpool.studies.paper_config import PaperConfig
from disaggpool.studies.paper_traces import TRACE_CVS, mixed_trace, synthetic_trace

CFG = PaperConfig.quick()


@pytest.fixture(scope="module")
def services() -> dict[str, list[TraceRequest]]:
    return azure_services()


@pytest.mark.parametrize("k", [0, 1, 2])
def test_mixed_trace_takes_both_services_in_its_window(
    services: dict[str, list[TraceRequest]], k: int
) -> None:
    trace, history = mixed_trace(services, k, CFG)
    start, length = 20.0 * 60.0 * k, CFG.window_minutes * 60.0
    in_window = {
        c: sum(1 for r in reqs if start <= r.arrival_s < start + length)
        for c, reqs in services.items()
    }
    assert {c: sum(1 for r in trace if r.slo_class == c) for c in services} == in_window
    assert all(
        r.prompt_tokens <= CFG.max_prompt and r.output_tokens <= CFG.max_output for r in trace
    )
    stats = workload.trace_stats(trace)
    # Gamma arrivals at rate 1 with trace k's CV (sample estimates on a few hundred gaps).
    assert stats["rate"] == pytest.approx(1.0, rel=0.25)
    assert stats["interarrival_cv"] == pytest.approx(TRACE_CVS[k], rel=0.35)
    assert len(history) == CFG.history
    assert {r.slo_class for r in history} == {"chat", "code"}


def test_mixed_trace_is_deterministic(services: dict[str, list[TraceRequest]]) -> None:
    assert mixed_trace(services, 1, CFG) == mixed_trace(services, 1, CFG)
    assert mixed_trace(services, 1, CFG)[0] != mixed_trace(services, 2, CFG)[0]


@pytest.mark.parametrize("sigma", [0.0, 1.0])
def test_synthetic_trace_keeps_arrivals_and_means(
    services: dict[str, list[TraceRequest]], sigma: float
) -> None:
    base, _ = mixed_trace(services, 0, CFG)
    trace, history = synthetic_trace(base, sigma, CFG, seed=1)
    n = min(len(base), CFG.sweep_requests)
    assert [r.arrival_s for r in trace] == [r.arrival_s for r in base[:n]]
    assert len(history) == CFG.history
    classes = {r.slo_class for r in trace}
    assert classes == ({"chat"} if sigma == 0 else {"chat", "code"})
    base_mean = statistics.fmean(r.output_tokens for r in base)
    if sigma == 0:
        assert len({(r.prompt_tokens, r.output_tokens) for r in trace}) == 1
    else:
        # Log-normal around the base mean (clipping to max_output only lowers it).
        assert statistics.fmean(r.output_tokens for r in trace) == pytest.approx(base_mean, rel=0.3)
