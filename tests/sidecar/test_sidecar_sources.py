"""Membership from a file (re-read when it changes), the documented no-profile fallback, and
exact prompt lengths from a `tokenizer.json`."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import urllib.request
from pathlib import Path

import aiohttp
import pytest
import yaml
from sidecar_testkit import A40, MODEL, post

from disaggpool.core.contracts import SLOClass
from disaggpool.core.profile import KVTransferModel
from disaggpool.formats.profiles import load_profile, save_profile
from disaggpool.sidecar.config import Member, SidecarConfig, TokenizerConfig
from disaggpool.sidecar.service import RoutingService
from disaggpool.sidecar.state import PoolState
from disaggpool.sidecar.tokens import Prompt, PromptCounter


def test_members_file_is_reread_when_it_changes(start_pool, start_sidecar, tmp_path) -> None:
    pool = start_pool([A40], [A40, A40])
    members = tmp_path / "pool.yaml"
    first = {"prefill": pool.urls("prefill"), "decode": pool.urls("decode")[:1]}
    members.write_text(yaml.safe_dump(first))
    sc = start_sidecar(pool, pool={"file": str(members)}, scrape_interval_s=0.1)

    def names() -> set[str]:
        return sc.call(lambda: {i.name for i in sc.running.service.state.members("decode")})

    deadline = time.monotonic() + 10
    while names() != {"d0"} and time.monotonic() < deadline:
        time.sleep(0.05)
    assert names() == {"d0"}
    members.write_text(yaml.safe_dump({**first, "decode": pool.urls("decode")}))
    while names() != {"d0", "d1"} and time.monotonic() < deadline:
        time.sleep(0.05)
    assert names() == {"d0", "d1"}
    members.write_text("decode: [not, a, pool")  # broken: the last good membership stays

    def refusal() -> str:
        return sc.call(lambda: sc.running.collectors.members_file_error)

    while not refusal() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert str(members) in refusal()  # read and refused, not merely not read yet
    assert names() == {"d0", "d1"}
    members.write_text(yaml.safe_dump(first))  # the poll outlived the broken file
    while names() != {"d0"} and time.monotonic() < deadline:
        time.sleep(0.05)
    assert names() == {"d0"} and not refusal()
    status, body = post(f"{sc.url}/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert status == 200 and body["usage"]


def test_pods_without_a_trusted_profile_use_the_documented_fallback(
    start_pool, start_sidecar, caplog
) -> None:
    pool = start_pool([A40], [A40, A40], write_profiles=False)
    sc = start_sidecar(pool)
    with caplog.at_level("WARNING", logger="disaggpool.sidecar"):
        for i in range(3):
            status, _ = post(f"{sc.url}/v1/completions", {"prompt": f"x {i}", "max_tokens": 2})
            assert status == 200
    text = urllib.request.urlopen(f"{sc.url}/metrics", timeout=10).read().decode()
    assert 'disaggpool_route_fallbacks_total{reason="least-loaded"} 3.0' in text
    assert 'disaggpool_profile_trusted{pod="d0"} 0.0' in text
    assert 'policy="calibrated",role="decode"} ' in text  # the policy label names no fallback
    warned = [
        r.getMessage() for r in caplog.records if "no trusted calibration profile" in r.getMessage()
    ]
    assert len(warned) == len(set(warned)) >= 1  # said once per pod, not once per request


def test_what_prices_an_unmeasured_kv_transfer_is_said_once_per_stand_in(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A decode pod probed without --peer (its profile file marks the KV transfer unmeasured) is
    priced with the decode pool's median measured transfer, or its defaults while no pod has
    measured one (tests/core/test_policies.py); the log says which, once per pod and stand-in,
    and again when a profile or the membership changes it."""
    members = (
        Member("p0", "prefill", "http://p0"),
        Member("dx", "decode", "http://dx"),
        Member("d0", "decode", "http://d0"),
    )
    slo = SLOClass("chat", 60.0, 1.0)
    service = RoutingService(
        SidecarConfig(policy="calibrated", model=MODEL, slo_classes=(slo,), static_members=members),
        clock=lambda: 0.0,
    )
    service.state.set_members(members)
    bpt = A40.kv_transfer.bytes_per_token
    files = {
        "p0": A40,
        "dx": dataclasses.replace(A40, quality="fair", unmeasured=("kv_transfer",)),
        "d0": dataclasses.replace(A40, kv_transfer=KVTransferModel(0.003, bpt, 12e9)),
    }

    def install(name: str) -> None:  # as the profile collector does
        save_profile(files[name], tmp_path / f"{name}.yaml")
        service.state.set_profile(name, load_profile(tmp_path / f"{name}.yaml"), 0.0)
        service.profile_changed(name)

    def said() -> list[str]:
        return [
            r.getMessage() for r in caplog.records if "KV transfer not measured" in r.getMessage()
        ]

    with caplog.at_level("WARNING", logger="disaggpool.sidecar"):
        install("p0")
        install("dx")
        assert said() == [
            "pod dx: KV transfer not measured (probed without --peer) and no decode pod measured "
            "one: the calibrated policy prices it with its defaults (2 ms + 20 GB/s)"
        ]
        install("d0")
        assert said()[1:] == [
            "pod dx: KV transfer not measured (probed without --peer): the calibrated policy "
            "prices it with the decode pool's median measured transfer (3 ms + 12 GB/s), not "
            "its profile's defaults (2 ms + 20 GB/s)"
        ]
        install("p0")  # nothing changed for dx: not said again
        assert len(said()) == 2
        service.state.unreachable("d0")  # down: dx is routed to (priced as tests/core show)
        routed = service.route("r1", 1000)
        assert routed.decode is not None and routed.decode.name == "dx"
        assert len(said()) == 2
        service.state.set_members(members[:2])  # d0 leaves, as the collector then tells:
        service.note_transfer_stand_ins()
        assert said()[2:] == said()[:1]  # the defaults again
    # The pod's own profile is left as loaded: the stand-in is the policy's, per decision.
    assert service.state.instances["dx"].profile == files["dx"]


def test_huggingface_tokenizer_json_counts_exactly(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        ["alpha beta gamma delta", "beta gamma"],
        trainers.WordLevelTrainer(special_tokens=["[UNK]"]),
    )
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))

    async def count(text: str) -> Prompt:
        async with aiohttp.ClientSession() as session:
            counter = PromptCounter(
                TokenizerConfig("huggingface", str(path)), PoolState(), MODEL, session
            )
            return await counter.completion(text)

    ids = tuple(tok.encode("alpha beta, gamma").ids)
    assert asyncio.run(count("alpha beta, gamma")) == Prompt(
        4, ids
    )  # the ids, for the prefix index


def test_a_slow_metrics_page_is_not_a_dead_pod(start_pool, start_sidecar) -> None:
    """Timeouts must repeat before a pod is taken out; a refused connection takes it out at once."""
    import socket
    import threading

    from aiohttp import web

    from disaggpool.sidecar.collectors import SCRAPE_FAILURES

    pool = start_pool([A40], [A40])
    release = threading.Event()

    async def slow_metrics(request: web.Request) -> web.Response:
        while not release.is_set():
            await asyncio.sleep(0.05)
        return web.Response(text="")

    loop = asyncio.new_event_loop()
    runner = web.AppRunner(web.Application())
    runner.app.router.add_get("/metrics", slow_metrics)
    loop.run_until_complete(runner.setup())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        slow_port = s.getsockname()[1]
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", slow_port).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    decode = [
        *pool.urls("decode"),
        {"name": "slow", "url": f"http://127.0.0.1:{slow_port}"},
        {"name": "dead", "url": f"http://127.0.0.1:{dead_port}"},
    ]
    try:
        # A long interval keeps the background loop from scraping; each slow scrape costs 0.3 s.
        sc = start_sidecar(
            pool,
            pool={"static": {"prefill": pool.urls("prefill"), "decode": decode}},
            scrape_interval_s=60.0,
            scrape_timeout_s=0.3,
        )

        state = sc.running.service.state

        def slow() -> tuple[int, bool]:
            return sc.call(
                lambda: (state.instances["slow"].failures, state.instances["slow"].healthy)
            )

        assert sc.call(lambda: state.instances["dead"].healthy) is False  # refused: out at once
        assert sc.call(lambda: state.instances["d0"].healthy) is True
        for _ in range(2 * SCRAPE_FAILURES):  # timeouts: out only after SCRAPE_FAILURES in a row
            failures, healthy = slow()
            assert healthy is (failures < SCRAPE_FAILURES), (failures, healthy)
            if failures >= SCRAPE_FAILURES:
                break
            sc.run(sc.running.collectors.scrape_once, timeout=60)
        else:
            raise AssertionError("the slow pod's scrapes never failed")
    finally:
        release.set()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
