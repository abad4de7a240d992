"""Router replicas as real processes: two `disaggpool sidecar` processes in front of one emulated
pool share their books through a real nats-server on loopback, and `disaggpool loadgen`'s replay
spreads a trace over them (request i to replica i mod 2). A third of the way through the trace the
nats-server is killed (SIGKILL) and started again: no request is lost or cut short, both replicas
say the bus went (`disaggpool_shared_books_connected` 0) and came back (1), and each applied the
other's events both before the kill and after the restart.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from sidecar_testkit import A40, MODEL, NatsServer, Pool, metric

from disaggpool.core.contracts import SLOClass
from disaggpool.formats.traces import TraceRequest
from disaggpool.loadgen import RequestResult, replay
from disaggpool.localpool.processes import (
    child_env,
    disaggpool_command,
    free_port,
    processes,
    wait_http,
)

REPLICAS = ("r0", "r1")
SLO = SLOClass("interactive", 5.0, 0.5)
# 48 requests over 4.7 s, mixed lengths; the kill comes when 16 have finished.
TRACE = [TraceRequest(0.1 * i, 64 + 37 * (i % 5), 8 + 4 * (i % 4)) for i in range(48)]
KILL_AFTER = 16
CONNECTED = "disaggpool_shared_books_connected"
EVENTS = "disaggpool_shared_books_events_total"


def sidecar_doc(pool: Pool, nats_url: str, replica: str) -> dict[str, Any]:
    return {
        "policy": "calibrated",
        "model": MODEL,
        "listen": {"http": f"127.0.0.1:{free_port()}", "grpc": "127.0.0.1:0"},
        "slo_classes": [{"name": SLO.name, "ttft_s": SLO.ttft_s, "tpot_s": SLO.tpot_s}],
        "scrape_interval_s": 0.2,
        "tokenizer": {"kind": "emulator"},
        "pool": {"static": {"prefill": pool.urls("prefill"), "decode": pool.urls("decode")}},
        "profiles": {"dir": str(pool.profiles_dir)},
        "shared_books": {
            "nats_url": nats_url,
            "subject": "test.replicas",
            "replica_id": replica,
            "lease_s": 3.0,
        },
    }


def wait_for(check: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    """Until `check()` holds; an AssertionError naming `what` if it never does (a generous
    deadline against a hang, not a bound on how fast it should happen)."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.05)


@pytest.mark.timeout(180)
@pytest.mark.skipif(sys.platform == "win32", reason="signals and uvloop")
def test_replicas_share_books_and_lose_nothing_when_the_bus_dies(
    start_pool: Callable[..., Pool], nats_server: NatsServer, tmp_path: Path
) -> None:
    pool = start_pool([A40], [A40, A40])
    with processes() as procs:
        urls = []
        for name in REPLICAS:
            path = tmp_path / f"{name}.yaml"
            doc = sidecar_doc(pool, nats_server.url, name)
            path.write_text(yaml.safe_dump(doc))
            log = (tmp_path / f"{name}.log").open("wb")
            cmd = disaggpool_command("sidecar", "--config", str(path))
            procs.append(
                subprocess.Popen(cmd, env=child_env(), stdout=log, stderr=subprocess.STDOUT)
            )
            urls.append(f"http://{doc['listen']['http']}")
        for url, proc in zip(urls, procs, strict=True):
            wait_http(f"{url}/health", proc)

        def connected(value: float) -> bool:
            return all(metric(u, CONNECTED) == value for u in urls)

        def applied() -> list[float]:
            return [metric(u, EVENTS, outcome="applied") for u in urls]

        wait_for(lambda: connected(1.0), "both replicas connected to the bus")
        seen: dict[str, Any] = {}

        def kill_and_restart() -> None:
            seen["applied_before_kill"] = applied()
            nats_server.stop()  # SIGKILL
            wait_for(lambda: connected(0.0), "both replicas saw the bus go")
            seen["dropped_to_zero"] = True
            nats_server.start()
            wait_for(lambda: connected(1.0), "both replicas reconnected")
            seen["applied_at_reconnect"] = applied()

        async def run() -> list[RequestResult]:
            done = 0
            half = asyncio.Event()

            def on_done(_: RequestResult) -> None:
                nonlocal done
                done += 1
                if done == KILL_AFTER:
                    half.set()

            async def bus_chaos() -> None:
                await half.wait()
                await asyncio.to_thread(kill_and_restart)

            chaos = asyncio.create_task(bus_chaos())
            report = await replay(urls, TRACE, [SLO], on_done=on_done)
            await chaos
            return report.results

        results = asyncio.run(run())

        # Every request completed in full, on the replica it was sent to.
        assert [(r.ok, r.error) for r in results] == [(True, "")] * len(TRACE)
        assert [r.output_tokens for r in results] == [t.output_tokens for t in TRACE]
        assert [r.target for r in results] == [urls[i % 2] for i in range(len(TRACE))]
        # The bus went and came back, and both replicas said so.
        assert seen.get("dropped_to_zero") is True
        assert connected(1.0)
        # Before the kill each had applied the other's events (its own are never echoed).
        assert all(n > 0 for n in seen["applied_before_kill"]), seen
        # After the restart they share again: a few more requests, applied on the other side.
        after = seen["applied_at_reconnect"]
        more = [TraceRequest(0.05 * i, 64, 8) for i in range(6)]
        extra = asyncio.run(replay(urls, more, [SLO])).results
        assert all(r.ok for r in extra)
        wait_for(
            lambda: all(n > a for n, a in zip(applied(), after, strict=True)),
            "each replica applied the other's events after the restart",
        )
        # The bus task never failed on either replica.
        for url in urls:
            assert metric(url, "disaggpool_loop_errors_total", loop="book_bus") == 0.0
            assert metric(url, EVENTS, outcome="rejected") == 0.0
            assert metric(url, "disaggpool_shared_books_malformed_messages_total") == 0.0
