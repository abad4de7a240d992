"""The bus the simulator's router replicas share their books over (`RouterOptions.shared_books`).

Each replica's `core.shared_books.Publisher` appends its events to `outbox`; the simulation sends
them at the time of the event it was handling (`flush`), and every replica receives each of them
`delay_s` later, at its first observation then or after (`deliver`): a replica reads its books
only when it decides, so an event applied then is applied in time. The log is in due order and
each reader keeps its place in it, so every replica sees the same events in the same order and
runs stay deterministic. A reader gets its own events back too (its `SharedBooks` ignores them,
as a subscriber to a real bus would).

A flush may be dated back (`flush(at)` with `at` before an earlier flush): the simulation sends a
replica's token counts as of `delay_s` before a decision, due at the decision, as a front door
that publishes every token as it streams would have (`sim.cluster`). Such events join the log in
due order, after those due at the same time, and never before what a reader has received.
"""

from __future__ import annotations

import bisect

from disaggpool.core.book_event import BookEvent

__all__ = ["BookBus"]

_TRIM = 4096  # drop this many delivered events from the log's head at a time


class BookBus:
    """Events in send order, each due `delay_s` after it was sent (module docstring)."""

    def __init__(self, delay_s: float) -> None:
        if not delay_s >= 0.0:
            raise ValueError(f"delay_s must be >= 0, got {delay_s!r}")
        self.delay_s = delay_s
        self.outbox: list[BookEvent] = []  # published, not sent yet
        self._log: list[tuple[float, BookEvent]] = []  # (due, event), in due order
        self._places: list[int] = []  # each reader's next index in `_log`

    def subscribe(self) -> int:
        """A new reader, which receives the events sent from now on; returns its id."""
        self._places.append(len(self._log))
        return len(self._places) - 1

    def flush(self, now: float) -> None:
        """Send what was published since the last flush, at `now` (which may lie before an
        earlier flush's: module docstring)."""
        if self.outbox:
            due = now + self.delay_s
            log = self._log
            at = len(log)
            if log and log[-1][0] > due:
                at = bisect.bisect_right(log, due, key=_due)
                if self._places and at < max(self._places):
                    raise ValueError(
                        f"events sent at {now!r} would be due before what was received"
                    )
            log[at:at] = [(due, event) for event in self.outbox]
            self.outbox.clear()

    def deliver(self, reader: int, now: float) -> list[BookEvent]:
        """The events due for `reader` by `now`, each once (those published but not sent yet
        are sent at `now` first)."""
        self.flush(now)
        log = self._log
        start = i = self._places[reader]
        while i < len(log) and log[i][0] <= now:
            i += 1
        self._places[reader] = i
        events = [event for _, event in log[start:i]]
        if i >= _TRIM and min(self._places) >= _TRIM:  # every reader is past the head
            del log[:_TRIM]
            self._places = [p - _TRIM for p in self._places]
        return events


def _due(item: tuple[float, BookEvent]) -> float:
    return item[0]
