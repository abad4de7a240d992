"""The prefill engine's `abort` (a client gone before its prompt was prefilled): what it gives
back, what it cannot take back (a prompt in the running iteration), and what it lets start."""

from __future__ import annotations

import dataclasses

import pytest

from disaggpool.core.hardware import builtin_profile
from disaggpool.engine.prefill import PrefillEngine
from disaggpool.engine.request import EngineRequest

A40 = builtin_profile("a40-llama3-8b")


def test_abort_returns_kv_unless_the_prompt_is_being_prefilled() -> None:
    eng = PrefillEngine("p", dataclasses.replace(A40, max_num_batched_tokens=100))
    a, b = EngineRequest(0, 0.0, 100, 1, "x"), EngineRequest(1, 0.0, 100, 1, "x")
    eng.enqueue(a, 0.0)
    eng.enqueue(b, 0.0)  # the token budget holds one prompt: b waits
    assert eng.num_running == 1 and eng.num_waiting == 1
    assert eng.abort(b, 0.0) and eng.kv_used == 100
    assert eng.num_waiting == 0
    assert not eng.abort(a, 0.0)  # being prefilled: it finishes, then its owner releases it
    t = eng.next_wakeup()
    assert t == pytest.approx(A40.prefill.prompt_time(100))
    assert eng.advance(t) == [a]
    eng.release(a, t)
    assert eng.kv_used == 0 and not eng.queue and eng.next_wakeup() is None
    assert b.prefill_done < 0
    assert eng.abort(a, t)  # finished already: a no-op


def test_abort_frees_the_head_of_a_queue_blocked_on_kv() -> None:
    """FCFS: a prompt that does not fit in the KV left blocks those behind it; aborting it lets
    the next one start at once."""
    eng = PrefillEngine("p", dataclasses.replace(A40, kv_capacity_tokens=150))
    a = EngineRequest(0, 0.0, 100, 1, "x")
    b = EngineRequest(1, 0.0, 100, 1, "x")
    c = EngineRequest(2, 0.0, 40, 1, "x")
    eng.enqueue(a, 0.0)
    t = eng.next_wakeup()
    assert t is not None and eng.advance(t) == [a]  # prefilled; its KV is held until released
    eng.enqueue(b, t)  # 100 + 100 > 150: waits for a's release
    eng.enqueue(c, t)  # behind b, though it would fit
    assert eng.next_wakeup() is None and eng.kv_used == 100
    assert eng.abort(b, t)
    t2 = eng.next_wakeup()
    assert t2 == pytest.approx(t + A40.prefill.prompt_time(40))
    assert eng.advance(t2) == [c] and eng.kv_used == 140


def test_abort_of_a_partly_prefilled_prompt_is_refused_while_its_chunk_runs() -> None:
    """A long prompt is prefilled in chunks; between two chunks it is still in the running
    iteration (the next chunk starts at once), so it always finishes."""
    eng = PrefillEngine("p", dataclasses.replace(A40, max_num_batched_tokens=100))
    long = EngineRequest(0, 0.0, 250, 1, "x")
    eng.enqueue(long, 0.0)
    done, iterations = [], 0
    while (t := eng.next_wakeup()) is not None:
        assert not eng.abort(long, t)
        done += eng.advance(t)
        iterations += 1
    assert iterations == 3 and done == [long] and eng.kv_used == 250


@pytest.mark.parametrize("scheduling", ["fcfs", "priority"])
def test_priority_scheduling_lets_a_lower_value_pass_waiting_prompts_but_not_a_started_one(
    scheduling: str,
) -> None:
    """vLLM's --scheduling-policy priority: waiting requests by (priority, arrival); a prompt
    whose prefill has begun keeps its place. Under fcfs the priorities change nothing."""
    eng = PrefillEngine(
        "p", dataclasses.replace(A40, max_num_batched_tokens=100), scheduling=scheduling
    )
    started, late1, late2, urgent, urgent2 = (
        EngineRequest(i, 0.0, 100, 1, "x", priority=p) for i, p in enumerate([1, 1, 1, 0, 0])
    )
    for req in (started, late1, late2, urgent, urgent2):
        eng.enqueue(req, 0.0)
    order = []
    while (t := eng.next_wakeup()) is not None:
        for req in eng.advance(t):
            order.append(req.index)
            eng.release(req, t)
    if scheduling == "priority":
        assert order == [0, 3, 4, 1, 2]
    else:
        assert order == [0, 1, 2, 3, 4]
