"""Event loops for timing: timers on time for the emulator, busy polling for the probe.

**Timers on time** (`new_event_loop`, the emulator's loop).

The emulator's engines wake on `loop.call_at` timers, so a timer's lateness is added to every
token and every prefill a client sees. On Linux the default loop fires late three ways:

* epoll's timeout is whole milliseconds, rounded up: up to 1 ms late (a measured median 1.1 ms);
* the kernel lets any sleep overrun by 0.1% of its length (its "timer slack"; 0.5% for a niced
  process), so a 150 ms prefill's wake-up comes up to 0.15 ms late;
* and never by less than the thread's minimum slack, 50 us by default.

A probe fitting the profile then finds fixed costs too large by all of that, which for an H100
profile's 1.5 ms prefill overhead is a 70% error. `PreciseEpollSelector` keeps epoll for the
descriptors (it scales past select's 1024) and changes only how it sleeps: in `select()` on the
epoll descriptor itself (readable whenever one of its descriptors has an event), whose timeout is
in microseconds; first for all but a margin larger than the proportional slack, then for the
rest; with the thread's minimum slack lowered to 1 us (`prctl(PR_SET_TIMERSLACK)`). Events are
then collected with a non-blocking epoll poll. The loop's behaviour is otherwise unchanged.

Elsewhere (kqueue on macOS and BSD: nanosecond timeouts already) the default selector is used.

**Busy polling** (`busy_poll_event_loop`, the probe's loop when asked). A CPU that idles while a
measurement is in flight wakes slowly when the answer comes: on a virtual machine, a process
that slept 10-40 ms takes 0.1-0.4 ms longer to see a socket become readable than one that was
running. The probe would add that to every latency it measures, the more the longer it waited,
which reads as a larger KV-transfer setup time. `BusyPollSelector` never sleeps: it polls its
descriptors without blocking until an event arrives or the timeout passes. It burns one core for
as long as the loop runs, so it is for a measuring process on a CPU of its own only.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import select
import selectors
import sys
import time

__all__ = ["BusyPollSelector", "busy_poll_event_loop", "new_event_loop", "selector"]

_FD_SETSIZE = 1024  # select() cannot wait on a descriptor numbered above this
_PR_SET_TIMERSLACK = 29
_SLACK_NS = 1000


def _margin(timeout: float) -> float:
    """How much of a sleep of `timeout` seconds to leave for a second, short one."""
    return 0.01 * timeout + 1e-4


def _lower_timer_slack() -> None:
    """Ask Linux for 1 us of timer slack in this thread (harmless if it refuses)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_TIMERSLACK, _SLACK_NS, 0, 0, 0)


if hasattr(selectors, "EpollSelector"):

    class PreciseEpollSelector(selectors.EpollSelector):
        """`EpollSelector` that sleeps with microsecond precision (see the module docstring)."""

        _slack_lowered = False

        def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
            if timeout is not None and timeout > 0:
                if not self._slack_lowered:  # per thread: do it in the loop's own thread
                    _lower_timer_slack()
                    self._slack_lowered = True
                self._sleep(timeout)
                timeout = 0
            return super().select(timeout)

        def _sleep(self, timeout: float) -> None:
            """Until an event or `timeout`; PEP 475: select() resumes itself after a signal."""
            fd = [self._selector.fileno()]  # type: ignore[attr-defined]
            deadline = time.monotonic() + timeout
            first = timeout - _margin(timeout)
            if first > 0 and select.select(fd, [], [], first)[0]:
                return
            rest = deadline - time.monotonic()
            if rest > 0:
                select.select(fd, [], [], rest)


def selector() -> selectors.BaseSelector:
    """The most precise selector available here."""
    if hasattr(selectors, "EpollSelector"):
        sel = PreciseEpollSelector()
        if sel.fileno() < _FD_SETSIZE:
            return sel
        sel.close()  # a process with a thousand descriptors open already: settle for epoll
    return selectors.DefaultSelector()


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new event loop on `selector()` (pass as `asyncio.Runner(loop_factory=...)`)."""
    return asyncio.SelectorEventLoop(selector())


class BusyPollSelector(selectors.DefaultSelector):
    """A selector that polls instead of sleeping (see the module docstring)."""

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        deadline = None if timeout is None else time.monotonic() + max(timeout, 0.0)
        while True:
            ready = super().select(0)
            if ready or (deadline is not None and time.monotonic() >= deadline):
                return ready


def busy_poll_event_loop() -> asyncio.AbstractEventLoop:
    """A new event loop on `BusyPollSelector` (pass as `asyncio.Runner(loop_factory=...)`)."""
    return asyncio.SelectorEventLoop(BusyPollSelector())
