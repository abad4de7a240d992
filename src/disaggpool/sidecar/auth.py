"""Who may use the router: API keys at the front door, a token or client certificates on gRPC.

* `KeyFile`: keys read from a file (one per line; a mounted Kubernetes Secret works), read again
  when it changes, so a rotated Secret takes effect without a restart;
* `bearer_ok`: the check vLLM's own `--api-key` makes (`Authorization: Bearer <key>`), in time
  that does not depend on how much of a key matched;
* `TokenInterceptor`: the same check on every call of the gRPC router service (health and
  reflection stay open: they tell nothing about the pool); a call without it gets
  UNAUTHENTICATED and is counted in `disaggpool_auth_failures_total{port="grpc"}`;
* `server_credentials`: TLS for the gRPC port, requiring client certificates when a CA is given.

Which port needs what is the config's business (`sidecar.config`: the gRPC port is loopback-only
unless it has credentials); SECURITY.md has the threat model.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import grpc

from disaggpool.sidecar.config import GrpcTLS

__all__ = ["KeyFile", "TokenInterceptor", "bearer_ok", "peer_host", "server_credentials"]

log = logging.getLogger("disaggpool.sidecar")


class KeyFile:
    """Keys read from a file, one per line, read again when the file changes (a mounted Secret
    is replaced through a symlink: its mtime moves). Checked at most once a second."""

    def __init__(self, path: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self.clock = clock
        self._keys: tuple[str, ...] = ()
        self._mtime: float | None = None
        self._checked = -1.0

    def keys(self) -> tuple[str, ...]:
        if not self.path:
            return ()
        now = self.clock()
        if now - self._checked >= 1.0:
            self._checked = now
            self._reload()
        return self._keys

    def _reload(self) -> None:
        try:
            mtime = Path(self.path).stat().st_mtime
            if mtime == self._mtime:
                return
            text = Path(self.path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            # Keep the keys we had: a Secret being swapped may be missing for an instant.
            log.error("key file %s: %s (keeping the previous keys)", self.path, exc)
            return
        self._mtime = mtime
        self._keys = tuple(k for line in text.splitlines() if (k := line.strip()))
        if not self._keys:
            log.error("key file %s holds no key", self.path)


def bearer_ok(header: str | None, keys: Sequence[str]) -> bool:
    """Whether an `Authorization` header carries one of `keys` as a Bearer token."""
    if not header or not keys:
        return False
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token:
        return False
    presented = token.strip().encode()
    # Compare against every key, always: the time taken says nothing about which one is close.
    return sum(hmac.compare_digest(presented, k.encode()) for k in keys) > 0


def peer_host(peer: str) -> str:
    """gRPC's peer string (``ipv4:127.0.0.1:5000``, ``ipv6:[::1]:5000``) without its port: the
    client a booking is counted against."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return f"{kind}:{rest.rpartition(':')[0]}"
    return peer


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls of the services under `prefix` that do not carry a token of `tokens`."""

    def __init__(self, tokens: KeyFile, prefix: str, refused: Callable[[], None]) -> None:
        self.tokens = tokens
        self.prefix = prefix
        self.refused = refused

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]
        ],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        if not details.method.startswith(self.prefix):
            return await continuation(details)
        metadata = {k: v for k, v in details.invocation_metadata or () if isinstance(v, str)}
        if bearer_ok(metadata.get("authorization"), self.tokens.keys()):
            return await continuation(details)
        self.refused()
        return _DENY


async def _deny(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
    await context.abort(
        grpc.StatusCode.UNAUTHENTICATED, "authorization: a valid Bearer token is required"
    )
    raise AssertionError("unreachable: abort raises")


_DENY: grpc.RpcMethodHandler[Any, Any] = grpc.unary_unary_rpc_method_handler(_deny)


def server_credentials(tls: GrpcTLS) -> grpc.ServerCredentials:
    """TLS for the gRPC port; with `client_ca_file`, clients must present a certificate."""
    try:
        key = Path(tls.key_file).read_bytes()
        cert = Path(tls.cert_file).read_bytes()
        ca = Path(tls.client_ca_file).read_bytes() if tls.client_ca_file else None
    except OSError as exc:
        raise OSError(f"grpc.tls: cannot read {exc.filename}: {exc.strerror}") from None
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca, require_client_auth=bool(ca)
    )
