"""Pods killed (SIGKILL, a real `disaggpool emulate` process) at the worst moments: a decode pod
right after the prefill leg answered (the request is retried on another decode pod and
answered), and a prefill pod in the middle of its leg (retried on another prefill pod)."""

from __future__ import annotations

import concurrent.futures
import json

from emulator_testkit import eventually
from faultkit import Accounting, Kit, metric, pod, post_json, sidecar_doc
from sidecar_testkit import A40


def test_a_decode_pod_killed_after_the_prefill_leg_is_replaced_by_another(kit: Kit) -> None:
    victim = kit.emulator_process(A40).wait_ready()
    survivor = kit.emulator()
    p0 = kit.emulator()
    prefill = kit.faulty(p0.url)  # the real prefill pod, behind a proxy that can act "after"
    killed: list[bool] = []

    def kill_the_decode_pod() -> None:
        if not killed:
            victim.kill()
            killed.append(True)

    prefill.after_prefill = kill_the_decode_pod
    sc = kit.sidecar(
        sidecar_doc(
            [pod("p0", prefill.url)],
            [pod("victim", victim.url), pod("survivor", survivor.url)],  # round-robin: victim 1st
            scrape_interval_s=30.0,  # no scrape finds it dead before the decode leg does
        )
    )
    books = Accounting(sc.url)
    for i in range(3):
        body = {"prompt": f"after prefill {i}", "max_tokens": 4}
        status, _, raw = post_json(f"{sc.url}/v1/completions", body)
        assert status == 200, raw
        assert json.loads(raw)["usage"]["completion_tokens"] == 4
    assert killed
    assert metric(sc.url, "disaggpool_route_decisions_total", role="decode", pod="victim") >= 1
    assert metric(sc.url, "disaggpool_decode_retries_total") >= 1
    assert metric(sc.url, "disaggpool_pod_healthy", pod="victim") == 0
    books.settle(sent=3, admitted=3)


def test_a_prefill_pod_killed_mid_leg_is_replaced_by_another(kit: Kit) -> None:
    victim = kit.emulator_process(A40.scaled(0.02)).wait_ready()  # a prefill leg of seconds
    survivor, d0 = kit.emulator(), kit.emulator()
    sc = kit.sidecar(
        sidecar_doc(
            [pod("victim", victim.url), pod("survivor", survivor.url)],  # round-robin: victim 1st
            [pod("d0", d0.url)],
            scrape_interval_s=30.0,
        )
    )
    books = Accounting(sc.url)
    prompt = " ".join(f"w{i}" for i in range(1500))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(
            post_json, f"{sc.url}/v1/completions", {"prompt": prompt, "max_tokens": 3}
        )

        def prefilling() -> None:
            assert metric(victim.url, "vllm:num_requests_running") == 1

        eventually(prefilling, timeout=10.0, interval=0.05)
        victim.kill()
        status, _, raw = answer.result(60)
    assert status == 200, raw
    assert json.loads(raw)["usage"]["completion_tokens"] == 3
    assert metric(sc.url, "disaggpool_prefill_retries_total") == 1
    assert metric(sc.url, "disaggpool_pod_healthy", pod="victim") == 0
    books.settle(sent=1, admitted=1)
