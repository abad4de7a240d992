"""The front door names the pods that served each request (`X-Disaggpool-Prefill-Pod`,
`X-Disaggpool-Decode-Pod`), and loadgen records them per request."""

from __future__ import annotations

import asyncio

from sidecar_testkit import A40

from disaggpool.core.contracts import SLOClass
from disaggpool.formats.traces import TraceRequest
from disaggpool.loadgen import replay


def test_loadgen_records_the_pods_the_front_door_names(start_pool, start_sidecar) -> None:
    pool = start_pool([A40], [A40, A40])
    sc = start_sidecar(pool, served_by_headers=True)
    trace = [TraceRequest(0.05 * i, 20 + 10 * i, 3) for i in range(8)]
    report = asyncio.run(replay(sc.url, trace, [SLOClass("interactive", 5.0, 0.5)]))
    assert all(r.ok for r in report.results)
    assert {r.prefill_pod for r in report.results} == {"p0"}
    assert {r.decode_pod for r in report.results} <= {"d0", "d1"}
    assert all(r.decode_pod for r in report.results)


def test_pod_names_stay_inside_unless_asked_for(start_pool, start_sidecar) -> None:
    pool = start_pool([A40], [A40])
    report = asyncio.run(
        replay(
            start_sidecar(pool).url, [TraceRequest(0.0, 20, 3)], [SLOClass("interactive", 5.0, 0.5)]
        )
    )
    assert report.results[0].ok and not report.results[0].decode_pod
