"""The endpoint picker behind a real Envoy 1.40, in front of real emulated pods (one prefill, two
decode pods of different speeds, each decode pod behind a recorder of what it received).

Without `disaggpool pd-proxy`, the destination is the decode pod itself, which prefills locally
and ignores `x-prefiller-host-port`: these tests check the picker's choice and books, and what
reaches the pod; docs/gateway.md says what the client gets in each failure.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from envoy_testkit import Recorder, envoy_binary, running_envoy
from gateway_testkit import A40, MODEL, Pool, metric, sidecar_config, start_pool

from disaggpool.localpool.processes import free_port
from disaggpool.sidecar.envoy_config import envoy_config, render
from disaggpool.sidecar.harness import SidecarThread

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "envoy-gateway.yaml"
SLO = [{"name": "chat", "ttft_s": 3.0, "tpot_s": 0.06}]


@pytest.fixture(scope="module")
def gateway_pool(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Pool, dict[str, Recorder]]]:
    """p0, a fast d0 and a slow d1; the sidecar reaches each decode pod through its recorder."""
    pool = start_pool(tmp_path_factory.mktemp("gw"), [A40.scaled(3.0)], [A40, A40.scaled(0.35)])
    recorders = {n: Recorder(pool.pods[n][1].url).start() for n in ("d0", "d1")}
    yield pool, recorders
    for r in recorders.values():
        r.stop()
    pool.stop()


def _sidecar(pool: Pool, recorders: dict[str, Recorder], **overrides: Any) -> SidecarThread:
    decode = [{"name": n, "url": r.url} for n, r in recorders.items()]
    static = {"prefill": pool.urls("prefill"), "decode": decode}
    return SidecarThread(sidecar_config(pool, pool={"static": static}, **overrides)).start()


def _post(url: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _envoy_stat(admin: str, name: str) -> int:
    text = urllib.request.urlopen(f"{admin}/stats?filter=^{name}$", timeout=10).read().decode()
    return int(text.strip().rpartition(": ")[2])


def _idle(sc: SidecarThread, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while sc.call(lambda: sc.running.service.inflight):
        assert time.monotonic() < deadline, "requests stayed in the picker's books"
        time.sleep(0.05)


def test_the_example_is_the_generator_output_and_envoy_validates_it(tmp_path) -> None:
    text = EXAMPLE.read_text()
    body = text[text.index("admin:") :]
    assert body == render(envoy_config(token="REPLACE-WITH-grpc.token_file"))
    out = subprocess.run(
        [str(envoy_binary()), "--mode", "validate", "-c", str(EXAMPLE), "--disable-hot-restart"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "OK" in out.stdout + out.stderr


def test_completions_and_streaming_chat_through_envoy(gateway_pool, tmp_path) -> None:
    pool, recorders = gateway_pool
    sc = _sidecar(pool, recorders, pd_decider=False)  # every decision has a remote prefill
    try:
        with running_envoy(tmp_path, epp_port=sc.running.ext_proc_port) as envoy:
            before = {n: len(r.seen) for n, r in recorders.items()}
            body = {"model": MODEL, "prompt": "hello " * 30, "max_tokens": 5}
            status, raw = _post(f"{envoy.url}/v1/completions", body)
            assert status == 200, raw
            assert json.loads(raw)["usage"]["completion_tokens"] == 5
            got = [
                (n, r.seen[before[n] :]) for n, r in recorders.items() if len(r.seen) > before[n]
            ]
            assert len(got) == 1, got  # one decode pod received it
            [(name, [(path, headers)])] = got
            assert path == "/v1/completions"
            assert headers["x-gateway-destination-endpoint"] == recorders[name].address
            assert headers["x-prefiller-host-port"] == pool.address("p0")
            assert headers["x-request-id"]
            # Full duplex: Envoy drops Content-Length and sends the body chunked (docs/gateway.md).
            assert "content-length" not in headers
            assert headers["transfer-encoding"] == "chunked"

            chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi " * 20}],
                    "max_tokens": 6, "stream": True}  # fmt: skip
            req = urllib.request.Request(f"{envoy.url}/v1/chat/completions",
                                         json.dumps(chat).encode(),
                                         {"Content-Type": "application/json"})  # fmt: skip
            with urllib.request.urlopen(req, timeout=60) as resp:
                assert resp.headers["Content-Type"].startswith("text/event-stream")
                lines = [line for line in resp.read().decode().splitlines() if line]
            assert lines[-1] == "data: [DONE]"
            assert sum('"content"' in line for line in lines) >= 5
        _idle(sc)
        served = metric(sc.url, "disaggpool_requests_total", outcome="met") + metric(
            sc.url, "disaggpool_requests_total", outcome="missed"
        )
        assert served == 2
        assert metric(sc.url, "disaggpool_epp_responses_total", code="200") == 2
    finally:
        sc.stop()


def test_calibrated_steers_away_from_the_slow_pod_and_the_books_match_envoy(
    gateway_pool, tmp_path
) -> None:
    pool, recorders = gateway_pool
    sc = _sidecar(pool, recorders, slo_classes=SLO)
    steer = {"x-gateway-destination-endpoint": recorders["d1"].address,  # the slow pod
             "x-prefiller-host-port": "198.18.0.201:1"}  # fmt: skip
    try:
        with running_envoy(tmp_path, epp_port=sc.running.ext_proc_port) as envoy:
            before = {n: len(r.seen) for n, r in recorders.items()}

            async def waves() -> list[int]:
                statuses: list[int] = []
                async with aiohttp.ClientSession() as s:

                    async def one(i: int) -> None:
                        body = {"model": MODEL, "prompt": "w " * (50 + 7 * i), "max_tokens": 40}
                        async with s.post(f"{envoy.url}/v1/completions", json=body,
                                          headers=steer) as r:  # fmt: skip
                            await r.read()
                            statuses.append(r.status)

                    for wave in range(6):
                        await asyncio.gather(*(one(8 * wave + i) for i in range(8)))
                return statuses

            assert asyncio.run(waves()) == [200] * 48
            served_by_envoy = _envoy_stat(envoy.admin, "cluster.pool.upstream_rq_2xx")
        _idle(sc)
        served = {n: r.seen[before[n] :] for n, r in recorders.items()}
        decided = {
            n: metric(sc.url, "disaggpool_route_decisions_total", role="decode", pod=n)
            for n in recorders
        }
        # What each pod served is what the picker booked for it.
        assert {n: len(s) for n, s in served.items()} == decided
        assert decided["d1"] < 0.35 * decided["d0"], decided
        # The client's steering headers never reached a pod as the client wrote them.
        for name, seen in served.items():
            for _, headers in seen:
                assert headers["x-gateway-destination-endpoint"] == recorders[name].address
                assert headers.get("x-prefiller-host-port") in (None, pool.address("p0"))
        finished = sum(
            metric(sc.url, "disaggpool_requests_total", outcome=o) for o in ("met", "missed")
        )
        assert finished == 48 == metric(sc.url, "disaggpool_epp_responses_total", code="200")
        assert served_by_envoy == 48  # Envoy's own count of answers from the pool
    finally:
        sc.stop()


def test_a_local_prefill_removes_a_client_supplied_prefiller_header(gateway_pool, tmp_path) -> None:
    pool, recorders = gateway_pool
    sc = _sidecar(pool, recorders, local_prefill_below=100_000)  # every prompt prefills locally
    try:
        with running_envoy(tmp_path, epp_port=sc.running.ext_proc_port) as envoy:
            before = {n: len(r.seen) for n, r in recorders.items()}
            status, raw = _post(f"{envoy.url}/v1/completions",
                                {"model": MODEL, "prompt": "hi", "max_tokens": 2},
                                {"x-prefiller-host-port": "198.18.0.201:1"})  # fmt: skip
            assert status == 200, raw
        [headers] = [h for n, r in recorders.items() for _, h in r.seen[before[n] :]]
        assert "x-prefiller-host-port" not in headers
    finally:
        sc.stop()


def test_refusals_reach_the_client_as_the_picker_wrote_them(
    gateway_pool, tmp_path, keys_file
) -> None:
    pool, recorders = gateway_pool
    hopeless = [*SLO, {"name": "hopeless", "ttft_s": 1e-6, "tpot_s": 1e-7, "sheddable": True}]
    sc = _sidecar(pool, recorders, slo_classes=hopeless, auth={"api_keys_file": str(keys_file)})
    key = {"Authorization": "Bearer client-key"}
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    try:
        with running_envoy(tmp_path, epp_port=sc.running.ext_proc_port) as envoy:
            url = f"{envoy.url}/v1/completions"
            status, raw = _post(url, body)
            assert status == 401 and json.loads(raw)["error"]["param"] == "authorization"
            status, raw = _post(url, body, {**key, "X-SLO-Class": "hopeless"})
            assert status == 429, raw  # shed: it would miss its SLO
            status, raw = _post(url, {"prompt": "hi", "max_tokens": "x"}, key)
            assert status == 400 and json.loads(raw)["error"]["param"] == "max_tokens"
            status, raw = _post(url, body, key)
            assert status == 200, raw
        with running_envoy(tmp_path, epp_port=sc.running.ext_proc_port, subset_hint=[]) as envoy:
            status, raw = _post(f"{envoy.url}/v1/completions", body, key)
            assert status == 503 and b"subset hint" in raw
        with running_envoy(tmp_path, epp_port=sc.running.ext_proc_port,
                           subset_hint=[recorders["d1"].address]) as envoy:  # fmt: skip
            before = len(recorders["d1"].seen)
            status, raw = _post(f"{envoy.url}/v1/completions", body, key)
            assert status == 200 and len(recorders["d1"].seen) == before + 1
        assert metric(sc.url, "disaggpool_epp_decisions_total", code="429") == 1
        assert metric(sc.url, "disaggpool_epp_decisions_total", code="401") == 1
    finally:
        sc.stop()


def test_no_healthy_pod_is_503(tmp_path) -> None:
    pool = Pool({}, tmp_path)
    dead = {
        "prefill": [{"name": "p0", "url": f"http://127.0.0.1:{free_port()}"}],
        "decode": [{"name": "d0", "url": f"http://127.0.0.1:{free_port()}"}],
    }
    sc = SidecarThread(sidecar_config(pool, pool={"static": dead})).start()
    try:
        with running_envoy(
            tmp_path, epp_port=sc.running.ext_proc_port, health_check=False
        ) as envoy:
            status, raw = _post(f"{envoy.url}/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert status == 503, raw
        assert json.loads(raw)["error"]["type"] == "ServiceUnavailableError"
    finally:
        sc.stop()


def test_the_picker_down_or_refusing_envoy_is_a_500(gateway_pool, tmp_path) -> None:
    with running_envoy(tmp_path, epp_port=free_port(), health_check=False) as envoy:
        status, _ = _post(f"{envoy.url}/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert status == 500  # nothing listens: Envoy fails closed
    pool, recorders = gateway_pool
    token = tmp_path / "token"
    token.write_text("envoy-token\n")
    sc = _sidecar(pool, recorders, grpc={"token_file": str(token)})
    try:
        port = sc.running.ext_proc_port
        with running_envoy(tmp_path, epp_port=port) as envoy:  # no token
            status, _ = _post(f"{envoy.url}/v1/completions", {"prompt": "hi", "max_tokens": 2})
            assert status == 500
        with running_envoy(tmp_path, epp_port=port, token="envoy-token") as envoy:
            status, raw = _post(f"{envoy.url}/v1/completions", {"prompt": "hi", "max_tokens": 2})
            assert status == 200, raw
        assert metric(sc.url, "disaggpool_auth_failures_total", port="ext_proc") >= 1
    finally:
        sc.stop()


def test_a_destination_that_refuses_is_envoys_503_booked_failed(tmp_path) -> None:
    """`gateway.destination_port` names a port nothing listens on (no pd-proxy beside the pod):
    the picker, which scrapes the pod on its own port, routes; Envoy cannot connect."""
    pool = start_pool(tmp_path, [A40], [A40])
    sc = SidecarThread(sidecar_config(pool, gateway={"destination_port": free_port()})).start()
    try:
        with running_envoy(tmp_path, epp_port=sc.running.ext_proc_port) as envoy:
            status, raw = _post(f"{envoy.url}/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert status == 503 and b"upstream connect error" in raw
        _idle(sc)
        assert metric(sc.url, "disaggpool_requests_total", outcome="failed") == 1
        assert metric(sc.url, "disaggpool_epp_responses_total", code="503") == 1
    finally:
        sc.stop()
        pool.stop()


def test_a_client_that_leaves_mid_stream_is_booked_aborted(gateway_pool, tmp_path) -> None:
    import http.client

    pool, recorders = gateway_pool
    sc = _sidecar(pool, recorders)
    try:
        with running_envoy(tmp_path, epp_port=sc.running.ext_proc_port) as envoy:
            port = int(envoy.url.rpartition(":")[2])
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            body = {"prompt": "go", "max_tokens": 2000, "ignore_eos": True, "stream": True}
            conn.request("POST", "/v1/completions", json.dumps(body),
                         {"Content-Type": "application/json"})  # fmt: skip
            resp = conn.getresponse()
            assert resp.status == 200
            assert resp.readline().startswith(b"data: ")  # decoding
            assert sc.call(lambda: sc.running.service.inflight) == 1
            conn.close()
            _idle(sc)
        assert metric(sc.url, "disaggpool_requests_total", outcome="aborted") == 1
    finally:
        sc.stop()


def test_large_bodies_pass_in_chunks_and_too_large_ones_are_413(gateway_pool, tmp_path) -> None:
    pool, recorders = gateway_pool
    sc = _sidecar(pool, recorders, max_body_bytes=1024 * 1024)
    try:
        with running_envoy(tmp_path, epp_port=sc.running.ext_proc_port) as envoy:
            prompt = ("lorem" * 200 + " ") * 300  # 300 KB in 300 tokens: five chunks back
            status, raw = _post(f"{envoy.url}/v1/completions", {"prompt": prompt, "max_tokens": 2})
            assert status == 200, raw
            assert json.loads(raw)["usage"]["prompt_tokens"] >= 300  # the pod read it whole
            status, raw = _post(f"{envoy.url}/v1/completions", {"prompt": "x" * 2_000_000})
            assert status == 413 and json.loads(raw)["error"]["param"] == "body"
    finally:
        sc.stop()


def test_beyond_max_inflight_is_429_through_envoy(gateway_pool, tmp_path) -> None:
    import http.client

    pool, recorders = gateway_pool
    sc = _sidecar(pool, recorders, max_inflight=1)
    try:
        with running_envoy(tmp_path, epp_port=sc.running.ext_proc_port) as envoy:
            port = int(envoy.url.rpartition(":")[2])
            held = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            body = {"prompt": "go", "max_tokens": 2000, "ignore_eos": True, "stream": True}
            held.request("POST", "/v1/completions", json.dumps(body),
                         {"Content-Type": "application/json"})  # fmt: skip
            resp = held.getresponse()
            assert resp.status == 200 and resp.readline().startswith(b"data: ")
            status, raw = _post(f"{envoy.url}/v1/completions", {"prompt": "hi", "max_tokens": 2})
            assert status == 429 and json.loads(raw)["error"]["type"] == "RateLimitError"
            held.close()
            _idle(sc)
            status, raw = _post(f"{envoy.url}/v1/completions", {"prompt": "hi", "max_tokens": 2})
            assert status == 200, raw
    finally:
        sc.stop()


def test_buffered_mode_through_envoy(gateway_pool, tmp_path) -> None:
    pool, recorders = gateway_pool
    sc = _sidecar(pool, recorders)
    try:
        with running_envoy(
            tmp_path, epp_port=sc.running.ext_proc_port, body_mode="BUFFERED"
        ) as envoy:
            before = {n: len(r.seen) for n, r in recorders.items()}
            steer = {"x-gateway-destination-endpoint": "198.18.0.201:1"}
            status, raw = _post(f"{envoy.url}/v1/completions",
                                {"prompt": "hi " * 20, "max_tokens": 3}, steer)  # fmt: skip
            assert status == 200, raw
            chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                    "stream": True}  # fmt: skip
            status, raw = _post(f"{envoy.url}/v1/chat/completions", chat)
            assert status == 200 and raw.decode().rstrip().endswith("data: [DONE]")
        got = {n: r.seen[before[n] :] for n, r in recorders.items()}
        assert sum(len(s) for s in got.values()) == 2
        for name, seen in got.items():
            for _, headers in seen:
                assert headers["x-gateway-destination-endpoint"] == recorders[name].address
                assert int(headers["content-length"]) > 0  # buffered: it survives
        _idle(sc)
        finished = sum(
            metric(sc.url, "disaggpool_requests_total", outcome=o) for o in ("met", "missed")
        )
        assert finished == 2
    finally:
        sc.stop()
