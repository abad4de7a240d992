"""The endpoint picker over real gRPC on loopback, driven by hand as Envoy drives it, in front of
a real emulated pool: the deferred headers answer, chunking, buffered mode, refusals, the books."""

from __future__ import annotations

import json
import time

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from gateway_testkit import (
    A40,
    BUFFERED,
    Exchange,
    Pool,
    body_message,
    completion_body,
    headers_message,
    metric,
    post_headers,
    response_body_message,
    response_headers_message,
    set_headers,
)
from grpc_health.v1 import health_pb2, health_pb2_grpc

from disaggpool.formats.profiles import save_profile
from disaggpool.localpool.processes import free_port
from disaggpool.sidecar.epp import CHUNK_BYTES


def _wait_inflight(sc, n: int, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while sc.call(lambda: sc.running.service.inflight) != n:
        assert time.monotonic() < deadline, "the books never came back to the expected count"
        time.sleep(0.02)


def _decide(
    ex: Exchange, body: bytes, headers: dict[str, str] | None = None
) -> pb.ProcessingResponse:
    ex.send(headers_message(headers or post_headers()))
    half = len(body) // 2
    ex.send(body_message(body[:half], False))
    ex.send(body_message(body[half:], True))
    return ex.read()


def test_full_duplex_defers_the_headers_then_streams_the_body_back_in_chunks(
    pool, start_sidecar
) -> None:
    sc = start_sidecar(pool, local_prefill_below=10_000)  # local path: no prefill pod named
    prompt = ("lorem" * 200 + " ") * 180  # 180 KB in 180 tokens: three chunks
    body = completion_body(prompt)
    with Exchange(sc.running.ext_proc_target) as ex:
        steer = {
            "x-gateway-destination-endpoint": "6.6.6.6:1",
            "x-prefiller-host-port": "6.6.6.6:2",
        }
        first = _decide(ex, body, post_headers(**steer))
        assert first.WhichOneof("response") == "request_headers", first
        common = first.request_headers.response
        assert common.clear_route_cache
        sets = set_headers(common.header_mutation)
        decode = {pool.address("d0"), pool.address("d1")}
        assert sets["x-gateway-destination-endpoint"] in decode  # the client's own is overwritten
        assert "x-prefiller-host-port" not in sets
        assert "x-prefiller-host-port" in common.header_mutation.remove_headers
        lb = first.dynamic_metadata.fields["envoy.lb"].struct_value
        assert (
            lb.fields["x-gateway-destination-endpoint"].string_value
            == sets["x-gateway-destination-endpoint"]
        )
        chunks: list[bytes] = []
        while True:
            answer = ex.read()
            streamed = answer.request_body.response.body_mutation.streamed_response
            assert len(streamed.body) <= CHUNK_BYTES
            chunks.append(streamed.body)
            if streamed.end_of_stream:
                break
        assert len(chunks) == -(-int(sets["content-length"]) // CHUNK_BYTES) == 3
        forwarded = json.loads(b"".join(chunks))
        assert forwarded["prompt"] == prompt and forwarded["model"] == "test/model"
        assert int(sets["content-length"]) == len(b"".join(chunks))
        assert sc.call(lambda: sc.running.service.inflight) == 1
        # The response phase: echoed unchanged, and booked.
        ex.send(response_headers_message(200, "text/event-stream"))
        assert ex.read().WhichOneof("response") == "response_headers"
        events = [
            b'data: {"choices": [{"text": "a"}]}\n\n',
            b'data: {"choices": [{"text": "b"}]}\n\n'
            b'data: {"choices": [], "usage": {"completion_tokens": 2}}\n\n',
            b"data: [DONE]\n\n",
        ]
        for i, event in enumerate(events):
            ex.send(response_body_message(event, i == len(events) - 1))
            echoed = ex.read().response_body.response.body_mutation.streamed_response
            assert echoed.body == event and echoed.end_of_stream == (i == len(events) - 1)
    _wait_inflight(sc, 0)
    done = metric(sc.url, "disaggpool_requests_total", outcome="met") + metric(
        sc.url, "disaggpool_requests_total", outcome="missed"
    )
    assert done == 1
    assert (
        metric(sc.url, "disaggpool_epp_decisions_total", endpoint="completions", code="routed") == 1
    )
    assert metric(sc.url, "disaggpool_epp_responses_total", code="200") == 1


def test_a_remote_prefill_names_the_prefill_pod(pool, start_sidecar) -> None:
    sc = start_sidecar(pool, pd_decider=False)  # every request takes the prefill pool
    with Exchange(sc.running.ext_proc_target) as ex:
        first = _decide(ex, completion_body())
        sets = set_headers(first.request_headers.response.header_mutation)
        assert sets["x-prefiller-host-port"] == pool.address("p0")
        assert sets["x-request-id"]


def test_buffered_mode_answers_the_headers_at_once_and_mutates_on_the_body(
    pool, start_sidecar
) -> None:
    sc = start_sidecar(pool)
    with Exchange(sc.running.ext_proc_target) as ex:
        ex.send(headers_message(post_headers("/v1/chat/completions"), mode=BUFFERED))
        assert ex.read().request_headers == pb.HeadersResponse()
        body = {
            "model": "test/model",
            "messages": [{"role": "user", "content": "hi"}],
            "slo_class": "batch",
        }
        ex.send(body_message(json.dumps(body).encode(), True))
        answer = ex.read()
        common = answer.request_body.response
        assert common.clear_route_cache
        assert set_headers(common.header_mutation)["x-gateway-destination-endpoint"]
        forwarded = json.loads(common.body_mutation.body)
        assert "slo_class" not in forwarded and forwarded["messages"] == body["messages"]
        ex.send(response_headers_message(200, "application/json"))
        ex.read()
        answer_body = {
            "choices": [{"message": {"content": "x"}}],
            "usage": {"completion_tokens": 3},
        }
        ex.send(response_body_message(json.dumps(answer_body).encode(), True))
        assert ex.read().response_body == pb.BodyResponse()  # buffered: nothing to change
    _wait_inflight(sc, 0)
    assert metric(sc.url, "disaggpool_requests_total", slo_class="batch") == 1


def _immediate(ex: Exchange) -> pb.ImmediateResponse:
    answer = ex.read()
    assert answer.WhichOneof("response") == "immediate_response", answer
    return answer.immediate_response


def test_a_body_past_max_body_bytes_is_413(pool, start_sidecar) -> None:
    sc = start_sidecar(pool, max_body_bytes=2048)
    with Exchange(sc.running.ext_proc_target) as ex:
        ex.send(headers_message(post_headers()))
        ex.send(body_message(b"x" * 1500, False))
        ex.send(body_message(b"x" * 1500, False))
        refused = _immediate(ex)
    assert refused.status.code == 413
    assert json.loads(refused.body)["error"]["param"] == "body"


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b"{not json", 400, "body"),
        (json.dumps({"prompt": "x", "max_tokens": "many"}).encode(), 400, "max_tokens"),
        (json.dumps({"model": "other", "prompt": "x"}).encode(), 404, "model"),
        (json.dumps({"prompt": "x"}).encode(), 400, "slo_class"),  # with an unknown class
    ],
)
def test_bad_requests_name_the_field(pool, start_sidecar, body, status, param) -> None:
    sc = start_sidecar(pool)
    headers = post_headers(**({"x-slo-class": "gold"} if param == "slo_class" else {}))
    with Exchange(sc.running.ext_proc_target) as ex:
        refused = (lambda: _decide(ex, body, headers))()
        assert refused.WhichOneof("response") == "immediate_response"
    error = json.loads(refused.immediate_response.body)["error"]
    assert refused.immediate_response.status.code == status
    assert error["param"] == param and param in error["message"]
    assert sc.call(lambda: sc.running.service.inflight) == 0


def test_the_subset_hint_limits_the_decode_pods(pool, start_sidecar) -> None:
    sc = start_sidecar(pool)
    as_string = f"198.18.9.9:80, {pool.address('d1')}"  # a comma-separated string works too
    for subset in ([pool.address("d1")], [pool.address("d1")], as_string, as_string):
        with Exchange(sc.running.ext_proc_target) as ex:
            ex.send(headers_message(post_headers(), subset=subset))
            ex.send(body_message(completion_body(), True))
            sets = set_headers(ex.read().request_headers.response.header_mutation)
            assert sets["x-gateway-destination-endpoint"] == pool.address("d1")
    for subset in ([], ["198.18.9.9:80"]):
        with Exchange(sc.running.ext_proc_target) as ex:
            ex.send(headers_message(post_headers(), subset=subset))
            ex.send(body_message(completion_body(), True))
            assert _immediate(ex).status.code == 503


def test_no_healthy_pod_is_503(tmp_path, start_sidecar) -> None:

    save_profile(A40, tmp_path / "p0.yaml")
    dead = {
        "prefill": [{"name": "p0", "url": f"http://127.0.0.1:{free_port()}"}],
        "decode": [{"name": "d0", "url": f"http://127.0.0.1:{free_port()}"}],
    }
    sc = start_sidecar(Pool({}, tmp_path), pool={"static": dead}, tokenizer={"kind": "emulator"})
    with Exchange(sc.running.ext_proc_target) as ex:
        refused = _decide(ex, completion_body()).immediate_response
    assert refused.status.code == 503
    assert any(h.header.key == "retry-after" for h in refused.headers.set_headers)


def test_admission_beyond_max_inflight_is_429_before_the_body(pool, start_sidecar) -> None:
    sc = start_sidecar(pool, max_inflight=1)
    with Exchange(sc.running.ext_proc_target) as held:
        held.send(headers_message(post_headers()))  # admitted, body pending
        time.sleep(0.2)
        with Exchange(sc.running.ext_proc_target) as ex:
            ex.send(headers_message(post_headers()))
            refused = _immediate(ex)
        assert refused.status.code == 429
    time.sleep(0.2)
    with Exchange(sc.running.ext_proc_target) as ex:  # the first stream ended: room again
        assert _decide(ex, completion_body()).WhichOneof("response") == "request_headers"


def test_a_cancelled_stream_is_booked_aborted(pool, start_sidecar) -> None:
    sc = start_sidecar(pool)
    ex = Exchange(sc.running.ext_proc_target)
    _decide(ex, completion_body())
    ex.read()  # the body
    ex.send(response_headers_message(200, "text/event-stream"))
    ex.read()
    assert sc.call(lambda: sc.running.service.inflight) == 1
    ex.cancel()
    _wait_inflight(sc, 0)
    assert metric(sc.url, "disaggpool_requests_total", outcome="aborted") == 1


def test_a_stream_without_done_and_an_error_status_are_failures(pool, start_sidecar) -> None:
    sc = start_sidecar(pool)
    for status, events in ((200, [b'data: {"choices": [{"text": "a"}]}\n\n']), (500, [b"{}"])):
        with Exchange(sc.running.ext_proc_target) as ex:
            _decide(ex, completion_body())
            ex.read()
            ex.send(response_headers_message(status, "text/event-stream"))
            ex.read()
            ex.send(response_body_message(events[0], True))
            ex.read()
    _wait_inflight(sc, 0)
    assert metric(sc.url, "disaggpool_requests_total", outcome="failed") == 2


def test_clients_need_an_api_key_and_envoy_a_token(
    pool, start_sidecar, keys_file, tmp_path
) -> None:
    token = tmp_path / "token"
    token.write_text("envoy-token\n")
    sc = start_sidecar(
        pool, auth={"api_keys_file": str(keys_file)}, grpc={"token_file": str(token)}
    )
    bearer = (("authorization", "Bearer envoy-token"),)
    with Exchange(sc.running.ext_proc_target, bearer) as ex:
        ex.send(headers_message(post_headers()))
        refused = _immediate(ex)
    assert refused.status.code == 401
    with Exchange(sc.running.ext_proc_target, bearer) as ex:
        first = _decide(ex, completion_body(), post_headers(authorization="Bearer client-key"))
        mutation = first.request_headers.response.header_mutation
        assert "authorization" in mutation.remove_headers  # the router's key goes no further
    with Exchange(sc.running.ext_proc_target) as ex, pytest.raises(grpc.RpcError) as err:
        ex.send(headers_message(post_headers()))
        ex.read()
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert metric(sc.url, "disaggpool_auth_failures_total", port="ext_proc") == 1
    assert metric(sc.url, "disaggpool_auth_failures_total", port="gateway") == 1


def test_models_is_answered_here_and_other_paths_are_404(pool, start_sidecar) -> None:
    sc = start_sidecar(pool)
    with Exchange(sc.running.ext_proc_target) as ex:
        ex.send(headers_message({":method": "GET", ":path": "/v1/models"}, end=True))
        models = _immediate(ex)
    assert models.status.code == 200 and json.loads(models.body)["data"][0]["id"] == "test/model"
    with Exchange(sc.running.ext_proc_target) as ex:
        ex.send(headers_message({":method": "GET", ":path": "/metrics"}, end=True))
        assert _immediate(ex).status.code == 404


def test_a_decision_past_its_timeout_is_503(pool, start_sidecar) -> None:
    sc = start_sidecar(pool, gateway={"decision_timeout_s": 1e-6})
    big = completion_body(("word" * 400 + " ") * 200)  # 320 KB: parsed off the loop
    with Exchange(sc.running.ext_proc_target) as ex:
        refused = _decide(ex, big).immediate_response
    assert (
        refused.status.code == 503
        and "decision_timeout_s" in json.loads(refused.body)["error"]["message"]
    )


def test_health_answers_for_liveness_readiness_and_the_service(pool, start_sidecar) -> None:
    sc = start_sidecar(pool)
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(sc.running.ext_proc_target))
    for name in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
        answer = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING, name


def test_request_trailers_end_the_body_and_are_answered_last(pool, start_sidecar) -> None:
    sc = start_sidecar(pool)
    with Exchange(sc.running.ext_proc_target) as ex:
        ex.send(headers_message(post_headers()))
        ex.send(body_message(completion_body(), False))
        ex.send(pb.ProcessingRequest(request_trailers=pb.HttpTrailers()))
        kinds = [ex.read() for _ in range(3)]
    assert [k.WhichOneof("response") for k in kinds] == [
        "request_headers",
        "request_body",
        "request_trailers",
    ]
    streamed = kinds[1].request_body.response.body_mutation.streamed_response
    assert json.loads(streamed.body)["prompt"] and not streamed.end_of_stream  # trailers end it


def test_a_body_mode_that_cannot_carry_a_decision_is_refused_as_such(pool, start_sidecar) -> None:
    sc = start_sidecar(pool)
    streamed = 1  # ProcessingMode.STREAMED: header changes after the headers answer are lost
    with Exchange(sc.running.ext_proc_target) as ex:
        ex.send(headers_message(post_headers(), mode=streamed))
        refused = _immediate(ex)
    assert refused.status.code == 500 and b"FULL_DUPLEX_STREAMED or BUFFERED" in refused.body


def test_readiness_follows_draining_and_liveness_stays(pool, start_sidecar) -> None:
    sc = start_sidecar(pool)
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(sc.running.ext_proc_target))

    def status(name: str) -> int:
        return stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status

    sc.call(lambda: setattr(sc.running.service, "draining", True))
    deadline = time.monotonic() + 5
    while status("readiness") == health_pb2.HealthCheckResponse.SERVING:
        assert time.monotonic() < deadline, "readiness never followed draining"
        time.sleep(0.05)
    assert (
        status("envoy.service.ext_proc.v3.ExternalProcessor")
        != health_pb2.HealthCheckResponse.SERVING
    )
    assert status("liveness") == health_pb2.HealthCheckResponse.SERVING
