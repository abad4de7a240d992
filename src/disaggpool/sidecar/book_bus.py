"""Shared books over NATS: router replicas tell each other what they routed (``shared_books``).

With a `shared_books` section in the config, the routing service's `Pods` gets a
`core.shared_books.Publisher` as its listener: every change the router makes to its own books
becomes a `core.book_event.BookEvent`, queued here. The events of one event-loop turn go out as
one NATS core message on `subject` (JSON ``{"owner": ..., "events": [...]}``; per-token progress
events are many, and the simulator found thinning them hurts where batching does not). A
subscription on the same subject applies the other replicas' events through
`core.shared_books.SharedBooks`, which books them as foreign entries (`Entry.owner`) that count
in every snapshot like this replica's own. A message that does not parse, or an event that
`BookEvent.from_dict` refuses, is counted and logged (once per distinct error), never raised.

Times cross the bus as wall-clock seconds: each replica's clock is its own monotonic one, so
`routed_at` and `first_token_at` are moved onto `time.time()` when published and back onto the
local clock when applied (replicas need NTP-synced hosts, as any Kubernetes node has).

Liveness of the owners: every message renews its owner's lease, and every `lease_s / 3` a
replica sends a snapshot of its books (`Publisher.snapshot`, then the ids it holds as the
message's ``holding``), so that its queued requests stay booked elsewhere and whatever the bus
lost is healed within that period; `SharedBooks.expire` runs as often and drops the entries of an
owner silent for `lease_s` (a dead replica's books do not linger). A replica that connects or
reconnects sends its snapshot marked ``hello``: it may have missed events, so every other
replica answers with its own snapshot (as each does when an owner it has not heard from
speaks). A replica that joins learns the others' books at once, and after a server restart every
replica's books are restated.

The bus down is not an outage: each replica falls back to its own books (the foreign entries
leave with their owners' leases), visibly: `disaggpool_shared_books_connected` drops to 0 and a
log line says so; readiness is untouched. nats-py reconnects on its own; while it is away the
events wait in a queue of at most `max_pending` (the oldest dropped and counted beyond it), and
publishing never blocks routing: the router only appends to that queue. Events published while
the server itself restarts are lost (core NATS keeps nothing), until the owner's next
snapshot (on its reconnection) restates its books.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from prometheus_client import Counter, Gauge

from disaggpool.core.book_event import BookEvent, BookEventError
from disaggpool.core.pods import Pods
from disaggpool.core.shared_books import Publisher, SharedBooks
from disaggpool.sidecar.config import SharedBooksConfig

__all__ = ["MAX_BATCH", "BookBus", "replica_name"]

log = logging.getLogger("disaggpool.sidecar")

MAX_BATCH = 1000  # events per message (about 300 bytes each: far below NATS' 1 MiB payload)
MAX_HOLDING = 100_000  # request ids a snapshot may name (a router holds `max_inflight`)
_CONNECT_BACKOFF_S = (0.5, 5.0)  # first connect: retry every 0.5 s, doubling up to 5 s


def replica_name() -> str:
    """The default replica id: the pod's name (`$HOSTNAME` in Kubernetes), else the host name."""
    return os.environ.get("HOSTNAME") or socket.gethostname()


class BookBus:
    """One replica's end of the shared books (module docstring). `run` is its supervised task."""

    def __init__(
        self,
        config: SharedBooksConfig,
        pods: Pods[Any],
        registry: Any,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.owner = config.replica_id or replica_name()
        self.clock = clock
        self.wall = wall
        self.shared = SharedBooks(pods, self.owner, lease_s=config.lease_s)
        self.pods = pods
        self.publisher = Publisher(self.owner, self._queue)
        pods.listener = self.publisher
        # Events, and the end of each snapshot: ``{"holding": [ids]}``, sent with the events
        # before it (the order on the bus is the order here).
        self._pending: collections.deque[dict[str, Any]] = collections.deque()
        self._wake = asyncio.Event()
        self._snapshot_due = False  # send our snapshot (the heartbeat, or asked for)
        self._hello = False  # send it asking for the others' (connected, or reconnected)
        self._nc: Client | None = None
        self._closing = False  # closing it ourselves: no disconnect warning
        self._errors_seen: set[str] = set()
        self.connected = Gauge(
            "disaggpool_shared_books_connected", "1 while the shared-books bus is connected",
            registry=registry,
        )  # fmt: skip
        self.events = Counter(
            "disaggpool_shared_books_events",
            "shared-books events: published, applied, ignored, rejected (malformed) or dropped",
            ["outcome"], registry=registry,
        )  # fmt: skip
        self.malformed = Counter(
            "disaggpool_shared_books_malformed_messages",
            "shared-books messages that did not parse", registry=registry,
        )  # fmt: skip
        for outcome in ("published", "applied", "ignored", "rejected", "dropped"):
            self.events.labels(outcome)

    # ------------------------------------------------------------------ publishing
    def _queue(self, event: BookEvent) -> None:
        """The Publisher's `send`: append, never block; the flusher sends after this turn."""
        if len(self._pending) >= self.config.max_pending:
            self._pending.popleft()
            self.events.labels("dropped").inc()
        data = event.to_dict()
        offset = self.wall() - self.clock()
        for key in ("routed_at", "first_token_at"):
            if data.get(key, 0.0) > 0.0:
                data[key] += offset
        self._pending.append(data)
        self._wake.set()

    def _queue_snapshot(self, hello: bool) -> None:
        """This replica's books as it holds them now, to be sent in order with the events;
        `hello`: ask the others for theirs."""
        own = [e for e in self.pods.ledger.entries.values() if e.owner is None]
        for event in self.publisher.snapshot(own):
            self._queue(event)
        self._pending.append({"holding": [e.request_id for e in own], "hello": hello})
        self._wake.set()

    async def _flush(self) -> None:
        """Send what is queued, a message per `MAX_BATCH` events or up to a snapshot's end,
        while connected."""
        nc = self._nc
        pending = self._pending
        while pending and nc is not None and nc.is_connected:
            batch: list[dict[str, Any]] = []
            end: dict[str, Any] = {}  # a snapshot's end: its "holding" and "hello"
            while pending and len(batch) < MAX_BATCH:
                item = pending.popleft()
                if "holding" in item:
                    end = item
                    break
                batch.append(item)
            await self._send(nc, batch, end)

    async def _send(
        self, nc: Client, events: list[dict[str, Any]], end: dict[str, Any] | None = None
    ) -> None:
        doc: dict[str, Any] = {"owner": self.owner, "events": events, **(end or {})}
        payload = json.dumps(doc, separators=(",", ":"))
        try:
            await nc.publish(self.config.subject, payload.encode())
        except Exception as exc:  # the connection went between the check and the write
            self.events.labels("dropped").inc(len(events))
            self._log_once(f"publish failed: {exc!r}")
        else:
            self.events.labels("published").inc(len(events))

    # ------------------------------------------------------------------ receiving
    async def _received(self, msg: Msg) -> None:
        self.receive(msg.data)

    def receive(self, data: bytes) -> None:
        """Apply one message of another replica; a malformed one is counted, never raised."""
        try:
            doc = json.loads(data)
            owner, raw = doc["owner"], doc["events"]
            if not isinstance(owner, str) or not owner or not isinstance(raw, list):
                raise ValueError("needs a non-empty 'owner' and a list of 'events'")
            holding, hello = doc.get("holding"), doc.get("hello", False)
            if not isinstance(hello, bool):
                raise ValueError("'hello' must be true or false")
            if holding is not None and not (
                isinstance(holding, list)
                and len(holding) <= MAX_HOLDING
                and all(isinstance(i, str) for i in holding)
            ):
                raise ValueError(f"'holding' must be a list of at most {MAX_HOLDING} request ids")
        except (ValueError, TypeError, KeyError) as exc:
            self.malformed.inc()
            self._log_once(f"malformed shared-books message: {exc!r}")
            return
        if owner == self.owner:
            return
        now, offset = self.clock(), self.clock() - self.wall()
        if hello or owner not in self.shared.heard:  # it may lack our books: restate them
            self._snapshot_due = True
            self._wake.set()
        self.shared.heard[owner] = now  # renewed by any message, events or not
        for item in raw:
            try:
                if not isinstance(item, dict):
                    raise BookEventError("(event)", f"must be a mapping, got {type(item).__name__}")
                for key in ("routed_at", "first_token_at"):
                    value = item.get(key)
                    if isinstance(value, int | float) and value > 0.0:
                        item[key] = max(0.0, value + offset)
                event = BookEvent.from_dict(item)
                if event.owner != owner:
                    raise BookEventError("owner", f"{event.owner!r} in a message of {owner!r}")
            except BookEventError as exc:
                self.events.labels("rejected").inc()
                self._log_once(f"shared-books event from {owner} refused: {exc}")
                continue
            changed = self.shared.apply(event, now)
            self.events.labels("applied" if changed is not None else "ignored").inc()
        if holding is not None:
            self.shared.holding(owner, set(holding), now)

    # ------------------------------------------------------------------ the supervised task
    async def run(self) -> None:
        """Connect (retrying until it does), subscribe, then flush, heartbeat and expire."""
        nc = await self._connect()
        self._nc = nc
        try:
            await nc.subscribe(self.config.subject, cb=self._received)
            self.connected.set(1)
            log.info("shared books: connected to %s as %s", self.config.nats_url, self.owner)
            period = self.config.lease_s / 3.0
            beat = self.clock()
            self._hello = True
            self._wake.set()
            while True:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(period):  # not wait_for (sidecar.leader)
                        await self._wake.wait()
                self._wake.clear()
                now = self.clock()
                if now - beat >= period:
                    beat = now
                    self._snapshot_due = True  # the heartbeat
                    self.shared.expire(now)
                if (self._snapshot_due or self._hello) and nc.is_connected:
                    self._queue_snapshot(self._hello)
                    self._snapshot_due = self._hello = False
                await self._flush()
        finally:
            self._nc = None
            self.connected.set(0)
            self._closing = True
            await nc.close()
            self._closing = False

    async def _connect(self) -> Client:
        wait, attempt = _CONNECT_BACKOFF_S[0], 0
        while True:
            try:
                return await nats.connect(
                    self.config.nats_url,
                    name=self.owner,
                    no_echo=True,  # its own messages are not sent back to it
                    allow_reconnect=True,
                    max_reconnect_attempts=-1,
                    reconnect_time_wait=0.5,
                    connect_timeout=2,
                    error_cb=self._error,
                    disconnected_cb=self._disconnected,
                    reconnected_cb=self._reconnected,
                    **self._credentials(),
                )
            except Exception as exc:
                if attempt == 0:
                    log.warning(
                        "shared books: cannot reach %s (%r); routing on this replica's own "
                        "books, retrying",
                        self.config.nats_url,
                        exc,
                    )
                attempt += 1
                await asyncio.sleep(wait)
                wait = min(_CONNECT_BACKOFF_S[1], wait * 2)

    def _credentials(self) -> dict[str, Any]:
        if self.config.token_file:
            path = Path(self.config.token_file)
            return {"token": lambda: path.read_text(encoding="utf-8").strip()}
        if self.config.credentials_file:
            return {"user_credentials": self.config.credentials_file}
        return {}

    async def _error(self, exc: Exception) -> None:
        self._log_once(f"shared books: {exc!r}")

    async def _disconnected(self) -> None:
        self.connected.set(0)
        if self._closing:
            return
        log.warning(
            "shared books: disconnected from %s; routing on this replica's own books until it "
            "reconnects",
            self.config.nats_url,
        )

    async def _reconnected(self) -> None:
        self.connected.set(1)
        self._errors_seen.clear()
        log.info("shared books: reconnected to %s", self.config.nats_url)
        self._hello = True  # what went on meanwhile may be lost: restate, and ask
        self._wake.set()

    def _log_once(self, message: str) -> None:
        if message not in self._errors_seen and len(self._errors_seen) < 100:
            self._errors_seen.add(message)
            log.warning("%s", message)
