"""A gRPC `Route` flood: a client that books routes and never `Report`s them. Its bookings count
against the gRPC in-flight limits (per client, then overall), never against the front door's
`max_inflight`, so the front door keeps answering; unreported entries expire after
`grpc.lease_s`, and the books of both adapters close."""

from __future__ import annotations

import grpc
from emulator_testkit import eventually
from faultkit import Accounting, Kit, metric, pod, post_json, sidecar_doc

from disaggpool.router.v1 import router_pb2 as pb
from disaggpool.router.v1 import router_pb2_grpc as pb_grpc

LEASE_S = 1.0
PER_CLIENT = 4


def test_a_route_flood_cannot_starve_the_front_door_and_expires(kit: Kit) -> None:
    p0, d0 = kit.emulator(), kit.emulator()
    sc = kit.sidecar(
        sidecar_doc(
            [pod("p0", p0.url)],
            [pod("d0", d0.url)],
            max_inflight=PER_CLIENT,  # the front door's own limit: as small as the flood
            grpc={"lease_s": LEASE_S, "max_inflight": 8, "max_inflight_per_client": PER_CLIENT},
        )
    )
    books = Accounting(sc.url)
    with grpc.insecure_channel(sc.grpc_target) as channel:
        stub = pb_grpc.RouterStub(channel)
        accepted, refused = 0, 0
        for i in range(3 * PER_CLIENT):
            try:
                stub.Route(pb.RouteRequest(request_id=f"flood-{i}", prompt_tokens=100), timeout=5)
                accepted += 1
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
                refused += 1
        assert (accepted, refused) == (PER_CLIENT, 2 * PER_CLIENT)

        # The flood holds every gRPC booking it may; the front door still answers.
        for i in range(PER_CLIENT):
            status, _, raw = post_json(
                f"{sc.url}/v1/completions", {"prompt": f"f{i}", "max_tokens": 2}
            )
            assert status == 200, raw

        # The unreported entries expire after the lease...
        def expired() -> None:
            assert metric(sc.url, "disaggpool_inflight_requests") == 0

        eventually(expired, timeout=LEASE_S + 10.0, interval=0.1)
        # ... and free the client's bookings: a new Route is accepted and can be reported.
        stub.Route(pb.RouteRequest(request_id="after", prompt_tokens=100), timeout=5)
        stub.Report(
            pb.ReportRequest(
                request_id="after",
                stage=pb.STAGE_FINISHED,
                output_tokens=2,
                ttft_s=0.1,
                tpot_s=0.01,
            ),
            timeout=5,
        )
    # Every booking closed once: the front door's requests, the expired flood, the reported one.
    books.settle(sent=PER_CLIENT, admitted=PER_CLIENT + PER_CLIENT + 1)
