"""Where the Kubernetes API is and how to authenticate: `load_credentials`.

Sources, first match wins: an explicit kubeconfig path; ``KUBERNETES_API`` (base URL) with
``KUBERNETES_TOKEN`` (else the service-account token), ``KUBERNETES_INSECURE=1`` skipping TLS
verification (tests point this at kmock or a test server); in a pod, the service-account token and
CA (``KUBERNETES_SERVICE_HOST``/``_PORT``); ``$KUBECONFIG`` or ``~/.kube/config`` through the
`kubernetes` package's loader (imported only then). Used by `kubeclient.client.Kube`.
"""

from __future__ import annotations

import dataclasses
import os
import ssl
from pathlib import Path

__all__ = ["SA_DIR", "Credentials", "KubeUnavailable", "load_credentials"]

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class KubeUnavailable(RuntimeError):
    """No API server or no credentials."""


@dataclasses.dataclass(frozen=True, slots=True)
class Credentials:
    """Where the API server is and how to talk to it."""

    base: str  # scheme://host:port, no trailing slash
    authorization: str  # the Authorization header's value ("Bearer ..."), "" for none
    tls: ssl.SSLContext | None  # None: plain http


def load_credentials(kubeconfig: str | None = None) -> Credentials:
    """The first source that applies, in the order of the module docstring."""
    if kubeconfig:
        return _from_kubeconfig(kubeconfig)
    base = os.environ.get("KUBERNETES_API")
    if base:
        return _bearer(base, _token(), ssl.create_default_context())
    host = os.environ.get("KUBERNETES_SERVICE_HOST")
    why = "not in a cluster and KUBERNETES_API is not set"
    if host:
        try:
            token = _token()
        except KubeUnavailable as exc:
            why = str(exc)
        else:
            port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
            url = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
            return _bearer(url, token, ssl.create_default_context(cafile=str(SA_DIR / "ca.crt")))
    path = os.environ.get("KUBECONFIG") or str(Path.home() / ".kube" / "config")
    try:
        return _from_kubeconfig(path)
    except KubeUnavailable as exc:
        raise KubeUnavailable(f"no Kubernetes API: {why}; {exc}") from None


def _token() -> str:
    token = os.environ.get("KUBERNETES_TOKEN")
    if token is not None:
        return token
    try:
        return (SA_DIR / "token").read_text().strip()
    except OSError:
        raise KubeUnavailable("no service-account token and KUBERNETES_TOKEN is not set") from None


def _bearer(base: str, token: str, context: ssl.SSLContext) -> Credentials:
    if os.environ.get("KUBERNETES_INSECURE") == "1":
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    tls = context if base.startswith("https") else None
    return Credentials(base.rstrip("/"), f"Bearer {token}", tls)


def _from_kubeconfig(path: str) -> Credentials:
    from kubernetes import client, config

    cfg = client.Configuration()
    try:
        config.load_kube_config(  # type: ignore[no-untyped-call]
            config_file=path, client_configuration=cfg
        )
    except (config.ConfigException, OSError) as exc:
        raise KubeUnavailable(f"kubeconfig {path}: {exc}") from None
    token = cfg.get_api_key_with_prefix("BearerToken") or cfg.get_api_key_with_prefix(
        "authorization"
    )
    ctx: ssl.SSLContext | None = None
    if str(cfg.host).startswith("https"):
        if cfg.verify_ssl:
            ctx = ssl.create_default_context(cafile=cfg.ssl_ca_cert or None)
        else:
            ctx = ssl.create_default_context()
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        if cfg.cert_file and cfg.key_file:
            ctx.load_cert_chain(cfg.cert_file, cfg.key_file)
    return Credentials(str(cfg.host).rstrip("/"), token or "", ctx)
