"""Child processes on loopback: free ports, the `disaggpool` command, readiness, teardown.

`processes` hands out a list to put started children in and stops every one on leaving (SIGTERM,
then SIGKILL after 10 s), so an interrupted demo, bench or test leaves nothing running.
`wait_http` waits for a child's health endpoint and fails at once when the child has exited, so a
child that cannot start says so instead of timing out. Called by the rest of `localpool`, the
demo, the benches and the process-level tests.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

__all__ = [
    "child_env",
    "disaggpool_command",
    "free_port",
    "processes",
    "stderr_messages",
    "wait_http",
]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 when asked (the kernel's choice)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def disaggpool_command(*args: str) -> list[str]:
    """`disaggpool ARGS` run by this interpreter, so a child uses the same installation."""
    return [sys.executable, "-m", "disaggpool", *args]


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment plus `extra`, unbuffered: a child's log shows each line when
    it is written, not when the child exits."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", **extra}


@contextlib.contextmanager
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    """A list to put child processes in; every one is stopped on leaving."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    """Until `url` answers 200; `RuntimeError` when `proc` exits first or after `timeout` s."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not ready after {timeout:.0f} s")


def stderr_messages(stderr: str) -> list[str]:
    """The lines of a subcommand's stderr without its progress bars, which redraw in place
    (carriage returns, cursor-up escapes) and so share lines with the messages."""
    parts = (part.strip() for line in stderr.splitlines() for part in _REDRAW.split(line))
    return [part for part in parts if part and not _PROGRESS.search(part)]


_REDRAW = re.compile(r"\r|\x1b\[[0-9;]*[A-Za-z]")
_PROGRESS = re.compile(r"\|\s*\d+/\d+\s*\[")  # a tqdm bar: "|███  | 8/360 [00:02<..."
