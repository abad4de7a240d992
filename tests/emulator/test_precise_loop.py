"""The emulator's event loop (`emulator.precise_loop`): timers keep asyncio's contract (never
early, all of them, in order) and a long sleep still wakes at once for I/O. How precisely they
fire is a measurement, not a test: `bench/emulator_overhead.py` and BENCHMARKS.md."""

from __future__ import annotations

import asyncio
import selectors
import socket
import sys

import pytest

from disaggpool.emulator import precise_loop


def run(coro_fn):  # type: ignore[no-untyped-def]
    with asyncio.Runner(loop_factory=precise_loop.new_event_loop) as runner:
        return runner.run(coro_fn())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="epoll is Linux's")
def test_linux_gets_the_precise_epoll_selector() -> None:
    sel = precise_loop.selector()
    try:
        assert isinstance(sel, selectors.EpollSelector)
        assert type(sel).__name__ == "PreciseEpollSelector"
    finally:
        sel.close()


def test_timers_fire_in_order_and_never_early() -> None:
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

    fired = run(main)
    assert [w for w, _ in fired] == sorted(w for w, _ in fired)
    assert len(fired) == 6
    assert all(at >= when for when, at in fired)


def test_io_wakes_a_long_sleep_at_once() -> None:
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

    assert run(main) == b"x"
