"""Who may use the router: API keys at the front door (rotated without a restart), the pods' own
key passed upstream to pods started with --api-key, a token or client certificates on gRPC, and
gRPC bookings that cannot starve the front door. Real emulated pods, real sidecar, real gRPC."""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from sidecar_testkit import A40, MODEL, metric, post

from disaggpool.router.v1 import router_pb2 as pb
from disaggpool.router.v1 import router_pb2_grpc as pb_grpc

BODY = {"model": MODEL, "prompt": "tell me a story", "max_tokens": 3}


def _write(path: Path, text: str) -> str:
    # A mounted Secret is replaced, not edited: write aside and rename, so the mtime moves.
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return str(path)


def test_front_door_keys_are_checked_and_rotated(start_pool, start_sidecar, tmp_path) -> None:
    pool = start_pool([A40], [A40])
    keys = _write(tmp_path / "keys", "first-key\n\nsecond-key\n")
    sc = start_sidecar(pool, auth={"api_keys_file": keys})
    url = f"{sc.url}/v1/completions"
    assert post(url, BODY)[0] == 401
    status, body = post(url, BODY, {"Authorization": "Bearer wrong"})
    assert status == 401 and body["error"]["type"] == "AuthenticationError"
    assert post(url, BODY, {"Authorization": "Basic first-key"})[0] == 401
    assert post(url, BODY, {"Authorization": "Bearer first-key"})[0] == 200
    assert post(url, BODY, {"Authorization": "bearer second-key"})[0] == 200
    # The probes and the metrics stay open, as vLLM's do.
    for path in ("/livez", "/readyz", "/health", "/metrics"):
        with urllib.request.urlopen(f"{sc.url}{path}", timeout=10) as resp:
            assert resp.status == 200
    assert metric(sc.url, "disaggpool_auth_failures_total", port="http") == 3

    time.sleep(1.1)  # the file is looked at once a second at most
    _write(tmp_path / "keys", "third-key\n")
    deadline = time.monotonic() + 5
    while post(url, BODY, {"Authorization": "Bearer third-key"})[0] != 200:
        assert time.monotonic() < deadline, "the rotated key was never accepted"
        time.sleep(0.2)
    assert post(url, BODY, {"Authorization": "Bearer first-key"})[0] == 401
    # No key of ours leaks to the pods: they were started without --api-key and never saw one.


def test_the_pods_own_key_goes_upstream(start_pool, start_sidecar, tmp_path) -> None:
    pool = start_pool([A40], [A40, A40], api_keys=("pod-key",))
    without = start_sidecar(pool)
    # The pods refuse a leg without their key: the prefill pod's 401 is passed through.
    assert post(f"{without.url}/v1/completions", BODY)[0] == 401

    key = _write(tmp_path / "pod-key", "pod-key\n")
    keys = _write(tmp_path / "client-keys", "client-key\n")
    sc = start_sidecar(pool, auth={"api_keys_file": keys, "upstream_api_key_file": key})
    status, body = post(f"{sc.url}/v1/completions", BODY, {"Authorization": "Bearer client-key"})
    assert status == 200 and body["usage"]["completion_tokens"] == 3
    stream = {**BODY, "stream": True}
    req = urllib.request.Request(
        f"{sc.url}/v1/completions",
        data=json.dumps(stream).encode(),
        headers={"Authorization": "Bearer client-key", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.read().rstrip().endswith(b"data: [DONE]")
    # Its /v1/models (the pods' max_model_len) was read with the key too.
    assert sc.call(lambda: sc.running.service.max_model_len()) == A40.max_model_len


@pytest.fixture
def token_router(start_pool, start_sidecar, tmp_path):
    pool = start_pool([A40], [A40])
    token = _write(tmp_path / "token", "s3cret\n")
    sc = start_sidecar(
        pool,
        listen={"http": "127.0.0.1:0", "grpc": "0.0.0.0:0"},  # opened: it has a token
        grpc={"token_file": token},
    )
    channel = grpc.insecure_channel(sc.grpc_target)
    yield sc, pb_grpc.RouterStub(channel), channel
    channel.close()


def test_grpc_needs_its_token(token_router) -> None:
    sc, stub, channel = token_router
    request = pb.RouteRequest(request_id="r1", prompt_tokens=100)
    for call, message in (
        (stub.Route, request),
        (stub.GetPoolSnapshot, pb.GetPoolSnapshotRequest()),
        (stub.Report, pb.ReportRequest(request_id="r1", stage=pb.STAGE_FAILED)),
    ):
        for metadata in ((), (("authorization", "Bearer nope"),)):
            with pytest.raises(grpc.RpcError) as err:
                call(message, metadata=metadata)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    auth = (("authorization", "Bearer s3cret"),)
    assert stub.Route(request, metadata=auth).decode.name == "d0"
    assert stub.GetPoolSnapshot(pb.GetPoolSnapshotRequest(), metadata=auth).inflight == 1
    # Health needs nothing: a load balancer asks it.
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert metric(sc.url, "disaggpool_auth_failures_total", port="grpc") == 6


def _certificates(folder: Path) -> dict[str, bytes]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, made by openssl."""

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=test-ca",
        "-keyout", "ca.key", "-out", "ca.crt")  # fmt: skip
    (folder / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for who in ("server", "client"):
        run("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={who}",
            "-keyout", f"{who}.key", "-out", f"{who}.csr")  # fmt: skip
        run("x509", "-req", "-in", f"{who}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "1", "-extfile", "san.ext",
            "-out", f"{who}.crt")  # fmt: skip
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.suffix in (".crt", ".key")}


def test_grpc_over_tls_with_client_certificates(start_pool, start_sidecar, tmp_path) -> None:
    certs = _certificates(tmp_path)
    pool = start_pool([A40], [A40])
    sc = start_sidecar(
        pool,
        listen={"http": "127.0.0.1:0", "grpc": "0.0.0.0:0"},
        grpc={
            "tls": {
                "cert_file": str(tmp_path / "server.crt"),
                "key_file": str(tmp_path / "server.key"),
                "client_ca_file": str(tmp_path / "ca.crt"),
            }
        },
    )
    request = pb.RouteRequest(request_id="t1", prompt_tokens=100)
    good = grpc.ssl_channel_credentials(certs["ca.crt"], certs["client.key"], certs["client.crt"])
    with grpc.secure_channel(sc.grpc_target, good) as channel:
        assert pb_grpc.RouterStub(channel).Route(request, timeout=10).decode.name == "d0"
    anonymous = grpc.ssl_channel_credentials(certs["ca.crt"])
    with grpc.secure_channel(sc.grpc_target, anonymous) as channel:
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.RouterStub(channel).Route(request, timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # the handshake is refused
    with grpc.insecure_channel(sc.grpc_target) as channel, pytest.raises(grpc.RpcError):
        pb_grpc.RouterStub(channel).Route(request, timeout=10)


def test_grpc_bookings_have_their_own_limits_and_a_lease(start_pool, start_sidecar) -> None:
    pool = start_pool([A40], [A40])
    sc = start_sidecar(
        pool,
        max_inflight=4,
        grpc={"lease_s": 2.0, "max_inflight": 6, "max_inflight_per_client": 3},
    )
    with grpc.insecure_channel(sc.grpc_target) as channel:
        stub = pb_grpc.RouterStub(channel)
        for i in range(3):
            stub.Route(pb.RouteRequest(request_id=f"g{i}", prompt_tokens=100))
        with pytest.raises(grpc.RpcError) as err:  # this client's share is full
            stub.Route(pb.RouteRequest(request_id="g3", prompt_tokens=100))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_inflight_per_client" in (err.value.details() or "")
        # The front door's own limit (4) is untouched by the 3 gRPC bookings.
        assert post(f"{sc.url}/v1/completions", BODY)[0] == 200
        # A report renews a lease; the others lapse and are counted as failed.
        time.sleep(1.2)
        assert stub.Report(pb.ReportRequest(request_id="g0", stage=pb.STAGE_PREFILLED)).known
        time.sleep(1.2)
        deadline = time.monotonic() + 5
        while sc.call(lambda: sc.running.service.inflight) > 1:
            assert time.monotonic() < deadline, "unreported gRPC bookings never expired"
            time.sleep(0.05)
        assert sc.call(lambda: sorted(sc.running.service.state.ledger.entries)) == ["g0"]
        assert metric(sc.url, "disaggpool_requests_total", outcome="failed") == 2
        stub.Route(pb.RouteRequest(request_id="g9", prompt_tokens=100))  # room again
