"""The front door end to end: real emulated pods, the real sidecar, real HTTP (and the openai
client), checking the two-step handoff, error shapes, failure handling and accounting."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from sidecar_testkit import A40, MODEL, metric, post

from disaggpool.formats.profiles import save_profile
from disaggpool.sidecar.harness import SidecarThread


def idle(sc: SidecarThread) -> bool:
    return sc.call(lambda: sc.running.service.inflight == 0)


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll `condition` until it holds; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


def test_openai_client_streaming_and_not(start_pool, start_sidecar) -> None:
    pool = start_pool([A40], [A40, A40])
    sc = start_sidecar(pool)
    client = openai.OpenAI(base_url=f"{sc.url}/v1", api_key="unused")
    done = client.completions.create(model=MODEL, prompt="tell me a story", max_tokens=7)
    assert done.usage is not None and done.usage.completion_tokens == 7
    assert done.usage.prompt_tokens == 5  # BOS + 4 words: counted by the decode pod itself
    assert done.choices[0].finish_reason == "length"

    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hello there"}],
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text.split()) == 5
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
    assert idle(sc)
    # Both requests went prefill -> decode: one prefill leg and one decode leg each.
    p0 = pool.emulator("p0")
    served_p = p0.call(lambda: p0.instance.metrics.request_success)
    assert sum(served_p.values()) == 2
    assert metric(sc.url, "disaggpool_requests_total", outcome="met") == 2


def test_bad_requests_name_the_field(start_pool, start_sidecar) -> None:
    pool = start_pool([A40], [A40])
    sc = start_sidecar(pool)
    url = f"{sc.url}/v1/completions"
    status, body = post(url, b"{not json")
    assert status == 400 and body["error"]["param"] == "body"
    status, body = post(url, {"prompt": "x", "max_tokens": "ten"})
    assert status == 400 and body["error"]["param"] == "max_tokens"
    status, body = post(url, {"prompt": 7})
    assert status == 400 and body["error"]["param"] == "prompt"
    status, body = post(url, {"prompt": "x", "slo_class": "platinum"})
    assert status == 400 and body["error"]["param"] == "slo_class"
    assert "interactive" in body["error"]["message"]
    status, body = post(url, {"prompt": "x", "kv_transfer_params": {}})
    assert status == 400 and body["error"]["param"] == "kv_transfer_params"
    status, body = post(url, {"model": "other", "prompt": "x"})
    assert status == 404 and body["error"]["param"] == "model"
    status, body = post(f"{sc.url}/v1/chat/completions", {"messages": []})
    assert status == 400 and body["error"]["param"] == "messages"
    # The SLO class may come as a header; an unknown one is refused the same way.
    status, body = post(url, {"prompt": "x", "max_tokens": 2}, {"X-SLO-Class": "batch"})
    assert status == 200
    assert metric(sc.url, "disaggpool_requests_total", slo_class="batch") == 1
    assert metric(sc.url, "disaggpool_rejected_requests_total", reason="bad_request") == 7


def test_prefill_failure_retries_on_another_prefill_pod(start_pool, start_sidecar) -> None:
    pool = start_pool([A40, A40], [A40])
    sc = start_sidecar(pool, scrape_interval_s=60.0)  # no scrape will notice the dead pod
    pool.emulator("p0").stop()
    pool.emulator("p1")
    for i in range(4):
        status, body = post(f"{sc.url}/v1/completions", {"prompt": f"q {i}", "max_tokens": 3})
        assert status == 200, body
        assert body["usage"]["completion_tokens"] == 3
    assert metric(sc.url, "disaggpool_prefill_retries_total") >= 1
    assert metric(sc.url, "disaggpool_upstream_failures_total", stage="prefill") >= 1
    assert idle(sc)


def start_emulator_process(profile_path: Path) -> tuple[subprocess.Popen[bytes], str]:
    """A separate emulator process, so that it can die abruptly (SIGKILL), mid-stream."""
    port = free_port()
    env = {**os.environ, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "disaggpool",
            "emulate",
            "--profile",
            str(profile_path),
            "--port",
            str(port),
            "--model",
            MODEL,
            "--jitter",
            "0",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if urllib.request.urlopen(f"{url}/health", timeout=1).status == 200:
                return proc, url
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("emulator process did not start")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_killing_a_decode_pod_mid_run_loses_no_request(start_pool, start_sidecar, tmp_path) -> None:
    slow = A40.scaled(0.5)
    pool = start_pool([A40], [slow])
    save_profile(slow, tmp_path / "slow.yaml")
    proc, url = start_emulator_process(tmp_path / "slow.yaml")
    try:
        decode = [*pool.urls("decode"), {"name": "victim", "url": url}]
        static = {"prefill": pool.urls("prefill"), "decode": decode}
        sc = start_sidecar(pool, policy="round_robin", pool={"static": static})
        client = openai.OpenAI(base_url=f"{sc.url}/v1", api_key="unused", max_retries=0)
        outcomes: list[str] = []
        lock = threading.Lock()

        def one(i: int) -> None:
            try:
                stream = client.completions.create(
                    model=MODEL, prompt=f"request {i}", max_tokens=60, stream=True
                )
                text = "".join(c.choices[0].text for c in stream if c.choices)
                result = "ok" if len(text.split()) == 60 else "short"
            except openai.APIError as exc:
                result = f"error:{type(exc).__name__}"
            with lock:
                outcomes.append(result)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
        for t in threads[:8]:
            t.start()
        wait_until(
            lambda: metric(url, "vllm:num_requests_running") >= 1, 30, "the victim to be decoding"
        )
        proc.send_signal(signal.SIGKILL)  # dies with requests streaming from it
        proc.wait(10)
        for t in threads[8:]:
            t.start()
            time.sleep(0.1)  # staggered arrivals, not a wait for a condition
        for t in threads:
            t.join(120)
    finally:
        proc.kill()
    assert len(outcomes) == 16
    ok = outcomes.count("ok")
    failed = 16 - ok
    assert "short" not in outcomes  # a cut stream is reported as an error, never as a success
    # The kill hit requests on the victim: those already streaming got a clear error, those that
    # had not seen their first event were retried on the surviving pod and answered...
    retried = metric(sc.url, "disaggpool_decode_retries_total")
    assert failed + retried >= 1
    assert ok >= 8  # ...and the later ones went to the surviving pod
    assert idle(sc)
    met = metric(sc.url, "disaggpool_requests_total", outcome="met")
    missed = metric(sc.url, "disaggpool_requests_total", outcome="missed")
    lost = metric(sc.url, "disaggpool_requests_total", outcome="failed")
    assert met + missed == ok and lost == failed  # the counts add up


async def completions(
    url: str,
    *,
    waves: int,
    per_wave: int,
    base: int,
    step: int,
    max_tokens: int,
    stream: bool = False,
) -> None:
    """`waves` rounds of `per_wave` concurrent completions, request i of `base + step * i`
    words, each expected to succeed; `stream`: streamed (the router then times every token)."""
    import aiohttp

    async with aiohttp.ClientSession() as s:

        async def one(i: int) -> None:
            body = {
                "prompt": "word " * (base + step * i),
                "max_tokens": max_tokens,
                "ignore_eos": True,
                "stream": stream,
            }
            async with s.post(f"{url}/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                await r.read()

        for wave in range(waves):
            await asyncio.gather(*(one(per_wave * wave + i) for i in range(per_wave)))


def test_calibrated_sends_less_work_to_a_slower_pod(start_pool, start_sidecar) -> None:
    pool = start_pool([A40.scaled(3.0)], [A40, A40.scaled(0.35)])
    sc = start_sidecar(pool, slo_classes=[{"name": "chat", "ttft_s": 3.0, "tpot_s": 0.06}])

    asyncio.run(completions(sc.url, waves=6, per_wave=8, base=50, step=7, max_tokens=40))
    fast = metric(sc.url, "disaggpool_route_decisions_total", role="decode", pod="d0")
    slow = metric(sc.url, "disaggpool_route_decisions_total", role="decode", pod="d1")
    assert fast + slow == 48
    assert slow < 0.35 * fast, (fast, slow)


def test_client_disconnect_aborts_the_upstream_request(start_pool, start_sidecar) -> None:
    pool = start_pool([A40], [A40.scaled(0.2)])
    sc = start_sidecar(pool)
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", sc.running.http_port, timeout=30)
    body = json.dumps({"prompt": "go", "max_tokens": 2000, "ignore_eos": True, "stream": True})
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    resp.readline()  # the first event arrived: decoding on d0
    d0 = pool.emulator("d0")
    assert d0.call(lambda: d0.instance.decode.engine.num_running) == 1
    conn.close()
    wait_until(
        lambda: idle(sc) and d0.call(lambda: d0.instance.decode.engine.num_running) == 0,
        10,
        "the sidecar to forget the request and d0 to abort it (vLLM-side abort)",
    )
    assert metric(sc.url, "disaggpool_requests_total", outcome="aborted") == 1


def test_overload_answers_429_with_retry_after(start_pool, start_sidecar) -> None:
    pool = start_pool([A40], [A40.scaled(0.2)])
    sc = start_sidecar(pool, max_inflight=2)

    async def flood() -> list[tuple[int, str | None]]:
        import aiohttp

        async with aiohttp.ClientSession() as s:

            async def one() -> tuple[int, str | None]:
                body = {"prompt": "x", "max_tokens": 100, "ignore_eos": True}
                async with s.post(f"{sc.url}/v1/completions", json=body) as r:
                    await r.read()
                    return r.status, r.headers.get("Retry-After")

            return await asyncio.gather(*(one() for _ in range(6)))

    results = asyncio.run(flood())
    assert sorted(s for s, _ in results).count(200) == 2
    assert all(ra == "1" for s, ra in results if s == 429)
    assert sum(1 for s, _ in results if s == 429) == 4
    assert metric(sc.url, "disaggpool_rejected_requests_total", reason="overload") == 4


@pytest.mark.parametrize("stop_role", ["prefill", "decode"])
def test_health_reports_no_capacity(start_pool, start_sidecar, stop_role) -> None:
    pool = start_pool([A40], [A40])
    sc = start_sidecar(pool)
    assert urllib.request.urlopen(f"{sc.url}/health").status == 200
    pool.emulator("p0" if stop_role == "prefill" else "d0").stop()
    sc.run(sc.running.collectors.scrape_once)
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(f"{sc.url}/health")
    assert err.value.code == 503
    status, body = post(f"{sc.url}/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert status == 503 and body["error"]["code"] == 503


@pytest.mark.parametrize("switch", [{"decode_binding": "late"}, {"local_prefill_below": 10_000}])
def test_late_binding_and_the_local_path_serve_every_request(
    start_pool, start_sidecar, switch: dict[str, object]
) -> None:
    """Late binding chooses the decode pod after the prefill leg; the local path sends the
    request to a decode pod as a plain request (no prefill leg, no kv_transfer_params)."""
    pool = start_pool([A40], [A40, A40])
    sc = start_sidecar(pool, **switch)
    client = openai.OpenAI(base_url=f"{sc.url}/v1", api_key="unused", max_retries=0)
    for i in range(6):
        done = client.completions.create(model=MODEL, prompt=f"tell me story {i}", max_tokens=5)
        assert done.usage is not None and done.usage.completion_tokens == 5
    chunks = list(
        client.completions.create(model=MODEL, prompt="stream it", max_tokens=4, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices).split()
    assert idle(sc)
    assert metric(sc.url, "disaggpool_requests_total", outcome="failed") == 0
    decode_routed = metric(sc.url, "disaggpool_route_decisions_total", role="decode")
    assert decode_routed == 7
    prefill_legs = metric(pool.emulator("p0").url, "vllm:request_success_total")
    local = metric(sc.url, "disaggpool_local_prefills_total")
    if "local_prefill_below" in switch:
        assert (local, prefill_legs) == (7, 0)  # the prefill pod never saw a request
    else:
        assert (local, prefill_legs) == (0, 7)


@pytest.mark.parametrize("engines", ["fcfs", "priority"])
def test_priority_scheduling_sends_the_decisions_priority_on_both_legs(
    start_pool, start_sidecar, engines: str
) -> None:
    """With a TTFT target no pod can meet, every request is predicted late and goes out with
    priority 1 (plus the client's own): engines scheduling by priority serve it; FCFS engines
    refuse a non-zero priority, as vLLM does, which shows it reached them. Without the switch
    nothing is added, and FCFS engines serve the same requests."""
    pool = start_pool([A40], [A40], scheduling_policy=engines)
    hopeless = [{"name": "chat", "ttft_s": 1e-6, "tpot_s": 1.0}]
    sc = start_sidecar(pool, slo_classes=hopeless, priority_scheduling=True)
    plain = start_sidecar(pool, slo_classes=hopeless)
    body = {"model": MODEL, "prompt": "a late one", "max_tokens": 3}
    status, out = post(f"{sc.url}/v1/completions", body)
    if engines == "priority":
        assert status == 200 and out["usage"]["completion_tokens"] == 3
    else:
        assert status == 400 and "Priority scheduling is not enabled" in out["error"]["message"]
    status, out = post(f"{plain.url}/v1/completions", body)
    assert status == 200
    status, out = post(f"{sc.url}/v1/completions", {**body, "priority": "high"})
    assert status == 400 and out["error"]["param"] == "priority"
    assert idle(sc) and idle(plain)


def test_a_clients_priority_reaches_the_engines_only_when_allowed(
    start_pool, start_sidecar
) -> None:
    """FCFS engines refuse a non-zero priority, as vLLM does: a 200 shows it was dropped, a 400
    that it reached them."""
    pool = start_pool([A40], [A40], scheduling_policy="fcfs")
    body = {"model": MODEL, "prompt": "me first", "max_tokens": 3, "priority": 5}
    status, _ = post(f"{start_sidecar(pool).url}/v1/completions", body)
    assert status == 200
    status, out = post(
        f"{start_sidecar(pool, forward_client_priority=True).url}/v1/completions", body
    )
    assert status == 400 and "Priority scheduling is not enabled" in out["error"]["message"]


def test_the_routers_autoscaler_reads_the_traffic_it_routes(start_pool, start_sidecar) -> None:
    """The decode autoscaler on live traffic through the front door (metrics only: no pool to
    write to): it sees the arrivals and completions and recommends within its bounds."""
    pool = start_pool([A40.scaled(3.0)], [A40])
    sc = start_sidecar(pool, autoscaling={"min_replicas": 1, "max_replicas": 4, "period_s": 0.2})
    assert metric(sc.url, "disaggpool_demand_requests_per_second") == 0.0

    asyncio.run(completions(sc.url, waves=1, per_wave=24, base=40, step=5, max_tokens=30))
    wait_until(
        lambda: (
            metric(sc.url, "disaggpool_demand_requests_per_second") > 0
            and metric(sc.url, "disaggpool_autoscaler_desired_decode_replicas") >= 1
        ),
        10,
        "the autoscaler's first recommendation after the burst",
    )
    assert 1 <= metric(sc.url, "disaggpool_autoscaler_desired_decode_replicas") <= 4
    rate = metric(sc.url, "disaggpool_demand_requests_per_second")
    tokens = metric(sc.url, "disaggpool_demand_tokens_per_second")
    assert tokens > 30 * rate  # every request carried 40+ prompt and 30 output tokens
    # What a decode slot holds: a prompt of 40+ tokens and half of the 30 generated.
    assert metric(sc.url, "disaggpool_demand_decode_context_tokens") > 40 + 15
    assert 0 < metric(sc.url, "disaggpool_demand_decode_context_cv") < 1
    service = sc.running.service
    assert service.demand.demand(service.clock()).finished == 24
    assert metric(sc.url, "disaggpool_pool_status_failures_total") == 0


def test_draining_fails_health_closes_connections_and_finishes_what_is_in_flight(
    start_pool, start_sidecar
) -> None:
    """What SIGTERM does (`RunningSidecar.drain`): for `shutdown_delay_s` the router still
    serves, but its HTTP and gRPC health say it is going and every answer closes its connection;
    then it stops listening, and a request already in flight still completes."""
    pool = start_pool([A40], [A40])
    sc = start_sidecar(pool, shutdown_delay_s=1.5)
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 200, "ignore_eos": True}
    slow: dict[str, tuple[int, Any]] = {}
    in_flight = threading.Thread(
        target=lambda: slow.update(answer=post(f"{sc.url}/v1/completions", body))
    )
    in_flight.start()
    wait_until(lambda: not idle(sc), 10, "the long request to be in flight")
    drain = threading.Thread(target=lambda: sc.run(lambda: sc.running.drain(), timeout=60))
    drain.start()
    wait_until(lambda: sc.call(lambda: sc.running.service.draining), 5, "the drain to begin")

    with pytest.raises(urllib.error.HTTPError) as health:
        urllib.request.urlopen(f"{sc.url}/health", timeout=5)
    assert health.value.code == 503
    assert json.loads(health.value.read())["status"].startswith("draining")
    with grpc.insecure_channel(sc.grpc_target) as channel:
        check = health_pb2_grpc.HealthStub(channel).Check
        got = check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    assert got.status == health_pb2.HealthCheckResponse.NOT_SERVING

    conn = http.client.HTTPConnection("127.0.0.1", sc.running.http_port, timeout=30)
    short = {**body, "max_tokens": 3}
    conn.request("POST", "/v1/completions", json.dumps(short), {"Content-Type": "application/json"})
    answer = conn.getresponse()
    assert answer.status == 200 and answer.getheader("Connection") == "close"
    assert json.loads(answer.read())["usage"]["completion_tokens"] == 3
    conn.close()

    drain.join(60)
    in_flight.join(60)
    status, done = slow["answer"]
    assert status == 200 and done["usage"]["completion_tokens"] == 200
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"{sc.url}/health", timeout=5)
