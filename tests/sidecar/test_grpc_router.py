"""The gRPC Router on loopback: route/report/snapshot against a real emulated pool, health and
reflection, and fuzzed malformed requests that must get INVALID_ARGUMENT without harm."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sidecar_testkit import A40

from disaggpool.router.v1 import router_pb2 as pb
from disaggpool.router.v1 import router_pb2_grpc as pb_grpc


@pytest.fixture
def router(start_pool, start_sidecar):
    pool = start_pool([A40], [A40, A40.scaled(0.5)])
    sc = start_sidecar(pool)
    channel = grpc.insecure_channel(sc.grpc_target)
    yield sc, pb_grpc.RouterStub(channel), channel
    channel.close()


def test_route_report_and_snapshot(router) -> None:
    _sc, stub, _ = router
    resp = stub.Route(pb.RouteRequest(request_id="r1", prompt_tokens=500, max_tokens=100))
    assert resp.prefill.name == "p0" and resp.decode.name in ("d0", "d1")
    assert resp.prefill.url.startswith("http://127.0.0.1:")
    assert resp.policy == "calibrated" and resp.slo_class == "interactive"
    assert resp.HasField("predicted_ttft_s") and resp.predicted_ttft_s > 0
    assert 0 < resp.predicted_output_tokens <= 100

    snap = stub.GetPoolSnapshot(pb.GetPoolSnapshotRequest())
    assert snap.inflight == 1 and snap.policy == "calibrated"
    p0 = snap.prefill[0]
    assert (p0.inflight, p0.queued_tokens, p0.profile_trusted) == (1, 500, True)
    chosen = next(d for d in snap.decode if d.name == resp.decode.name)
    assert (chosen.inflight, chosen.queued, chosen.queued_tokens) == (1, 1, 500)
    assert chosen.kv_capacity_tokens > 0

    assert stub.Report(pb.ReportRequest(request_id="r1", stage=pb.STAGE_PREFILLED)).known
    assert stub.Report(
        pb.ReportRequest(request_id="r1", stage=pb.STAGE_DECODING, output_tokens=1)
    ).known
    done = pb.ReportRequest(
        request_id="r1", stage=pb.STAGE_FINISHED, output_tokens=80, ttft_s=0.2, tpot_s=0.03
    )
    assert stub.Report(done).known
    assert not stub.Report(done).known  # exactly once
    assert stub.GetPoolSnapshot(pb.GetPoolSnapshotRequest()).inflight == 0


def test_prompt_text_is_tokenised_and_exclusions_respected(router) -> None:
    _, stub, _ = router
    resp = stub.Route(pb.RouteRequest(request_id="t", prompt_text="one two three"))
    assert resp.prefill.name == "p0"
    with pytest.raises(grpc.RpcError) as err:  # the only prefill pod is excluded
        stub.Route(pb.RouteRequest(request_id="u", prompt_tokens=5, exclude_prefill=["p0"]))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize(
    ("request_", "code", "field"),
    [
        (pb.RouteRequest(prompt_tokens=5), grpc.StatusCode.INVALID_ARGUMENT, "request_id"),
        (pb.RouteRequest(request_id="a"), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
        (
            pb.RouteRequest(request_id="a", prompt_tokens=3, prompt_text="x"),
            grpc.StatusCode.INVALID_ARGUMENT,
            "prompt",
        ),
        (
            pb.RouteRequest(request_id="a", prompt_tokens=3, slo_class="gold"),
            grpc.StatusCode.INVALID_ARGUMENT,
            "slo_class",
        ),
        (
            pb.RouteRequest(request_id="x" * 200, prompt_tokens=3),
            grpc.StatusCode.INVALID_ARGUMENT,
            "request_id",
        ),
    ],
)
def test_bad_route_requests(router, request_, code, field) -> None:
    _, stub, _ = router
    with pytest.raises(grpc.RpcError) as err:
        stub.Route(request_)
    assert err.value.code() == code
    assert err.value.details().startswith(field)


def test_duplicate_id_and_bad_reports(router) -> None:
    _, stub, _ = router
    stub.Route(pb.RouteRequest(request_id="dup", prompt_tokens=10))
    with pytest.raises(grpc.RpcError) as err:
        stub.Route(pb.RouteRequest(request_id="dup", prompt_tokens=10))
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    for bad, field in [
        (pb.ReportRequest(stage=pb.STAGE_FINISHED), "request_id"),
        (pb.ReportRequest(request_id="dup"), "stage"),
        (
            pb.ReportRequest(request_id="dup", stage=pb.STAGE_FINISHED, ttft_s=float("nan")),
            "ttft_s",
        ),
        (pb.ReportRequest(request_id="dup", stage=pb.STAGE_FINISHED, tpot_s=-1), "tpot_s"),
    ]:
        with pytest.raises(grpc.RpcError) as err:
            stub.Report(bad)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith(field)


def test_health_and_reflection(router) -> None:
    _, _, channel = router
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "disaggpool.router.v1.Router"):
        status = health.Check(health_pb2.HealthCheckRequest(service=service)).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(channel)
    answers = list(
        refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    )
    names = {s.name for s in answers[0].list_services_response.service}
    assert {"disaggpool.router.v1.Router", "grpc.health.v1.Health"} <= names


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    payload=st.binary(max_size=200), method=st.sampled_from(["Route", "Report", "GetPoolSnapshot"])
)
def test_fuzzed_bytes_get_invalid_argument_and_the_server_stays_up(router, payload, method) -> None:
    sc, stub, channel = router
    raw = channel.unary_unary(f"/disaggpool.router.v1.Router/{method}")  # bytes in, bytes out
    try:
        raw(payload, timeout=10)
    except grpc.RpcError as exc:
        assert exc.code() in (
            grpc.StatusCode.INVALID_ARGUMENT,
            grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.ALREADY_EXISTS,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
        ), exc
        if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
            assert exc.details(), "the error names what was wrong"
    # Still serving, and no request leaked into the books beyond what Route accepted.
    assert stub.GetPoolSnapshot(pb.GetPoolSnapshotRequest()).policy == "calibrated"
    sc.call(lambda: sc.running.service.state.expired(float("inf"), 0.0))


def test_late_binding_and_the_local_path_over_grpc(start_pool, start_sidecar) -> None:
    pool = start_pool([A40], [A40, A40])
    late = start_sidecar(pool)  # decode_binding: late is the default
    with grpc.insecure_channel(late.grpc_target) as channel:
        stub = pb_grpc.RouterStub(channel)
        # A client that does not say it will call BindDecode gets both pods at once.
        now = stub.Route(pb.RouteRequest(request_id="a1", prompt_tokens=400))
        assert now.HasField("prefill") and now.HasField("decode")
        resp = stub.Route(
            pb.RouteRequest(request_id="l1", prompt_tokens=400, bind_decode_late=True)
        )
        assert resp.HasField("prefill") and not resp.HasField("decode")
        bound = stub.BindDecode(pb.BindDecodeRequest(request_id="l1"))
        assert bound.prefill.name == "p0" and bound.decode.name in ("d0", "d1")
        assert bound.HasField("predicted_ttft_s")
        with pytest.raises(grpc.RpcError) as err:  # bound once only
            stub.BindDecode(pb.BindDecodeRequest(request_id="l1"))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "request_id" in (err.value.details() or "")
        with pytest.raises(grpc.RpcError) as err:
            stub.BindDecode(pb.BindDecodeRequest(request_id="never-routed"))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    arrival = start_sidecar(pool, decode_binding="arrival")  # binds at once, asked or not
    with grpc.insecure_channel(arrival.grpc_target) as channel:
        resp = pb_grpc.RouterStub(channel).Route(
            pb.RouteRequest(request_id="a2", prompt_tokens=400, bind_decode_late=True)
        )
        assert resp.HasField("prefill") and resp.HasField("decode")
    local = start_sidecar(pool, local_prefill_below=10_000)
    with grpc.insecure_channel(local.grpc_target) as channel:
        resp = pb_grpc.RouterStub(channel).Route(pb.RouteRequest(request_id="x", prompt_tokens=50))
        assert not resp.HasField("prefill") and resp.decode.name in ("d0", "d1")


def test_priority_scheduling_is_told_to_grpc_clients(start_pool, start_sidecar) -> None:
    """A gRPC client runs the legs itself: the response carries the priority to send with them,
    1 for a request no pod can serve in time, and 0 whenever the switch is off."""
    pool = start_pool([A40], [A40])
    hopeless = [{"name": "chat", "ttft_s": 1e-6, "tpot_s": 1.0}]
    for switch, expected in ((True, 1), (False, 0)):
        sc = start_sidecar(pool, slo_classes=hopeless, priority_scheduling=switch)
        with grpc.insecure_channel(sc.grpc_target) as channel:
            resp = pb_grpc.RouterStub(channel).Route(
                pb.RouteRequest(request_id=f"p{switch}", prompt_tokens=300)
            )
        assert resp.slo_feasible is False and resp.priority == expected
