"""Who may reach the router, and with what: the `auth`, `grpc` and `gateway` sections of the config.

`parse_auth` reads the front door's API keys file and the key sent to the pods; `parse_grpc` the
gRPC port's token, TLS, and its bookings' limits and lease; `parse_gateway` what the endpoint
picker behind Envoy answers (`sidecar.epp`); `check_exposure` refuses a gRPC or ext_proc listen
address beyond loopback without credentials (CONFIG.md, "Security"). Called by `sidecar.config`,
whose `parse_config` puts the results in `SidecarConfig.auth`, `.grpc` and `.gateway`.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from disaggpool.formats.fields import FieldReader

__all__ = [
    "DEFAULT_GRPC_LISTEN",
    "AuthConfig",
    "GatewayConfig",
    "GrpcConfig",
    "GrpcTLS",
    "check_exposure",
    "is_loopback",
    "parse_auth",
    "parse_gateway",
    "parse_grpc",
]

DEFAULT_GRPC_LISTEN = "127.0.0.1:50051"  # loopback unless gRPC credentials are configured


@dataclasses.dataclass(frozen=True, slots=True)
class AuthConfig:
    """The front door's API keys and the key the router sends to pods (CONFIG.md, "Security")."""

    api_keys_file: str = ""  # clients: `Authorization: Bearer <key>`, one key per line
    upstream_api_key_file: str = ""  # pods started with vLLM's --api-key


@dataclasses.dataclass(frozen=True, slots=True)
class GrpcTLS:
    cert_file: str
    key_file: str
    client_ca_file: str = ""  # set: clients must present a certificate it signed


@dataclasses.dataclass(frozen=True, slots=True)
class GrpcConfig:
    """Who may call the gRPC router, and how much of the pool its callers may book."""

    token_file: str = ""  # every call carries `authorization: Bearer <token>`
    tls: GrpcTLS | None = None
    allow_unauthenticated: bool = False  # listen beyond loopback with neither token nor TLS
    lease_s: float = 60.0  # a Route not Reported on within it is forgotten (each Report renews)
    max_inflight: int = 512  # gRPC bookings, apart from the front door's max_inflight
    # Per peer address; the whole gRPC share by default, since one gateway often carries all
    # the traffic: set it lower where several clients must not crowd each other out.
    max_inflight_per_client: int = 512

    @property
    def authenticated(self) -> bool:
        return bool(self.token_file) or (self.tls is not None and bool(self.tls.client_ca_file))


@dataclasses.dataclass(frozen=True, slots=True)
class GatewayConfig:
    """The endpoint picker's answers (`sidecar.epp`, docs/gateway.md).

    `destination_port`: 0 sends Envoy to the decode pod's own host:port (from its URL); N sends
    it to port N on the decode pod's host (the `disaggpool pd-proxy` beside the engine).
    `decision_timeout_s`: the longest a decision (body parse, prompt count, routing) may take;
    Envoy has no message timeout in full-duplex mode, so the picker bounds itself (503 past it).
    """

    destination_port: int = 0
    decision_timeout_s: float = 1.0


def parse_gateway(rd: FieldReader, raw: Any) -> GatewayConfig:
    g = rd.mapping(raw or {}, "gateway")
    rd.known(g, "gateway", {"destination_port", "decision_timeout_s"})
    port = rd.integer(g.get("destination_port", 0), "gateway.destination_port", minimum=0)
    if port > 65535:
        raise rd.fail("gateway.destination_port", f"not a port: {port}")
    timeout = rd.number(
        g.get("decision_timeout_s", 1.0), "gateway.decision_timeout_s", positive=True
    )
    return GatewayConfig(port, timeout)


def parse_auth(rd: FieldReader, raw: Any, base: Path | None) -> AuthConfig:
    a = rd.mapping(raw, "auth")
    rd.known(a, "auth", {"api_keys_file", "upstream_api_key_file"})
    files = {
        key: rd.path(a[key], f"auth.{key}", base)
        for key in ("api_keys_file", "upstream_api_key_file")
        if key in a
    }
    return AuthConfig(**files)


def parse_grpc(rd: FieldReader, raw: Any, base: Path | None) -> GrpcConfig:
    g = rd.mapping(raw, "grpc")
    keys = {"token_file", "tls", "allow_unauthenticated", "lease_s", "max_inflight"}
    rd.known(g, "grpc", keys | {"max_inflight_per_client"})
    tls = None
    if "tls" in g:
        t = rd.mapping(g["tls"], "grpc.tls")
        rd.known(t, "grpc.tls", {"cert_file", "key_file", "client_ca_file"})
        tls = GrpcTLS(
            rd.path(t.get("cert_file"), "grpc.tls.cert_file", base),
            rd.path(t.get("key_file"), "grpc.tls.key_file", base),
            rd.path(t["client_ca_file"], "grpc.tls.client_ca_file", base)
            if "client_ca_file" in t
            else "",
        )
    total = rd.integer(g.get("max_inflight", 512), "grpc.max_inflight", minimum=1)
    per_client = rd.integer(
        g.get("max_inflight_per_client", total), "grpc.max_inflight_per_client", minimum=1
    )
    if per_client > total:
        raise rd.fail(
            "grpc.max_inflight_per_client", f"must be at most grpc.max_inflight ({total})"
        )
    return GrpcConfig(
        token_file=rd.path(g["token_file"], "grpc.token_file", base) if "token_file" in g else "",
        tls=tls,
        allow_unauthenticated=rd.boolean(
            g.get("allow_unauthenticated", False), "grpc.allow_unauthenticated"
        ),
        lease_s=rd.number(g.get("lease_s", 60.0), "grpc.lease_s", positive=True),
        max_inflight=total,
        max_inflight_per_client=per_client,
    )


def check_exposure(rd: FieldReader, kwargs: Mapping[str, Any]) -> None:
    """The gRPC router books pods and reports outcomes: anyone who reaches it can fill the pool
    or fake goodput. Beyond loopback it needs a token or client certificates, or an explicit
    `grpc.allow_unauthenticated` (for a network that is itself the boundary)."""
    grpc: GrpcConfig = kwargs.get("grpc", GrpcConfig())
    # The ext_proc port routes and books requests just as the gRPC router does: the same rule.
    for key in ("grpc", "ext_proc"):
        address = kwargs.get(f"{key}_listen", DEFAULT_GRPC_LISTEN if key == "grpc" else "")
        host = address.rpartition(":")[0].strip("[]")
        if not address or is_loopback(host) or grpc.authenticated or grpc.allow_unauthenticated:
            continue
        raise rd.fail(
            f"listen.{key}",
            f"{address} is reachable beyond this machine: set grpc.token_file or grpc.tls with "
            "client_ca_file, or grpc.allow_unauthenticated: true",
        )


def is_loopback(host: str) -> bool:
    """Whether a listen host answers only this machine (`localhost`, 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
