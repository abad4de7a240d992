"""Fixtures for the P/D proxy tests: real emulated vLLM pods on loopback, a proxy in front of the
decode pod (in this process, on its own loop), and a few helpers."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from pdproxy_testkit import MODEL, ProxyThread

from disaggpool.core.hardware import builtin_profile
from disaggpool.emulator.config import EmulatorConfig
from disaggpool.emulator.harness import EmulatorThread
from disaggpool.pdproxy.config import ProxyConfig

A40 = builtin_profile("a40-llama3-8b")


@pytest.fixture
def start_emulator() -> Iterator[Callable[..., EmulatorThread]]:
    running: list[EmulatorThread] = []

    def start(**settings: Any) -> EmulatorThread:
        config = EmulatorConfig(
            A40,
            **{
                "port": 0,
                "side_channel_port": 0,
                "side_channel_host": "127.0.0.1",
                "jitter": 0.0,
                "model": MODEL,
                **settings,
            },
        )
        emu = EmulatorThread(config).start()
        running.append(emu)
        return emu

    yield start
    for emu in running:
        emu.stop()


@pytest.fixture
def start_proxy() -> Iterator[Callable[..., ProxyThread]]:
    """start(decode_emulator_url, **ProxyConfig fields) -> a running proxy on a free port."""
    running: list[ProxyThread] = []

    def start(model_server: str, **options: Any) -> ProxyThread:
        proxy = ProxyThread(ProxyConfig("127.0.0.1:0", model_server, **options)).start()
        running.append(proxy)
        return proxy

    yield start
    for proxy in running:
        proxy.stop()
