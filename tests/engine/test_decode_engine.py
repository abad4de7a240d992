"""The analytic decode engine against a naive one-step-at-a-time reference, plus its invariants.

The reference also knows aborts (a request aborted at time a never joins if a comes first,
else it leaves at the first step boundary after a) and records every token's time, so that the
engine's live-server operations (`abort`, `produced`, `next_boundary`, `jitter_per_step`) are
checked against it too.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import random
import statistics

import pytest

from disaggpool.core.hardware import builtin_profile
from disaggpool.core.profile import DecodeModel
from disaggpool.engine.decode import DecodeEngine
from disaggpool.engine.request import EngineRequest

A40 = builtin_profile("a40-llama3-8b")

Arrivals = list[tuple[float, EngineRequest]]


def drive(
    engine: DecodeEngine,
    arrivals: Arrivals,
    aborts: dict[int, float] | None = None,
    *,
    every_boundary: bool = False,
    on_advance: object = None,
) -> list[EngineRequest]:
    """Feed requests (and aborts) at their times and wake the engine whenever it asks, like
    sim.cluster does; `every_boundary` also wakes it at every step boundary, like the emulator's
    driver, and `on_advance(t)` is called after each wake-up."""
    done: list[EngineRequest] = []
    by_index = {r.index: r for _, r in arrivals}
    events = [(t, 0, r.index) for t, r in arrivals]
    events += [(t, 1, i) for i, t in (aborts or {}).items()]
    events.sort()
    i = 0
    while True:
        wake = engine.next_wakeup()
        if every_boundary:
            boundary = engine.next_boundary()
            if boundary is not None and (wake is None or boundary < wake):
                wake = boundary
        if i < len(events) and (wake is None or events[i][0] < wake):
            t, kind, index = events[i]
            i += 1
            if kind == 0:
                engine.enqueue(by_index[index], t)
            else:
                engine.abort(by_index[index], t)
            continue
        if wake is None:
            return done
        finished, _, _ = engine.advance(wake)
        done.extend(finished)
        if callable(on_advance):
            on_advance(wake)


@dataclasses.dataclass
class Expected:
    """The reference's account of one request (first and finish stay None if it never gets
    there: aborted before joining, or before its last token)."""

    first: float | None = None
    finish: float | None = None
    tokens: list[float] = dataclasses.field(default_factory=list)  # time of each token


def reference(
    profile, arrivals: Arrivals, aborts: dict[int, float] | None = None
) -> dict[int, Expected]:
    """Step by step: transfers start on arrival, join at the first boundary after they finish;
    an aborted request never joins if its abort comes first, else it leaves at the first
    boundary after its abort (the step ending there was its last)."""
    dm = profile.decode
    aborted = aborts or {}
    ready = []  # (time KV is here, index, request)
    for t, r in arrivals:
        heapq.heappush(ready, (t + profile.kv_transfer.time(r.prompt_tokens), r.index, r))
    running: list[list] = []  # [request, context, produced]
    now = 0.0
    out = {r.index: Expected() for _, r in arrivals}
    while ready or running:
        if not running and ready and ready[0][0] > now:
            now = ready[0][0]
        while ready and ready[0][0] <= now + 1e-12:
            _, _, r = heapq.heappop(ready)
            if aborted.get(r.index, math.inf) > now:
                running.append([r, r.prompt_tokens, 0])
        if not running:
            continue
        b = len(running)
        k = sum(c for _, c, _ in running)
        now += dm.step(b, k)
        for entry in running:
            entry[1] += 1
            entry[2] += 1
            exp = out[entry[0].index]
            exp.tokens.append(now)
            if aborted.get(entry[0].index, math.inf) < now:
                entry[2] = entry[0].output_tokens  # leaves here, unfinished
                continue
            if entry[2] == 1:
                exp.first = now
            if entry[2] == entry[0].output_tokens:
                exp.finish = now
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


@pytest.mark.parametrize("per_step", [False, True])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_analytic_stepping_matches_step_by_step_reference(seed: int, per_step: bool) -> None:
    """Also with `jitter_per_step` (waking at every boundary) and no jitter: same times."""
    arrivals = workload(seed, 120, rate=4.0)
    expected = reference(A40, [(t, dataclasses.replace(r)) for t, r in arrivals])
    done = drive(DecodeEngine("d", A40, jitter_per_step=per_step), arrivals)
    assert len(done) == len(arrivals)
    for r in done:
        exp = expected[r.index]
        assert r.first_token == pytest.approx(exp.first, rel=1e-9, abs=1e-9)
        assert r.finish == pytest.approx(exp.finish, rel=1e-9, abs=1e-9)


def _abort_times(seed: int, arrivals: Arrivals) -> dict[int, float]:
    """A third of the requests aborted: some while their KV transfers, the others at times
    spread from their arrival to past their end (running, or finished already: a no-op)."""
    rng = random.Random(seed * 7919)
    out = {}
    for t, r in arrivals:
        if rng.random() < 1 / 3:
            xfer = A40.kv_transfer.time(r.prompt_tokens)
            late = rng.random() < 0.75
            out[r.index] = t + rng.uniform(0.0, 0.06 * r.output_tokens + 0.3 if late else xfer)
    return out


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_aborts_match_a_reference_that_drops_them_from_then_on(seed: int) -> None:
    arrivals = workload(seed, 120, rate=4.0)
    aborts = _abort_times(seed, arrivals)
    expected = reference(A40, [(t, dataclasses.replace(r)) for t, r in arrivals], aborts)
    engine = DecodeEngine("d", A40)
    done = drive(engine, arrivals, aborts)
    finished = {r.index for r in done}
    assert finished == {i for i, exp in expected.items() if exp.finish is not None}
    # Every state is exercised: aborted before joining, while running, after the end (a no-op).
    assert any(not expected[i].tokens for i in aborts)
    assert any(expected[i].tokens and expected[i].finish is None for i in aborts)
    assert any(i in aborts for i in finished)
    for r in done:
        exp = expected[r.index]
        assert r.first_token == pytest.approx(exp.first, rel=1e-9, abs=1e-9)
        assert r.finish == pytest.approx(exp.finish, rel=1e-9, abs=1e-9)
    for _, r in arrivals:  # an aborted request is never reported, whatever it had produced
        if r.index not in finished:
            assert r.finish < 0
    assert engine.idle and engine.kv_tokens_used(1e6) == 0 and engine.next_wakeup() is None


@pytest.mark.parametrize("seed", [1, 2])
def test_produced_and_next_boundary_follow_the_reference_token_by_token(seed: int) -> None:
    """Woken at every boundary (as the emulator streams tokens), the engine tells how many
    tokens each running request has produced, exactly as the reference steps them, and waking
    there changes no result."""
    arrivals = workload(seed, 60, rate=4.0)
    aborts = _abort_times(seed, arrivals)
    expected = reference(A40, [(t, dataclasses.replace(r)) for t, r in arrivals], aborts)
    engine = DecodeEngine("d", A40)
    checked = 0

    def check(t: float) -> None:
        nonlocal checked
        for req in engine.running.values():
            assert engine.is_running(req)
            tokens = expected[req.index].tokens
            assert engine.produced(req) == sum(1 for x in tokens if x <= t + 1e-9)
            checked += 1
        boundary = engine.next_boundary()
        assert (boundary is None) == (engine.num_running == 0)
        if boundary is not None:
            assert boundary > t

    done = drive(engine, arrivals, aborts, every_boundary=True, on_advance=check)
    assert checked > 1000
    for r in done:
        assert r.finish == pytest.approx(expected[r.index].finish, rel=1e-9, abs=1e-9)
    assert {r.index for r in done} == {i for i, e in expected.items() if e.finish is not None}


def test_abort_in_every_state_gives_everything_back() -> None:
    profile = dataclasses.replace(A40, max_num_seqs=2)
    eng = DecodeEngine("d", profile)
    reqs = [EngineRequest(i, 0.0, 100, 50, "x") for i in range(4)]
    for r in reqs:
        eng.enqueue(r, 0.0)
    assert len(eng.waiting) == 2  # two slots: two transfers, two waiting
    assert eng.abort(reqs[3], 0.0) == (True, [])  # waiting
    removed, started = eng.abort(reqs[0], 0.0)  # transferring: frees a slot for reqs[2]
    assert removed and started == [reqs[2]]
    t = eng.next_wakeup()
    assert t is not None
    eng.advance(t)  # both transfers are done: they join at once (the batch was empty)
    assert eng.is_running(reqs[1]) and eng.is_running(reqs[2])
    assert eng.abort(reqs[1], t) == (False, [])  # running: it must leave at a boundary
    assert eng.is_running(reqs[1])
    b = eng.next_boundary()
    assert b is not None and eng.next_wakeup() == b  # the engine wakes there to drop it
    finished, _, _ = eng.advance(b)
    assert finished == [] and not eng.is_running(reqs[1]) and eng.num_running == 1
    assert eng.produced(reqs[2]) == 1
    assert eng.abort(reqs[2], b + 1e-3) == (False, [])
    b2 = eng.next_wakeup()
    assert b2 is not None and b2 == eng.next_boundary()
    assert eng.advance(b2)[0] == []
    assert eng.idle and eng.num_waiting == 0 and eng.num_running == 0
    assert eng.kv_tokens_used(b2 + 1.0) == 0 and eng.next_wakeup() is None
    assert all(r.finish < 0 for r in reqs)
    assert eng.abort(reqs[2], b2) == (True, [])  # gone already: a no-op


def test_a_late_abort_leaves_at_the_first_boundary_after_it() -> None:
    """Aborted long after the engine last woke (nothing happened in between), a sequence still
    runs every step up to its abort, and leaves at the next boundary, not an earlier one."""
    eng = DecodeEngine("d", A40)
    keep, leave = EngineRequest(0, 0.0, 500, 400, "x"), EngineRequest(1, 0.0, 500, 400, "x")
    drive_until = eng.enqueue(keep, 0.0) + eng.enqueue(leave, 0.0)
    assert drive_until == [keep, leave]
    t = eng.next_wakeup()
    assert t is not None
    eng.advance(t)  # both join; the next wake-up is far away (their finish)
    step0 = eng.step
    boundaries = list(
        itertools.accumulate((A40.decode.step(2, 1000 + 2 * i) for i in range(40)), initial=t)
    )
    t_abort = (boundaries[30] + boundaries[31]) / 2  # during the 31st step
    eng.abort(leave, t_abort)
    wake = eng.next_wakeup()
    assert wake == pytest.approx(boundaries[31])
    eng.advance(wake)
    assert eng.step == step0 + 31 and not eng.is_running(leave)
    assert eng.produced(keep) == 31 and eng.num_running == 1


def test_prefill_end_of_prompts_computed_here() -> None:
    """A request whose prompt is computed here (recompute) joins at a boundary; the prefill part
    of that step ends at `prefill_end`, the step's decode part follows."""
    eng = DecodeEngine("d", A40)
    a = EngineRequest(0, 0.0, 1000, 20, "x", recompute=True)
    assert eng.enqueue(a, 0.0) == []  # no transfer: the prompt is computed here
    t = eng.next_wakeup()
    assert t == 0.0
    eng.advance(t)
    assert eng.is_running(a)
    assert eng.prefill_end() == pytest.approx(A40.prefill.prompt_time(1000))
    assert a.first_token == pytest.approx(eng.prefill_end() + A40.decode.step(1, 1000))
    b_time = eng.next_boundary()
    assert b_time == pytest.approx(a.first_token)
    # A second one arrives mid-step: it joins at the next boundary, whose step carries its prefill.
    b = EngineRequest(1, 0.01, 600, 20, "x", recompute=True)
    eng.enqueue(b, 0.01)
    wake = eng.next_wakeup()
    assert wake == pytest.approx(b_time)
    eng.advance(wake)
    assert eng.is_running(b) and eng.produced(a) == 1
    assert eng.prefill_end() == pytest.approx(wake + A40.prefill.prompt_time(600))
    assert eng.next_boundary() == pytest.approx(eng.prefill_end() + A40.decode.step(2, 1001 + 600))


def test_prompts_computed_here_share_the_step_token_budget() -> None:
    """vLLM spends at most `max_num_batched_tokens` per step: three 1,500-token prompts waiting
    together are prefilled one per step (each next one decoding beside the earlier ones), two
    of 900 in the same step."""
    assert A40.max_num_batched_tokens == 2048
    eng = DecodeEngine("d", A40)
    a, b, c = (EngineRequest(i, 0.0, 1500, 20, "x") for i in range(3))
    for r in (a, b, c):
        eng.enqueue(r, 0.0, prefill_here=True)
    eng.advance(eng.next_wakeup())
    assert eng.is_running(a) and not eng.is_running(b) and eng.num_waiting == 2
    prompt = A40.prefill.prompt_time(1500)
    assert a.first_token == pytest.approx(prompt + A40.decode.step(1, 1500))
    eng.advance(eng.next_wakeup())
    assert eng.is_running(b) and not eng.is_running(c) and eng.produced(a) == 1
    assert b.first_token == pytest.approx(a.first_token + prompt + A40.decode.step(2, 3001))
    eng.advance(eng.next_wakeup())
    assert eng.is_running(c) and eng.produced(a) == 2 and eng.produced(b) == 1
    assert c.first_token == pytest.approx(b.first_token + prompt + A40.decode.step(3, 4503))

    eng = DecodeEngine("d", A40)
    d, e = (EngineRequest(i, 0.0, 900, 20, "x") for i in range(2))
    for r in (d, e):
        eng.enqueue(r, 0.0, prefill_here=True)
    eng.advance(eng.next_wakeup())
    assert eng.is_running(d) and eng.is_running(e)
    both = 2 * A40.prefill.prompt_time(900)
    assert d.first_token == pytest.approx(both + A40.decode.step(2, 1800))


def _lone_step_gaps(*, jitter: float, per_step: bool, tokens: int = 200) -> list[float]:
    flat = dataclasses.replace(A40, decode=DecodeModel(0.02, 0.0, 0.0))
    eng = DecodeEngine("d", flat, jitter=jitter, rng=random.Random(11), jitter_per_step=per_step)
    req = EngineRequest(0, 0.0, 100, tokens, "x")
    times: list[float] = []
    drive(eng, [(0.0, req)], every_boundary=True, on_advance=times.append)
    boundaries = [t for t in times if t > req.first_token - 1e-12]
    assert boundaries[-1] == pytest.approx(req.finish)
    return [b - a for a, b in itertools.pairwise(boundaries)]


def test_jitter_per_step_redraws_at_every_boundary() -> None:
    per_step = _lone_step_gaps(jitter=0.05, per_step=True)
    assert len(per_step) == 199
    assert len({round(g, 12) for g in per_step}) > 150  # a fresh draw nearly every step
    assert statistics.mean(per_step) == pytest.approx(0.02, rel=0.02)  # 199 draws, sd 0.35%
    held = _lone_step_gaps(jitter=0.05, per_step=False)
    assert len({round(g, 12) for g in held}) == 1  # one draw for the whole (unchanged) batch
    assert held[0] != pytest.approx(0.02, rel=1e-6)
    assert _lone_step_gaps(jitter=0.0, per_step=True) == pytest.approx([0.02] * 199)


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


@pytest.mark.parametrize("scheduling", ["fcfs", "priority"])
def test_priority_scheduling_orders_admission_and_chooses_the_victim(scheduling: str) -> None:
    """With one sequence slot, waiting requests are admitted by (priority, arrival) under
    priority scheduling; under KV pressure the victim is the newest of the highest value."""
    one = DecodeEngine("d", dataclasses.replace(A40, max_num_seqs=1), scheduling=scheduling)
    reqs = [EngineRequest(i, 0.0, 100, 5, "chat", priority=p) for i, p in enumerate([0, 1, 0])]
    drive(one, [(0.0, r) for r in reqs])
    order = [r.index for r in sorted(reqs, key=lambda r: r.first_token)]
    assert order == ([0, 2, 1] if scheduling == "priority" else [0, 1, 2])

    tight = DecodeEngine(
        "d", dataclasses.replace(A40, kv_capacity_tokens=700), scheduling=scheduling
    )
    grow = [EngineRequest(i, 0.0, 200, 200, "chat", priority=p) for i, p in enumerate([1, 0, 0])]
    drive(tight, [(0.0, r) for r in grow])
    assert tight.preemptions > 0
    # fcfs preempts the newest admitted (2, then 1), never the oldest; priority preempts the
    # priority-1 request first, and never the oldest of priority 0.
    if scheduling == "priority":
        assert grow[0].preemptions > 0 and grow[1].preemptions == 0
    else:
        assert grow[0].preemptions == 0 and grow[2].preemptions > 0
