"""`run_all`: rows in spec order whatever the workers, and a dead worker fails the call."""

from __future__ import annotations

import dataclasses
import os
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import pytest

from disaggpool.sim.runner import run_all


@dataclasses.dataclass(frozen=True)
class _Spec:
    """What `run_all` needs of a spec: a trace and instances (their sizes order the runs)."""

    n: int
    trace: tuple[int, ...]
    instances: tuple[int, ...] = (0,)


def _square(spec: _Spec) -> dict[str, Any]:
    return {"n": spec.n, "square": spec.n * spec.n}


def _dies_on_three(spec: _Spec) -> dict[str, Any]:
    if spec.n == 3:
        os._exit(9)  # a worker killed mid-run, as the kernel's OOM killer would
    return _square(spec)


def _specs() -> list[_Spec]:
    # Lengths rising with n, so the longest-first schedule runs them in reverse.
    return [_Spec(n, tuple(range(n))) for n in range(6)]


def test_rows_come_back_in_spec_order_with_every_progress_tick() -> None:
    ticks: list[int] = []
    rows = run_all(_specs(), workers=2, run=_square, progress=ticks.append)
    assert [r["n"] for r in rows] == list(range(6))
    assert [r["square"] for r in rows] == [n * n for n in range(6)]
    assert sum(ticks) == 6


def test_a_worker_that_dies_fails_the_call_instead_of_hanging_it() -> None:
    with pytest.raises(BrokenProcessPool):
        run_all(_specs(), workers=2, run=_dies_on_three)
