"""A third-party benchmark client through the gateway path: `aiperf` and `disaggpool loadgen`, each
sending to a real Envoy whose endpoint picker is our sidecar, in front of an emulated pool, agree
(tests/aiperf_kit.py says what is checked), and the picker booked every request both sent.

The decode pods are the destinations themselves here (no pd-proxy: they prefill locally), with
the picker deciding local prefill, so its books describe what the pods did.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from envoy_testkit import running_envoy
from gateway_testkit import MODEL, Pool, metric

from aiperf_kit import REQUESTS, TIMEOUT_S, aiperf_agrees_with_loadgen, aiperf_binary
from disaggpool.sidecar.harness import SidecarThread


@pytest.fixture(scope="module")
def aiperf() -> Path:
    return aiperf_binary()


@pytest.mark.timeout(TIMEOUT_S)
def test_aiperf_through_envoy_and_the_picker_agrees_with_loadgen(
    aiperf: Path, pool: Pool, start_sidecar, tmp_path: Path
) -> None:
    # Every prompt prefilled on its decode pod: there is no pd-proxy to run a remote prefill.
    sc: SidecarThread = start_sidecar(pool, pd_decider=True, local_prefill_below=1_000_000)
    with running_envoy(tmp_path, epp_port=sc.running.ext_proc_port) as envoy:
        aiperf_agrees_with_loadgen(aiperf, envoy.url, MODEL, tmp_path)
    answered = metric(sc.url, "disaggpool_epp_responses_total", code="200")
    assert answered == 2 * REQUESTS  # aiperf's and loadgen's, every one decided and booked
