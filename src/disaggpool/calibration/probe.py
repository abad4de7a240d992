"""The calibration probe: drive one vLLM pod over HTTP with a designed workload, fit its profile.

`disaggpool calibrate` (and `bench/probe_accuracy.py`) call `run_probe` against a pod, real vLLM
or our emulator. This module only orchestrates: discovery and the measurement stages through one
HTTP session (`client`, `stages`), then the TTFTs net of the request path, the fits and the
profile with its report (`assemble`, pure; the fitting is `fit`'s). The data the parts exchange
is in `common`; `ProbeConfig`, `ProbeError` and `ProbeResult` are re-exported here.
"""

from __future__ import annotations

import asyncio
import datetime
import time

import aiohttp

from disaggpool import precise_loop
from disaggpool.calibration import assemble, stages
from disaggpool.calibration.client import Client
from disaggpool.calibration.common import (
    ProbeConfig,
    ProbeError,
    ProbeResult,
    Progress,
)
from disaggpool.pdwire import POD_CONNECTION_REUSE_S

__all__ = ["ProbeConfig", "ProbeError", "ProbeResult", "run_probe"]


async def _probe(cfg: ProbeConfig, progress: Progress | None, start: float) -> ProbeResult:
    timeout = aiohttp.ClientTimeout(total=cfg.request_timeout_s)
    connector = aiohttp.TCPConnector(keepalive_timeout=POD_CONNECTION_REUSE_S)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else None
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, headers=headers
    ) as session:
        client = Client(session, cfg)
        pod = await client.discover(cfg.endpoint.rstrip("/"))
        peer = await client.discover(cfg.peer.rstrip("/")) if cfg.peer else None
        try:
            measured = await stages.measure(
                client, pod, peer, stages.Budget(start, cfg.budget_s), progress
            )
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise ProbeError(f"probe requests failed: {exc!r}") from None
    net = assemble.net_of_request_path(measured)
    fits = assemble.fit_all(net, cfg)
    elapsed = time.perf_counter() - start  # discovery, measuring and fitting: what the cap covers
    fitted_at = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return assemble.assemble(cfg, pod, net, fits, elapsed_s=elapsed, fitted_at=fitted_at)


def run_probe(
    cfg: ProbeConfig, progress: Progress | None = None, *, started: float | None = None
) -> ProbeResult:
    """Probe one pod (blocking); raises ProbeError when it cannot.

    The budget (`cfg.budget_s`, at most `stages.HARD_STOP` times it with the fits) counts from
    `started`, a `time.perf_counter` reading (default: now). `disaggpool calibrate` passes its
    own start, so that its imports count too and its whole run keeps to the cap a user times.
    """
    start = time.perf_counter() if started is None else started
    factory = precise_loop.busy_poll_event_loop if cfg.busy_poll else None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(_probe(cfg, progress, start))
