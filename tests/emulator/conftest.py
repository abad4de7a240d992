"""Fixtures for the emulator tests: emulators on free loopback ports and an HTTP client."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from emulator_testkit import H100, Http

from disaggpool.core.profile import CalibrationProfile
from disaggpool.emulator.config import EmulatorConfig
from disaggpool.emulator.harness import EmulatorThread


@pytest.fixture
def http() -> Http:
    return Http()


@pytest.fixture
def start_emulator() -> Iterator[Callable[..., EmulatorThread]]:
    """start(profile=H100, **config) -> a running emulator on free ports, stopped afterwards."""
    running: list[EmulatorThread] = []

    def start(profile: CalibrationProfile = H100, **overrides: Any) -> EmulatorThread:
        settings: dict[str, Any] = {
            "port": 0,
            "side_channel_port": 0,
            "side_channel_host": "127.0.0.1",
            "jitter": 0.0,
        }
        settings.update(overrides)
        emu = EmulatorThread(EmulatorConfig(profile, **settings)).start()
        running.append(emu)
        return emu

    yield start
    for emu in running:
        emu.stop()
