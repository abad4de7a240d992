"""The timing event loops (`precise_loop`): the emulator's and the probe's busy-polling one keep
asyncio's contract (timers never early, all of them, in order) and a long wait still wakes at
once for I/O. How precisely they fire is a measurement, not a test (BENCHMARKS.md)."""

from __future__ import annotations

import asyncio
import selectors
import socket
import sys

import pytest

from disaggpool import precise_loop

LOOPS = [precise_loop.new_event_loop, precise_loop.busy_poll_event_loop]


def run(factory, coro_fn):  # type: ignore[no-untyped-def]
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(coro_fn())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="epoll is Linux's")
def test_linux_gets_the_precise_epoll_selector() -> None:
    sel = precise_loop.selector()
    try:
        assert isinstance(sel, selectors.EpollSelector)
        assert type(sel).__name__ == "PreciseEpollSelector"
    finally:
        sel.close()


@pytest.mark.parametrize("factory", LOOPS, ids=["precise", "busy_poll"])
def test_timers_fire_in_order_and_never_early(factory) -> None:  # type: ignore[no-untyped-def]
    async def main() -> list[tuple[float, float]]:
        loop = asyncio.get_running_loop()
        fired: list[tuple[float, float]] = []
        start = loop.time()
        whens = [start + d for d in (0.0207, 0.0003, 0.0051, 0.0011, 0.0123, 0.0002)]
        done = loop.create_future()
        for when in whens:
            loop.call_at(when, lambda w=when: fired.append((w, loop.time())))
        loop.call_at(max(whens) + 0.005, done.set_result, None)
        await done
        return fired

    fired = run(factory, main)
    assert [w for w, _ in fired] == sorted(w for w, _ in fired)
    assert len(fired) == 6
    assert all(at >= when for when, at in fired)


@pytest.mark.parametrize("factory", LOOPS, ids=["precise", "busy_poll"])
def test_io_wakes_a_long_sleep_at_once(factory) -> None:  # type: ignore[no-untyped-def]
    async def main() -> bytes:
        loop = asyncio.get_running_loop()
        a, b = socket.socketpair()
        a.setblocking(False)
        b.setblocking(False)
        try:
            loop.call_at(loop.time() + 30.0, lambda: None)  # the loop would sleep 30 s
            loop.call_later(0.01, b.send, b"x")
            return await asyncio.wait_for(loop.sock_recv(a, 1), 5.0)
        finally:
            a.close()
            b.close()

    assert run(factory, main) == b"x"
