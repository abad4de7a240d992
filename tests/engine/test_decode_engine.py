"""The analytic decode engine against a naive one-step-at-a-time reference, plus its invariants."""

from __future__ import annotations

import dataclasses
import heapq
import random

import pytest

from disaggpool.core.hardware import builtin_profile
from disaggpool.engine.decode import DecodeEngine
from disaggpool.engine.request import EngineRequest

A40 = builtin_profile("a40-llama3-8b")


def drive(engine: DecodeEngine, arrivals: list[tuple[float, EngineRequest]]) -> list[EngineRequest]:
    """Feed requests at their times and wake the engine whenever it asks, like sim.cluster does."""
    done: list[EngineRequest] = []
    pending = sorted(arrivals, key=lambda a: a[0])
    i = 0
    while True:
        wake = engine.next_wakeup()
        if i < len(pending) and (wake is None or pending[i][0] < wake):
            t, req = pending[i]
            i += 1
            engine.enqueue(req, t)
            continue
        if wake is None:
            return done
        finished, _, _ = engine.advance(wake)
        done.extend(finished)


def reference(profile, arrivals):
    """Step by step: transfers start on arrival, join at the first boundary after they finish."""
    dm = profile.decode
    ready = []  # (time KV is here, index, request)
    for t, r in arrivals:
        heapq.heappush(ready, (t + profile.kv_transfer.time(r.prompt_tokens), r.index, r))
    running: list[list] = []  # [request, context, produced]
    now = 0.0
    out = {}
    while ready or running:
        if not running and ready and ready[0][0] > now:
            now = ready[0][0]
        while ready and ready[0][0] <= now + 1e-12:
            _, _, r = heapq.heappop(ready)
            running.append([r, r.prompt_tokens, 0])
        b = len(running)
        k = sum(c for _, c, _ in running)
        now += dm.step(b, k)
        for entry in running:
            entry[1] += 1
            entry[2] += 1
            if entry[2] == 1:
                out.setdefault(entry[0].index, [now, None])
            if entry[2] == entry[0].output_tokens:
                out[entry[0].index][1] = now
        running = [e for e in running if e[2] < e[0].output_tokens]
    return out


def workload(seed: int, n: int, rate: float) -> list[tuple[float, EngineRequest]]:
    rng = random.Random(seed)
    t = 0.0
    items = []
    for i in range(n):
        t += rng.expovariate(rate)
        items.append((t, EngineRequest(i, t, rng.randint(1, 3000), rng.randint(1, 300), "chat")))
    return items


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_analytic_stepping_matches_step_by_step_reference(seed: int) -> None:
    arrivals = workload(seed, 120, rate=4.0)
    expected = reference(A40, [(t, dataclasses.replace(r)) for t, r in arrivals])
    done = drive(DecodeEngine("d", A40), arrivals)
    assert len(done) == len(arrivals)
    for r in done:
        first, finish = expected[r.index]
        assert r.first_token == pytest.approx(first, rel=1e-9, abs=1e-9)
        assert r.finish == pytest.approx(finish, rel=1e-9, abs=1e-9)


def test_one_request_alone_takes_transfer_plus_steps() -> None:
    r = EngineRequest(0, 0.0, 1000, 10, "chat")
    drive(DecodeEngine("d", A40), [(0.0, r)])
    xfer = A40.kv_transfer.time(1000)
    steps = [A40.decode.step(1, 1000 + i) for i in range(10)]
    assert r.first_token == pytest.approx(xfer + steps[0])
    assert r.finish == pytest.approx(xfer + sum(steps))
    assert r.tpot == pytest.approx(sum(steps[1:]) / 9)


def test_max_num_seqs_bounds_the_batch() -> None:
    profile = dataclasses.replace(A40, max_num_seqs=4)
    engine = DecodeEngine("d", profile)
    arrivals = [(0.0, EngineRequest(i, 0.0, 100, 50, "chat")) for i in range(10)]
    peak = 0
    pending = list(arrivals)
    for t, r in pending:
        engine.enqueue(r, t)
    while (wake := engine.next_wakeup()) is not None:
        engine.advance(wake)
        peak = max(peak, engine.num_running)
    assert peak == 4
    assert all(r.finish > 0 for _, r in arrivals)
    # the fifth request could only start once one of the first four finished
    assert min(r.first_token for _, r in arrivals[4:]) > min(r.finish for _, r in arrivals[:4])


def test_kv_pressure_preempts_recomputes_and_never_overflows() -> None:
    profile = dataclasses.replace(A40, kv_capacity_tokens=6000)
    engine = DecodeEngine("d", profile)
    rng = random.Random(5)
    arrivals = [
        (
            0.01 * i,
            EngineRequest(i, 0.01 * i, rng.randint(200, 1500), rng.randint(200, 900), "chat"),
        )
        for i in range(40)
    ]
    for t, r in arrivals:
        engine.enqueue(r, t)
    finished = []
    while (wake := engine.next_wakeup()) is not None:
        done, _, _ = engine.advance(wake)
        finished += done
        assert engine.kv_tokens_used(wake) <= profile.kv_capacity_tokens
    assert len(finished) == 40
    assert engine.preemptions > 0
    assert sum(r.preemptions for _, r in arrivals) == engine.preemptions
    for _, r in arrivals:
        assert r.arrival <= r.first_token <= r.finish


def test_prompt_larger_than_kv_cache_is_rejected_not_stuck() -> None:
    profile = dataclasses.replace(A40, kv_capacity_tokens=500)
    engine = DecodeEngine("d", profile)
    big = EngineRequest(0, 0.0, 800, 5, "chat")
    small = EngineRequest(1, 0.0, 100, 5, "chat")
    done = drive(engine, [(0.0, big), (0.0, small)])
    assert engine.rejected == [big]
    assert done == [small]


@pytest.mark.parametrize("t0", [2.0**14, 2.0**20, 1e9])
def test_a_large_clock_still_progresses(t0: float) -> None:
    """The emulator runs engines on the host's monotonic clock (its uptime): far from zero, a
    fixed 1e-12 s slack rounded away and the engine asked to be woken at a time it then did not
    act on, forever. The same workload must finish, step for step, wherever the clock starts."""
    base = workload(3, 40, rate=4.0)
    expected = {r.index: r.finish for r in drive(DecodeEngine("d", A40), base)}
    shifted = [
        (t + t0, dataclasses.replace(r, arrival=r.arrival + t0))
        for t, r in workload(3, 40, rate=4.0)
    ]
    engine = DecodeEngine("d", A40)
    pending = sorted(shifted, key=lambda a: a[0])
    done, i, wakes = [], 0, 0
    while True:
        wake = engine.next_wakeup()
        if i < len(pending) and (wake is None or pending[i][0] < wake):
            engine.enqueue(pending[i][1], pending[i][0])
            i += 1
            continue
        if wake is None:
            break
        wakes += 1
        assert wakes < 100_000, "the engine stopped making progress"
        done.extend(engine.advance(wake)[0])
    assert len(done) == len(base)
    for r in done:
        assert r.finish - t0 == pytest.approx(expected[r.index], abs=1e-6 + t0 * 1e-14)
