"""The P/D proxy's options, checked.

`ProxyConfig.check` enforces the project's rule for ports: a listen address beyond loopback needs
API keys (`api_keys_file`), or an explicit `allow_unauthenticated` from an operator who fences
the port otherwise (a NetworkPolicy that admits only the gateway).
"""

from __future__ import annotations

import dataclasses
from urllib.parse import urlsplit

from disaggpool.errors import InputError
from disaggpool.sidecar.config import is_loopback

__all__ = ["ProxyConfig"]


@dataclasses.dataclass(frozen=True, slots=True)
class ProxyConfig:
    listen: str  # HOST:PORT
    model_server: str  # the local vLLM's base URL
    api_keys_file: str = ""  # clients' keys (Authorization: Bearer)
    upstream_api_key_file: str = ""  # the pods' key (vLLM's --api-key), on every leg
    allow_unauthenticated: bool = False
    connect_timeout_s: float = 5.0
    prefill_timeout_s: float = 60.0  # one prefill leg, whole
    decode_timeout_s: float = 600.0  # the decode leg (and any other request), whole
    idle_timeout_s: float = 60.0  # the longest silence inside a streamed answer
    max_body_bytes: int = 4 * 1024 * 1024
    debug_errors: bool = False  # error bodies name the prefill host

    def check(self) -> ProxyConfig:
        """Itself, or `InputError` naming the option."""
        src = "pd-proxy"
        host, sep, port = self.listen.rpartition(":")
        if not sep or not host or not port.isdigit() or int(port) > 65535:
            raise InputError(src, "--listen", f"must be HOST:PORT, got {self.listen!r}")
        parts = urlsplit(self.model_server)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise InputError(
                src, "--model-server", f"must be an http(s) URL, got {self.model_server!r}"
            )
        for name in ("connect_timeout_s", "prefill_timeout_s", "decode_timeout_s",
                     "idle_timeout_s"):  # fmt: skip
            if not getattr(self, name) > 0:
                raise InputError(src, "--" + name.replace("_", "-"), "must be positive")
        if self.max_body_bytes < 1:
            raise InputError(src, "--max-body-bytes", "must be positive")
        if (
            not is_loopback(host.strip("[]"))
            and not self.api_keys_file
            and not self.allow_unauthenticated
        ):
            raise InputError(
                src,
                "--listen",
                f"{self.listen} is reachable beyond this machine: give --api-keys-file, or "
                "--allow-unauthenticated where something else fences the port (a NetworkPolicy)",
            )
        return self

    @property
    def base_url(self) -> str:
        return self.model_server.rstrip("/")
