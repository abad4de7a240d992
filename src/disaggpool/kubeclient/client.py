"""`Kube`: an async REST client of one API server (aiohttp), and `ApiError`.

get/list/create/replace/merge-patch/delete by path, core/v1 Events, create-or-merge-patch of a
ConfigMap, and `watch`: list-then-watch of a collection by label selector, re-listing when the
stream ends and backing off on errors. Why plain REST rather than the generated `kubernetes` client:
callers hold plain dicts and need a handful of verbs, every request stays visible (content type,
selector), and no model round-trip drops unknown fields.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime as dt
import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import aiohttp

from disaggpool.kubeclient.credentials import Credentials, load_credentials
from disaggpool.kubeclient.paths import matches, path_for, selector_param

__all__ = ["ApiError", "Kube", "Objects"]

log = logging.getLogger("disaggpool.kubeclient")

Objects = dict[str, dict[str, Any]]

#: Events remembered for aggregation (the least recently repeated forgotten first).
_EVENTS_KEPT = 1024


class ApiError(RuntimeError):
    """A non-2xx answer from the API server."""

    def __init__(self, method: str, path: str, status: int, body: str) -> None:
        self.status = status
        super().__init__(f"{method} {path}: HTTP {status}: {body[:300]}")


class Kube:
    """An authenticated client of one API server.

    Pass `session` to share an aiohttp session (the sidecar does; it stays the caller's to close);
    without one the client opens its own on first use and `close` closes it.
    """

    def __init__(
        self,
        credentials: Credentials,
        session: aiohttp.ClientSession | None = None,
        *,
        timeout_s: float = 30.0,
    ) -> None:
        self.credentials = credentials
        self._session = session
        self._own_session = session is None
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        # Events recorded by this client: (object uid, type, reason, message) -> (namespace,
        # name, count), so that a repeat is counted on the same Event (`event`).
        self._events: collections.OrderedDict[tuple[str, ...], tuple[str, str, int]] = (
            collections.OrderedDict()
        )

    @classmethod
    def from_environment(
        cls, kubeconfig: str | None = None, session: aiohttp.ClientSession | None = None
    ) -> Kube:
        """A client with `load_credentials(kubeconfig)`; raises `KubeUnavailable`."""
        return cls(load_credentials(kubeconfig), session)

    @property
    def base(self) -> str:
        return self.credentials.base

    async def close(self) -> None:
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None

    @contextlib.asynccontextmanager
    async def _response(
        self,
        method: str,
        path: str,
        body: Any = None,
        content_type: str = "application/json",
        params: Mapping[str, str] | None = None,
        timeout: aiohttp.ClientTimeout | None = None,
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        if self._session is None:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=32))
        headers = {"Accept": "application/json"}
        if self.credentials.authorization:
            headers["Authorization"] = self.credentials.authorization
        if body is not None:
            headers["Content-Type"] = content_type
        async with self._session.request(
            method,
            self.credentials.base + path,
            json=body,
            headers=headers,
            params=params,
            ssl=self.credentials.tls if self.credentials.tls is not None else False,
            timeout=timeout or self._timeout,
        ) as resp:
            if resp.status >= 300:
                raise ApiError(method, path, resp.status, await resp.text())
            yield resp

    async def _request(
        self,
        method: str,
        path: str,
        body: Any = None,
        content_type: str = "application/json",
        params: Mapping[str, str] | None = None,
    ) -> Any:
        async with self._response(method, path, body, content_type, params) as resp:
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
        doc = await self._request("GET", path, params=selector_param(selector) or None)
        items: list[dict[str, Any]] = (doc or {}).get("items") or []
        return [o for o in items if matches(o, selector)]

    async def create(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        result: dict[str, Any] = await self._request("POST", path, dict(body))
        return result

    async def replace(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """PUT the whole object; with ``metadata.resourceVersion`` set the API server answers
        409 Conflict when the object changed since that version (optimistic concurrency)."""
        result: dict[str, Any] = await self._request("PUT", path, dict(body))
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

    async def create_or_patch_configmap(
        self,
        namespace: str,
        name: str,
        data: Mapping[str, str],
        labels: Mapping[str, str] | None = None,
        *,
        owner: Mapping[str, Any] | None = None,
    ) -> str:
        """Merge-patch ConfigMap `namespace/name` with `data` and `labels` (and `owner` as its
        only owner reference), or create it when it does not exist; returns "patched" or
        "created". Patch first: the probe's Role may patch its own ConfigMap, which the
        operator creates beforehand, and may not create any."""
        metadata: dict[str, Any] = {"name": name, "namespace": namespace}
        metadata["labels"] = dict(labels or {})
        if owner is not None:
            metadata["ownerReferences"] = [dict(owner)]
        body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": dict(data)}
        try:
            await self.merge_patch(path_for("v1", "ConfigMap", namespace, name), body)
            return "patched"
        except ApiError as exc:
            if exc.status != 404:
                raise
        try:
            await self.create(path_for("v1", "ConfigMap", namespace), body)
        except ApiError as exc:
            if exc.status != 409:  # created meanwhile: patch it
                raise
            await self.merge_patch(path_for("v1", "ConfigMap", namespace, name), body)
            return "patched"
        return "created"

    async def event(
        self,
        involved: Mapping[str, Any],
        reason: str,
        message: str,
        *,
        warning: bool = False,
        component: str = "disaggpool-operator",
    ) -> None:
        """Record a core/v1 Event on an object (what `kubectl describe` shows). The same event
        again (same object, type, reason and message) raises the `count` and `lastTimestamp` of
        the one recorded, as Kubernetes' own event recorder aggregates, rather than adding an
        Event per repeat; a new one is created if that one has expired meanwhile."""
        md = involved.get("metadata") or {}
        namespace = str(md.get("namespace") or "default")
        now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        kind = "Warning" if warning else "Normal"
        key = (str(md.get("uid")), kind, reason, message[:1024])
        seen = self._events.get(key)
        if seen is not None:
            ns, name, count = seen
            try:
                await self.merge_patch(
                    path_for("v1", "Event", ns, name), {"count": count + 1, "lastTimestamp": now}
                )
            except ApiError as exc:
                if exc.status != 404:
                    raise
            else:
                self._events[key] = (ns, name, count + 1)
                self._events.move_to_end(key)
                return
        event_name = f"{md.get('name', 'obj')}.{uuid.uuid4().hex[:16]}"
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {
                "name": event_name,
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
            "type": kind,
            "source": {"component": component},
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
            "reportingComponent": component,
            "reportingInstance": component,
        }
        await self.create(path_for("v1", "Event", namespace), body)
        self._events[key] = (namespace, event_name, 1)
        if len(self._events) > _EVENTS_KEPT:
            self._events.popitem(last=False)

    async def watch(
        self,
        path: str,
        selector: Mapping[str, str],
        on_change: Callable[[Objects], None],
        *,
        retry_s: float = 2.0,
    ) -> None:
        """Keep the name -> object dict of collection `path` current; runs until cancelled.

        LIST gives the starting set and a resourceVersion, WATCH from there streams ADDED /
        MODIFIED / DELETED, and `on_change(objects)` (a copy) follows the list and every change.
        When the watch ends (server timeout, 410 Gone, network) it lists again, after `retry_s`
        on errors.
        """
        params = selector_param(selector)
        objects: Objects = {}
        while True:
            try:
                listing = await self._request("GET", path, params=params or None) or {}
                objects = {
                    o["metadata"]["name"]: o
                    for o in listing.get("items") or []
                    if matches(o, selector)
                }
                on_change(dict(objects))
                version = (listing.get("metadata") or {}).get("resourceVersion", "")
                watch = {**params, "watch": "1", "allowWatchBookmarks": "true"}
                watch["timeoutSeconds"] = "300"
                if version and version.isdigit():
                    watch["resourceVersion"] = version
                timeout = aiohttp.ClientTimeout(total=None, sock_read=330)
                async with self._response("GET", path, params=watch, timeout=timeout) as resp:
                    async for raw in resp.content:
                        if self._apply_event(raw, objects, selector):
                            on_change(dict(objects))
            except asyncio.CancelledError:
                raise
            except _StreamEnded:
                continue
            except (aiohttp.ClientError, ApiError, ValueError, KeyError, OSError) as exc:
                log.warning("watching %s: %s; retrying in %.0f s", path, exc, retry_s)
                await asyncio.sleep(retry_s)

    @staticmethod
    def _apply_event(raw: bytes, objects: Objects, selector: Mapping[str, str]) -> bool:
        """Apply one watch line to `objects`; True when the set changed."""
        if not raw.strip():
            return False
        event = json.loads(raw)
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":  # e.g. 410 Gone: our version is too old; list again
            raise _StreamEnded
        name = (obj.get("metadata") or {}).get("name")
        if kind == "BOOKMARK" or not name:
            return False
        if kind == "DELETED" or not matches(obj, selector):
            return objects.pop(name, None) is not None
        objects[name] = obj
        return True


class _StreamEnded(Exception):
    """The watch stream reported an error event: re-list at once."""
