"""The supervisor of the sidecar's background loops: a failure is counted and retried, a task
that dies is started again, and only a loop that cannot recover makes /livez fail."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry, Counter

from disaggpool.sidecar import supervise
from disaggpool.sidecar.supervise import Supervisor

pytestmark = pytest.mark.asyncio


def _supervisor() -> tuple[Supervisor, Counter, Counter]:
    registry = CollectorRegistry()
    errors = Counter("errors", "", ["loop"], registry=registry)
    restarts = Counter("restarts", "", ["loop"], registry=registry)
    return Supervisor(errors, restarts), errors, restarts


async def _until(check, timeout: float = 5.0) -> None:
    end = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < end, "condition not reached"
        await asyncio.sleep(0.005)


async def test_a_failing_step_is_counted_and_the_loop_goes_on(monkeypatch) -> None:
    monkeypatch.setattr(supervise, "MAX_BACKOFF_S", 0.02)
    sup, errors, _ = _supervisor()
    calls = []

    async def step() -> None:
        calls.append(1)
        if len(calls) in (2, 3):
            raise ValueError("nan is not a number")

    sup.periodic("scrape", step, 0.001)
    await _until(lambda: len(calls) >= 6)
    assert errors.labels("scrape")._value.get() == 2
    assert sup.states() == {"scrape": "running"} and sup.alive  # recovered
    await sup.stop()


async def test_a_task_that_dies_is_started_again(monkeypatch) -> None:
    monkeypatch.setattr(supervise, "MAX_BACKOFF_S", 0.01)
    sup, errors, restarts = _supervisor()
    starts = []

    async def watch() -> None:
        starts.append(1)
        if len(starts) < 3:
            raise ConnectionError("watch stream broke")
        await asyncio.Event().wait()  # the third one stays up

    sup.task("watch_pods", watch)
    await _until(lambda: len(starts) == 3)
    assert restarts.labels("watch_pods")._value.get() == 2
    assert errors.labels("watch_pods")._value.get() == 2
    await _until(lambda: sup.states()["watch_pods"] == "running")
    await sup.stop()


async def test_a_task_that_returns_counts_as_failed_and_is_restarted(monkeypatch) -> None:
    monkeypatch.setattr(supervise, "MAX_BACKOFF_S", 0.01)
    sup, errors, _ = _supervisor()
    starts = []

    async def quits() -> None:
        starts.append(1)

    sup.task("members", quits)
    await _until(lambda: len(starts) >= 3)
    assert errors.labels("members")._value.get() >= 2
    await sup.stop()


async def test_a_loop_that_never_recovers_makes_livez_fail(monkeypatch) -> None:
    monkeypatch.setattr(supervise, "MAX_BACKOFF_S", 0.001)
    monkeypatch.setattr(supervise, "GIVE_UP_AFTER", 4)
    sup, _, _ = _supervisor()
    ok_calls = []

    async def broken() -> None:
        raise RuntimeError("always")

    async def fine() -> None:
        ok_calls.append(1)

    sup.periodic("fine", fine, 0.001)
    sup.periodic("broken", broken, 0.001)
    await _until(lambda: sup.states()["broken"] == "dead")
    assert not sup.alive and sup.states()["fine"] == "running"
    await sup.stop()


async def test_a_cancelled_loop_is_dead_and_per_pod_loops_share_a_label(monkeypatch) -> None:
    sup, errors, _ = _supervisor()

    async def boom() -> None:
        raise OSError("socket")

    sup.task("kv_events/p0", boom)
    sup.task("kv_events/p1", boom)
    await _until(lambda: errors.labels("kv_events")._value.get() >= 2)
    assert sup.names("kv_events") == ["kv_events/p0", "kv_events/p1"]
    await sup.cancel("kv_events/p0")
    assert sup.names("kv_events") == ["kv_events/p1"]
    loop = sup._loops["kv_events/p1"]
    assert loop.task is not None
    loop.task.cancel()  # what only a bug outside the supervisor would do
    await asyncio.gather(loop.task, return_exceptions=True)
    assert sup.states()["kv_events/p1"] == "dead" and not sup.alive
    with pytest.raises(ValueError, match="already supervised"):
        sup.task("kv_events/p1", boom)
    await sup.stop()
