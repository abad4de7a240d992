"""Prefill and decode the llm-d way behind a real Envoy: the picker names the decode pod's
`disaggpool pd-proxy` as the destination (`gateway.destination_port`) and the prefill pod in
`x-prefiller-host-port`; the proxy runs the prefill leg there, then the decode leg on its engine
with the prefill's `kv_transfer_params`.

Each decode pod has a loopback address of its own (127.0.0.2, 127.0.0.3), so that both proxies
listen on the same port, as they do on pods in a cluster.
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

from envoy_testkit import running_envoy
from gateway_testkit import A40, MODEL, metric, sidecar_config

from disaggpool.emulator.config import EmulatorConfig
from disaggpool.emulator.harness import EmulatorThread
from disaggpool.formats.profiles import save_profile
from disaggpool.localpool.processes import free_port
from disaggpool.loopthread import LoopThread
from disaggpool.pdproxy.app import RunningProxy, start_proxy
from disaggpool.pdproxy.config import ProxyConfig
from disaggpool.sidecar.harness import SidecarThread


def _emulator(host: str) -> EmulatorThread:
    config = EmulatorConfig(A40, host=host, port=0, side_channel_port=0,
                            side_channel_host=host, jitter=0.0, model=MODEL)  # fmt: skip
    return EmulatorThread(config).start()


def test_envoy_picker_and_pd_proxy_run_both_legs(tmp_path: Path) -> None:
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    port = free_port()
    started: list[LoopThread] = []  # type: ignore[type-arg]
    try:
        p0 = _emulator("127.0.0.1")
        started.append(p0)
        decode = {}
        for i, host in enumerate(("127.0.0.2", "127.0.0.3")):
            emu = _emulator(host)
            started.append(emu)
            config = ProxyConfig(listen=f"{host}:{port}", model_server=emu.url)
            proxy: LoopThread[RunningProxy] = LoopThread(
                lambda c=config: start_proxy(c), name="pd-proxy"
            ).start()
            started.append(proxy)
            decode[f"d{i}"] = (emu, proxy, f"http://{host}:{port}")
        for name in ("p0", "d0", "d1"):
            save_profile(A40, profiles / f"{name}.yaml")
        static = {
            "prefill": [{"name": "p0", "url": p0.url}],
            "decode": [{"name": n, "url": emu.url} for n, (emu, _, _) in decode.items()],
        }
        sc = SidecarThread(
            sidecar_config(
                _NoPool(profiles),
                pool={"static": static},
                pd_decider=False,  # every request prefills remotely
                gateway={"destination_port": port},
            )
        ).start()
        started.append(sc)
        with running_envoy(tmp_path, epp_port=sc.running.ext_proc_port) as envoy:
            body = {"model": MODEL, "prompt": "tell me " * 40, "max_tokens": 6}
            req = urllib.request.Request(f"{envoy.url}/v1/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})  # fmt: skip
            with urllib.request.urlopen(req, timeout=60) as resp:
                answer = json.loads(resp.read())
            assert answer["usage"]["completion_tokens"] == 6
            chat = {"model": MODEL, "messages": [{"role": "user", "content": "hello " * 40}],
                    "max_tokens": 5, "stream": True}  # fmt: skip
            req = urllib.request.Request(f"{envoy.url}/v1/chat/completions",
                                         json.dumps(chat).encode(),
                                         {"Content-Type": "application/json"})  # fmt: skip
            with urllib.request.urlopen(req, timeout=60) as resp:
                lines = [x for x in resp.read().decode().splitlines() if x]
            assert lines[-1] == "data: [DONE]"
        # Both went through a proxy, prefilled on p0, and decoded with its KV.
        remote = sum(
            metric(url, "disaggpool_pd_proxy_requests_total", prefill="remote", code="200")
            for _, proxy, url in decode.values()
        )
        kv = sum(
            metric(url, "disaggpool_pd_proxy_decode_legs_total", kv="remote", outcome="ok")
            for _, _, url in decode.values()
        )
        assert remote == 2 and kv == 2
        deadline = time.monotonic() + 10
        while sc.call(lambda: sc.running.service.inflight):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert metric(sc.url, "disaggpool_route_decisions_total", role="prefill", pod="p0") == 2
        finished = sum(
            metric(sc.url, "disaggpool_requests_total", outcome=o) for o in ("met", "missed")
        )
        assert finished == 2
    finally:
        for thread in reversed(started):
            thread.stop()


class _NoPool:
    """`sidecar_config` wants a pool for its defaults; this test gives its own."""

    def __init__(self, profiles_dir: Path) -> None:
        self.profiles_dir = profiles_dir

    def urls(self, role: str) -> list[dict[str, str]]:
        return []
