"""A third-party benchmark client against the front door: `aiperf` and `disaggpool loadgen` through
`disaggpool sidecar` in front of an emulated pool agree (tests/aiperf_kit.py says what is checked).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from sidecar_testkit import A40, MODEL

from aiperf_kit import TIMEOUT_S, aiperf_agrees_with_loadgen, aiperf_binary


@pytest.fixture(scope="module")
def aiperf() -> Path:
    return aiperf_binary()


@pytest.mark.timeout(TIMEOUT_S)
def test_aiperf_through_the_front_door_agrees_with_loadgen(
    aiperf: Path, start_pool, start_sidecar, tmp_path: Path
) -> None:
    pool = start_pool([A40], [A40, A40])
    sc = start_sidecar(pool)
    aiperf_agrees_with_loadgen(aiperf, sc.url, MODEL, tmp_path)
