"""Where the Kubernetes API is and how to authenticate, for components that speak plain REST.

The probe (`calibration.sinks`) and the sidecar (`sidecar.kube`) talk to the API server over
HTTP without a Kubernetes client library. In a pod they use the service-account token and CA;
outside a cluster `KUBERNETES_API` (base URL) and `KUBERNETES_TOKEN` point them at any API
server (tests use kmock or a real kube-apiserver), `KUBERNETES_INSECURE=1` skipping TLS checks.
"""

from __future__ import annotations

import os
import ssl
from pathlib import Path

__all__ = ["SA_DIR", "KubeUnavailable", "credentials"]

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class KubeUnavailable(RuntimeError):
    """No API server or no credentials."""


def credentials() -> tuple[str, str, ssl.SSLContext | None]:
    """(base URL, bearer token, TLS context or None for plain http)."""
    base = os.environ.get("KUBERNETES_API")
    token = os.environ.get("KUBERNETES_TOKEN")
    context: ssl.SSLContext | None = None
    if not base:
        host, port = (
            os.environ.get("KUBERNETES_SERVICE_HOST"),
            os.environ.get("KUBERNETES_SERVICE_PORT", "443"),
        )
        if not host:
            raise KubeUnavailable(
                "no Kubernetes API: not in a cluster and KUBERNETES_API is not set"
            )
        base = f"https://{host}:{port}"
        context = ssl.create_default_context(cafile=str(SA_DIR / "ca.crt"))
    if token is None:
        try:
            token = (SA_DIR / "token").read_text().strip()
        except OSError:
            raise KubeUnavailable(
                "no service-account token and KUBERNETES_TOKEN is not set"
            ) from None
    if base.startswith("https") and context is None:
        context = ssl.create_default_context()
        if os.environ.get("KUBERNETES_INSECURE") == "1":
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
    return base.rstrip("/"), token, context
