"""Malformed metrics pages: NaN, +/-Inf, garbage and non-UTF-8 each count as one malformed scrape
of that pod and nothing else (the scrape loop goes on, the pod stays in the pool, the other pods
are untouched), and a pod ejected by a failed leg comes back once it scrapes and serves again."""

from __future__ import annotations

import urllib.error
import urllib.request

from emulator_testkit import eventually
from faultkit import Accounting, Kit, metric, pod, post_json, sidecar_doc
from faultypod_kit import Reset, vllm_metrics_page

BAD_PAGES = {
    "nan": vllm_metrics_page(running="NaN"),
    "+inf": vllm_metrics_page(waiting="+Inf"),
    "-inf": vllm_metrics_page(running="-Inf"),
    "garbage": b"<html>502 Bad Gateway</html>\n\x00\x01 vllm:num_requests_running{ NaN\n",
    "non-utf-8": vllm_metrics_page().replace(b'engine="0"', b'engine="\xff\xfe"'),
}


def livez(url: str) -> int:
    try:
        with urllib.request.urlopen(f"{url}/livez", timeout=5) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def test_malformed_metrics_pages_are_one_failed_scrape_and_an_ejected_pod_returns(
    kit: Kit,
) -> None:
    emu = kit.emulator()
    flaky = kit.faulty(emu.url)  # a real pod behind it, whose pages and legs it may break
    p1, d0 = kit.emulator(), kit.emulator()
    sc = kit.sidecar(sidecar_doc([pod("flaky", flaky.url), pod("p1", p1.url)], [pod("d0", d0.url)]))
    books = Accounting(sc.url)

    def healthy(name: str) -> float:
        return metric(sc.url, "disaggpool_pod_healthy", pod=name)

    for kind, page in BAD_PAGES.items():
        seen = flaky.scrapes
        flaky.metrics_pages.append(page)

        def served_and_scraped_again(seen: int = seen, kind: str = kind) -> None:
            assert not flaky.metrics_pages and flaky.scrapes >= seen + 2, (
                f"no scrape of the pod since its {kind} page ({flaky.scrapes - seen} in all)"
            )

        eventually(served_and_scraped_again, timeout=5.0)
        assert (healthy("flaky"), healthy("p1"), healthy("d0")) == (1, 1, 1), kind
    failures = metric(sc.url, "disaggpool_scrape_failures_total", pod="flaky", reason="malformed")
    assert failures == len(BAD_PAGES)
    assert metric(sc.url, "disaggpool_scrape_failures_total", pod="p1") == 0
    assert livez(sc.url) == 200

    # One failed prefill leg ejects it; its request is answered by the other prefill pod.
    flaky.once("prefill", Reset())
    for i in range(2):  # round-robin: one of the two meets it
        status, _, raw = post_json(f"{sc.url}/v1/completions", {"prompt": f"e{i}", "max_tokens": 2})
        assert status == 200, raw
    assert metric(sc.url, "disaggpool_upstream_failures_total", stage="prefill") == 1
    assert metric(sc.url, "disaggpool_prefill_retries_total") == 1
    legs = flaky.legs["prefill"]
    assert legs >= 1

    # It scrapes well again: back in the pool, and it serves again.
    def back() -> None:
        assert healthy("flaky") == 1

    eventually(back, timeout=5.0)
    for i in range(4):
        status, _, raw = post_json(f"{sc.url}/v1/completions", {"prompt": f"r{i}", "max_tokens": 2})
        assert status == 200, raw
    assert flaky.legs["prefill"] >= legs + 1, "the pod never served again"
    books.settle(sent=6, admitted=6)
