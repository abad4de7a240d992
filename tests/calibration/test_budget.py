"""The probe's time budget (`stages.Budget`, `stages.Stop`): a stage stops at its share once it
has its samples, runs on when short of them, and never past the hard stop, even in the middle of
a slow grid point; then the whole probe, against a pod slow enough that one point outlasts the
budget, ends within the documented 1.25x."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from disaggpool.calibration.probe import ProbeConfig, ProbeError, run_probe
from disaggpool.calibration.stages import FIT_RESERVE_S, HARD_STOP, Budget, Stop
from disaggpool.core.hardware import builtin_profile
from disaggpool.core.profile import DecodeModel, PrefillModel
from disaggpool.emulator.config import EmulatorConfig
from disaggpool.emulator.harness import EmulatorThread

A40 = builtin_profile("a40-llama3-8b")


def test_a_stage_stops_at_its_share_with_its_samples_and_at_the_hard_stop_without() -> None:
    now = time.perf_counter()
    budget = Budget(now - 8.0, 8.0)  # 8 s into an 8 s budget: past its share, before the cap
    assert budget.hard == pytest.approx(budget.start + HARD_STOP * 8.0 - FIT_RESERVE_S)
    stop = budget.stop(0.95, need=6)
    assert stop.due(6) and not stop.due(5)  # past its share: done once it has its samples
    assert Budget(now - 9.1, 8.0).stop(0.95, 6).due(0)  # past the hard stop: done regardless
    # A tiny budget keeps at least itself: the fits' reserve comes out of the run-on only.
    assert Budget(now, 1.0).hard == now + 1.0


def test_a_point_in_flight_is_cut_at_the_soft_stop_with_enough_samples_else_at_the_hard() -> None:
    async def slow_point() -> None:
        await asyncio.sleep(30)  # a batch of 64 streams on a slow pod, say

    async def cut(have: int) -> tuple[bool, float]:
        now = time.perf_counter()
        stop = Stop(soft=now + 0.2, hard=now + 1.0, need=2)
        finished = await stop.within(slow_point(), have)
        return finished, time.perf_counter() - now

    finished, took = asyncio.run(cut(have=2))  # enough: the stage's share is its end
    assert not finished and 0.15 < took < 0.9
    finished, took = asyncio.run(cut(have=1))  # short of samples: it runs on to the hard stop
    assert not finished and 0.95 < took < 3.0

    async def quick_point() -> None:
        await asyncio.sleep(0)

    async def done() -> bool:
        return await Stop(time.perf_counter() + 5, time.perf_counter() + 5, 1).within(
            quick_point(), 0
        )

    assert asyncio.run(done())


def test_a_requests_own_timeout_is_still_an_error() -> None:
    """Only the hard stop is a normal end: a request that times out on its own (the client's
    `request_timeout_s`) says the pod is not answering, and fails the probe."""

    async def timed_out() -> None:
        raise TimeoutError("the request's own timeout")

    async def run() -> bool:
        return await Stop(0.0, time.perf_counter() + 30, 1).within(timed_out(), 0)

    with pytest.raises(TimeoutError, match="own timeout"):
        asyncio.run(run())


def test_the_probe_ends_within_its_cap_when_one_point_outlasts_the_budget() -> None:
    """Quick prefills, and a decode step of 0.4 s: the decode stage's first point (24 tokens)
    takes about 10 s, five times the 2 s budget. The probe stops at the cap all the same (too
    few decode samples, so it says it cannot fit: exit 4 for the command) rather than wait the
    point out."""
    slow = dataclasses.replace(
        A40,
        name="slow-steps",
        prefill=PrefillModel(0.005, 1e-6, 0.0),
        decode=DecodeModel(0.4, 0.0, 0.0),
    )
    cfg = EmulatorConfig(slow, port=0, side_channel_port=0, jitter=0.0)
    budget = 2.0
    with EmulatorThread(cfg) as pod:
        t0 = time.perf_counter()
        with pytest.raises(ProbeError, match="to fit d0"):  # the decode fit, not the prefill
            run_probe(ProbeConfig(endpoint=pod.url, budget_s=budget, seed=0))
        took = time.perf_counter() - t0
    assert took <= HARD_STOP * budget + 0.5, took  # 0.5 s: the fits and a loaded machine
