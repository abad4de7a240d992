"""Tests of `disaggpool.progress`: bars on a terminal, nothing in a redirected log."""

from __future__ import annotations

import io

import pytest

from disaggpool import cli, progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_bar_draws_on_a_terminal_only() -> None:
    log, tty = io.StringIO(), Terminal()
    for stream in (log, tty):
        bar = progress.bar(total=3, desc="requests", file=stream)
        for _ in range(3):
            bar.update(1)
        bar.close()
    assert log.getvalue() == ""
    assert "requests" in tty.getvalue() and "3/3" in tty.getvalue()
    # Wrapping an iterable, a disabled bar still yields every item.
    assert list(progress.bar(range(4), file=io.StringIO())) == [0, 1, 2, 3]


def test_the_commands_progress_draws_nothing_into_a_redirected_stderr(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`calibrate`, `plan` and the `sim` experiments report progress through this callback;
    their stderr captured here is not a terminal, as in a Job's log."""
    update = cli._progress("calibrate")
    for done in range(1, 6):
        update("prefill", done, 5)
    assert capsys.readouterr().err == ""
