"""The only module of the operator that talks to the Kubernetes API: a small async REST client.

Why not the generated `kubernetes` client for the calls themselves: the operator renders plain
dicts and only needs get/list/create/merge-patch/delete by path, and a 30-line aiohttp client keeps
every request visible (content type, selectors) and avoids model round-trips that drop unknown
fields. Credentials come from the `kubernetes` package's config loaders (in-cluster service
account, else ``$KUBECONFIG`` / ``~/.kube/config``), the same sources Kopf uses.

Label selectors are also applied client-side: the kmock emulator used in the fast tests ignores
``labelSelector``, and filtering twice is harmless on a real API server.
"""

from __future__ import annotations

import datetime as dt
import ssl
import uuid
from collections.abc import Mapping
from typing import Any

import aiohttp

__all__ = ["ApiError", "Kube", "path_for"]

_PLURALS = {
    "ConfigMap": "configmaps",
    "Service": "services",
    "ServiceAccount": "serviceaccounts",
    "Pod": "pods",
    "Event": "events",
    "Deployment": "deployments",
    "Job": "jobs",
    "Role": "roles",
    "RoleBinding": "rolebindings",
    "DisaggPool": "disaggpools",
}


class ApiError(RuntimeError):
    """A non-2xx answer from the API server."""

    def __init__(self, method: str, path: str, status: int, body: str) -> None:
        self.status = status
        super().__init__(f"{method} {path}: HTTP {status}: {body[:300]}")


def path_for(api_version: str, kind: str, namespace: str, name: str | None = None) -> str:
    """The REST path of a namespaced collection or object."""
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = f"{base}/namespaces/{namespace}/{_PLURALS[kind]}"
    return f"{path}/{name}" if name else path


def _matches(obj: Mapping[str, Any], selector: Mapping[str, str]) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return all(labels.get(k) == v for k, v in selector.items())


class Kube:
    """An authenticated session against one API server."""

    def __init__(
        self,
        host: str,
        headers: Mapping[str, str],
        ssl_context: ssl.SSLContext | bool,
    ) -> None:
        self.host = host.rstrip("/")
        self._headers = dict(headers)
        self._ssl = ssl_context
        self._session: aiohttp.ClientSession | None = None

    @classmethod
    def from_environment(cls, kubeconfig: str | None = None) -> Kube:
        """In-cluster service account if present, else `kubeconfig` / ``$KUBECONFIG``."""
        import os

        from kubernetes import client, config

        cfg = client.Configuration()
        path = kubeconfig or os.environ.get("KUBECONFIG") or None
        try:
            if kubeconfig:
                raise config.ConfigException("explicit kubeconfig")
            config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
        except config.ConfigException:
            config.load_kube_config(  # type: ignore[no-untyped-call]
                config_file=path, client_configuration=cfg
            )
        headers: dict[str, str] = {}
        token = cfg.get_api_key_with_prefix("BearerToken") or cfg.get_api_key_with_prefix(
            "authorization"
        )
        if token:
            headers["Authorization"] = token
        ctx: ssl.SSLContext | bool = False
        if str(cfg.host).startswith("https"):
            if cfg.verify_ssl:
                ctx = ssl.create_default_context(cafile=cfg.ssl_ca_cert or None)
            else:
                ctx = ssl.create_default_context()
                ctx.check_hostname = False
                ctx.verify_mode = ssl.CERT_NONE
            if cfg.cert_file and cfg.key_file:
                ctx.load_cert_chain(cfg.cert_file, cfg.key_file)
        return cls(str(cfg.host), headers, ctx)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _request(
        self,
        method: str,
        path: str,
        body: Any = None,
        content_type: str = "application/json",
        params: Mapping[str, str] | None = None,
    ) -> Any:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                headers=self._headers,
                connector=aiohttp.TCPConnector(ssl=self._ssl, limit=32),
                timeout=aiohttp.ClientTimeout(total=30),
            )
        headers = {"Content-Type": content_type} if body is not None else {}
        async with self._session.request(
            method, self.host + path, json=body, headers=headers, params=params
        ) as resp:
            if resp.status >= 300:
                raise ApiError(method, path, resp.status, await resp.text())
            if resp.content_length == 0:
                return None
            return await resp.json(content_type=None)

    async def get(self, path: str) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        try:
            result: dict[str, Any] = await self._request("GET", path)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise
        return result

    async def list(self, path: str, selector: Mapping[str, str]) -> list[dict[str, Any]]:
        sel = ",".join(f"{k}={v}" for k, v in sorted(selector.items()))
        doc = await self._request("GET", path, params={"labelSelector": sel} if sel else None)
        items: list[dict[str, Any]] = (doc or {}).get("items") or []
        return [o for o in items if _matches(o, selector)]

    async def create(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        result: dict[str, Any] = await self._request("POST", path, dict(body))
        return result

    async def merge_patch(self, path: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        result: dict[str, Any] = await self._request(
            "PATCH", path, dict(patch), "application/merge-patch+json"
        )
        return result

    async def delete(self, path: str) -> bool:
        """Delete with background propagation (the GC removes dependents); False if already gone."""
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"}
        try:
            await self._request("DELETE", path, body)
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    async def event(
        self,
        involved: Mapping[str, Any],
        reason: str,
        message: str,
        *,
        warning: bool = False,
    ) -> None:
        """Record a core/v1 Event on an object (what `kubectl describe` shows)."""
        md = involved.get("metadata") or {}
        namespace = str(md.get("namespace") or "default")
        now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {
                "name": f"{md.get('name', 'obj')}.{uuid.uuid4().hex[:16]}",
                "namespace": namespace,
            },
            "involvedObject": {
                "apiVersion": involved.get("apiVersion"),
                "kind": involved.get("kind"),
                "name": md.get("name"),
                "namespace": namespace,
                "uid": md.get("uid"),
                "resourceVersion": md.get("resourceVersion"),
            },
            "reason": reason,
            "message": message[:1024],
            "type": "Warning" if warning else "Normal",
            "source": {"component": "disaggpool-operator"},
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
            "reportingComponent": "disaggpool-operator",
            "reportingInstance": "disaggpool-operator",
        }
        await self.create(path_for("v1", "Event", namespace), body)
