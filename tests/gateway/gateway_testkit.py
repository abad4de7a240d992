"""Helpers of the gateway tests: an emulated pool, a sidecar with its endpoint picker, and a
hand-driven ext_proc client speaking to it as Envoy would.

(A module with a unique name rather than `conftest`, so imports never pick another directory's.)
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import struct_pb2

from disaggpool import promtext
from disaggpool.core.hardware import builtin_profile
from disaggpool.core.profile import CalibrationProfile
from disaggpool.emulator.config import EmulatorConfig
from disaggpool.emulator.harness import EmulatorThread
from disaggpool.formats.profiles import save_profile
from disaggpool.sidecar.config import SidecarConfig, parse_config

MODEL = "test/model"
A40 = builtin_profile("a40-llama3-8b")
FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
BUFFERED = processing_mode_pb2.ProcessingMode.BUFFERED


@dataclasses.dataclass
class Pool:
    pods: dict[str, tuple[str, EmulatorThread]]  # name -> (role, emulator)
    profiles_dir: Path

    def urls(self, role: str) -> list[dict[str, str]]:
        return [{"name": n, "url": e.url} for n, (r, e) in self.pods.items() if r == role]

    def address(self, name: str) -> str:
        return f"127.0.0.1:{self.pods[name][1].port}"

    def stop(self) -> None:
        for _, emu in self.pods.values():
            emu.stop()


def start_pool(
    tmp: Path, prefill: Sequence[CalibrationProfile], decode: Sequence[CalibrationProfile]
) -> Pool:
    """Real emulated pods on loopback, each pod's true profile written as if probed."""
    pods: dict[str, tuple[str, EmulatorThread]] = {}
    profiles = tmp / "profiles"
    profiles.mkdir(exist_ok=True)
    for role, group in (("prefill", prefill), ("decode", decode)):
        for i, profile in enumerate(group):
            name = f"{role[0]}{i}"
            config = EmulatorConfig(
                profile, port=0, side_channel_port=0, side_channel_host="127.0.0.1",
                jitter=0.0, model=MODEL,
            )  # fmt: skip
            pods[name] = (role, EmulatorThread(config).start())
            save_profile(profile, profiles / f"{name}.yaml")
    return Pool(pods, profiles)


def sidecar_config(pool: Pool, /, **overrides: Any) -> SidecarConfig:
    doc: dict[str, Any] = {
        "policy": "calibrated",
        "model": MODEL,
        "listen": {"http": "127.0.0.1:0", "grpc": "127.0.0.1:0", "ext_proc": "127.0.0.1:0"},
        "slo_classes": [
            {"name": "interactive", "ttft_s": 2.0, "tpot_s": 0.2},
            {"name": "batch", "ttft_s": 30.0, "tpot_s": 1.0, "sheddable": True},
        ],
        "scrape_interval_s": 0.2,
        "tokenizer": {"kind": "emulator"},
        "pool": {"static": {"prefill": pool.urls("prefill"), "decode": pool.urls("decode")}},
        "profiles": {"dir": str(pool.profiles_dir)},
    }
    doc.update(overrides)
    return parse_config(doc, "<test>")


def metric(base_url: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` on `base_url`/metrics whose labels include `labels`."""
    import urllib.request

    text = urllib.request.urlopen(f"{base_url}/metrics", timeout=10).read().decode()
    return promtext.total(promtext.parse(text, [name]), name, labels)


# ---------------------------------------------------------------------- a hand-driven Envoy
def headers_message(
    headers: dict[str, str],
    *,
    end: bool = False,
    mode: int = FULL_DUPLEX,
    subset: list[str] | str | None = None,
) -> pb.ProcessingRequest:
    """The first message of a stream, as Envoy sends it (values in `raw_value`)."""
    m = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[
                    base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()
                ]
            ),
            end_of_stream=end,
        ),
        protocol_config=pb.ProtocolConfiguration(request_body_mode=mode, response_body_mode=mode),
    )
    if subset is not None:
        hint = struct_pb2.Struct()
        hint.update({"x-gateway-destination-endpoint-subset": subset})
        m.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    return m


def post_headers(path: str = "/v1/completions", **extra: str) -> dict[str, str]:
    base = {":method": "POST", ":path": path, ":authority": "gw"}
    return {**base, "content-type": "application/json", **extra}


def body_message(chunk: bytes, end: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=chunk, end_of_stream=end))


def response_headers_message(
    status: int, content_type: str, end: bool = False
) -> pb.ProcessingRequest:
    h = {":status": str(status), "content-type": content_type}
    return pb.ProcessingRequest(
        response_headers=pb.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in h.items()]
            ),
            end_of_stream=end,
        )
    )


def response_body_message(chunk: bytes, end: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=chunk, end_of_stream=end))


class Exchange:
    """One Process stream on a real gRPC channel, written and read one message at a time."""

    def __init__(self, target: str, metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self.channel = grpc.insecure_channel(target)
        self._outbox: list[pb.ProcessingRequest] = []
        import queue

        self._queue: queue.Queue[pb.ProcessingRequest | None] = queue.Queue()
        stub = pb_grpc.ExternalProcessorStub(self.channel)
        self.call = stub.Process(iter(self._queue.get, None), metadata=metadata or None)
        self._answers: Iterator[pb.ProcessingResponse] = iter(self.call)

    def send(self, message: pb.ProcessingRequest) -> None:
        self._queue.put(message)

    def read(self) -> pb.ProcessingResponse:
        return next(self._answers)

    def close(self) -> None:
        self._queue.put(None)

    def cancel(self) -> None:
        self.call.cancel()
        self.channel.close()

    def __enter__(self) -> Exchange:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        self.channel.close()


def set_headers(mutation: pb.HeaderMutation) -> dict[str, str]:
    return {
        h.header.key: h.header.raw_value.decode() or h.header.value for h in mutation.set_headers
    }


def completion_body(prompt: str = "hello world " * 8, **extra: Any) -> bytes:
    return json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 4, **extra}).encode()
