"""Fixtures of the fault suite: `kit` starts real sidecars, emulators and faulty pods on
loopback and stops them all afterwards (`faultkit.Kit`)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# The sidecar and emulator suites' helper modules (unique names, as their docstrings say).
_TESTS = Path(__file__).resolve().parents[1]
for _folder in ("sidecar", "emulator"):
    if str(_TESTS / _folder) not in sys.path:
        sys.path.insert(0, str(_TESTS / _folder))

from faultkit import Kit  # noqa: E402


@pytest.fixture
def kit(tmp_path: Path) -> Iterator[Kit]:
    k = Kit(tmp_path)
    try:
        yield k
    finally:
        k.close()
