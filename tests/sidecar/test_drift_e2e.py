"""The drift loop on loopback: a pod that slows down is detected by the router's per-pod error,
re-probed by the real probe, hot-reloaded, and routed around; a poor re-probe does not replace a
trusted profile."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
from sidecar_testkit import A40, MODEL, metric
from test_frontdoor_e2e import completions, idle, wait_until

from disaggpool.calibration.probe import ProbeConfig, run_probe
from disaggpool.emulator.config import EmulatorConfig
from disaggpool.emulator.harness import EmulatorThread
from disaggpool.formats.profiles import save_profile

SLO = [{"name": "chat", "ttft_s": 5.0, "tpot_s": 0.5}]
DRIFT = {"window": 16, "min_samples": 6, "period_s": 0.2}


def burst(url: str):  # type: ignore[no-untyped-def]
    """32 streamed requests in 4 waves (streamed: the router times TTFT and TPOT)."""
    return completions(url, waves=4, per_wave=8, base=30, step=3, max_tokens=24, stream=True)


def decisions(url: str, pod: str) -> float:
    return metric(url, "disaggpool_route_decisions_total", role="decode", pod=pod)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_slowed_pod_is_detected_reprobed_and_routed_around(start_pool, start_sidecar) -> None:
    pool = start_pool([A40.scaled(3.0)], [A40, A40])
    sc = start_sidecar(pool, slo_classes=SLO, drift=DRIFT)
    # d1 slows to 40% (the emulator restarted on its port with a slower true profile); the
    # router still holds d1's old profile.
    old = pool.emulator("d1")
    port = old.port
    old.stop()
    slow = A40.scaled(0.4)
    settings = dict(port=port, side_channel_port=0, side_channel_host="127.0.0.1", jitter=0.0)
    with EmulatorThread(EmulatorConfig(slow, model=MODEL, **settings)) as d1:  # type: ignore[arg-type]
        asyncio.run(burst(sc.url))
        wait_until(
            lambda: metric(sc.url, "disaggpool_pod_prediction_error", pod="d1") > 0.5,
            10,
            "d1's drift error over 0.5",
        )
        assert metric(sc.url, "disaggpool_pod_prediction_error", pod="d0") < 0.3

        # The re-probe (what the operator's Job runs), written where the router reads profiles.
        probed = run_probe(
            ProbeConfig(
                endpoint=d1.url,
                peer=pool.emulator("p0").url,
                budget_s=30,  # a slow board: its long prompts take seconds each
                max_num_seqs=slow.max_num_seqs,
                max_num_batched_tokens=slow.max_num_batched_tokens,
            )
        ).profile
        assert probed.trusted, probed.notes
        assert probed.decode.d0 > 2.0 * A40.decode.d0  # it measured the slower board
        save_profile(dataclasses.replace(probed, name="d1"), pool.profiles_dir / "d1.yaml")
        service = sc.running.service
        wait_until(
            lambda: service.state.instances["d1"].profile.fitted_at == probed.fitted_at,
            10,
            "the router to hot-reload d1's new profile",
        )
        assert service.drift.error("d1") is None  # its window started over with the profile
        wait_until(
            lambda: metric(sc.url, "disaggpool_pod_prediction_error", pod="d1") == 0.0,
            5,
            "d1's error series to go until it has new samples",
        )

        before = {p: decisions(sc.url, p) for p in ("d0", "d1")}
        asyncio.run(burst(sc.url))
        wait_until(lambda: idle(sc), 20, "the burst to finish")
        after = {p: decisions(sc.url, p) - before[p] for p in ("d0", "d1")}
        assert after["d1"] < 0.5 * after["d0"], after  # routed around the slow pod
        err = service.drift.error("d1")
        assert err is None or err < 0.3  # and what it does get is predicted again


def test_a_poor_reprobe_does_not_replace_a_trusted_profile(start_pool, start_sidecar) -> None:
    pool = start_pool([A40], [A40])
    sc = start_sidecar(pool, slo_classes=SLO)
    service = sc.running.service
    wait_until(lambda: service.state.instances["d0"].profile is not None, 10, "d0's profile")
    trusted = service.state.instances["d0"].profile
    poor = dataclasses.replace(A40, name="d0", quality="poor", notes="held-out error 41%")
    save_profile(poor, pool.profiles_dir / "d0.yaml")
    time.sleep(1.0)  # several polls of the profile directory
    assert service.state.instances["d0"].profile == trusted
    good = dataclasses.replace(A40.scaled(0.5), name="d0", quality="good", fitted_at="later")
    save_profile(good, pool.profiles_dir / "d0.yaml")
    wait_until(
        lambda: service.state.instances["d0"].profile.fitted_at == "later",
        10,
        "a trusted re-probe to replace it",
    )
