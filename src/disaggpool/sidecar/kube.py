"""Watching Kubernetes objects by label selector over plain REST (list, then watch, re-list).

The sidecar needs two live sets: the pool's vLLM pods (membership) and the ConfigMaps holding
their calibration profiles. `watch_objects` keeps a name -> object dict current and calls back
after every change: a LIST gives the starting set and a resourceVersion, a WATCH from there
streams ADDED / MODIFIED / DELETED; when the watch ends (server timeout, 410 Gone, network) it
lists again, after a back-off on errors. The selector is also applied locally (equality terms
only), so an API server that ignores `labelSelector` cannot leak foreign objects in.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import quote

import aiohttp

__all__ = ["KubeError", "matches", "parse_selector", "watch_objects"]

log = logging.getLogger("disaggpool.sidecar.kube")

Objects = dict[str, dict[str, Any]]


class KubeError(RuntimeError):
    """The API server refused a request."""


def parse_selector(selector: str) -> dict[str, str]:
    """``a=b,c==d`` -> {a: b, c: d}; only equality terms (what the sidecar's config uses)."""
    terms: dict[str, str] = {}
    for term in filter(None, (t.strip() for t in selector.split(","))):
        key, sep, value = term.replace("==", "=").partition("=")
        if not sep or not key.strip() or "!" in key:
            raise ValueError(f"selector term {term!r}: only key=value terms are supported")
        terms[key.strip()] = value.strip()
    return terms


def matches(obj: Mapping[str, Any], terms: Mapping[str, str]) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return all(labels.get(k) == v for k, v in terms.items())


async def watch_objects(
    session: aiohttp.ClientSession,
    base: str,
    token: str,
    tls: ssl.SSLContext | None,
    path: str,
    selector: str,
    on_change: Callable[[Objects], None],
    *,
    retry_s: float = 2.0,
) -> None:
    """Run forever (until cancelled), calling `on_change(objects)` after every change.

    `path` is a collection such as ``/api/v1/namespaces/ns/pods``.
    """
    terms = parse_selector(selector)
    headers = {"Authorization": f"Bearer {token}", "Accept": "application/json"}
    sel = quote(selector, safe="=,")
    ssl_arg: ssl.SSLContext | bool = tls if tls is not None else False
    objects: Objects = {}
    while True:
        try:
            url = f"{base}{path}?labelSelector={sel}"
            async with session.get(url, headers=headers, ssl=ssl_arg) as resp:
                if resp.status != 200:
                    raise KubeError(f"LIST {path}: HTTP {resp.status}: {(await resp.text())[:200]}")
                listing = await resp.json()
            objects = {
                o["metadata"]["name"]: o for o in listing.get("items") or [] if matches(o, terms)
            }
            on_change(dict(objects))
            version = (listing.get("metadata") or {}).get("resourceVersion", "")
            watch = f"{url}&watch=1&allowWatchBookmarks=true&timeoutSeconds=300"
            if version and version.isdigit():
                watch += f"&resourceVersion={version}"
            timeout = aiohttp.ClientTimeout(total=None, sock_read=330)
            async with session.get(watch, headers=headers, ssl=ssl_arg, timeout=timeout) as resp:
                if resp.status != 200:
                    raise KubeError(f"WATCH {path}: HTTP {resp.status}")
                async for raw in resp.content:
                    if not raw.strip():
                        continue
                    event = json.loads(raw)
                    kind, obj = event.get("type"), event.get("object") or {}
                    if kind == "ERROR":  # e.g. 410 Gone: our version is too old; list again
                        break
                    name = (obj.get("metadata") or {}).get("name")
                    if kind == "BOOKMARK" or not name:
                        continue
                    if kind == "DELETED" or not matches(obj, terms):
                        if objects.pop(name, None) is None:
                            continue
                    else:
                        objects[name] = obj
                    on_change(dict(objects))
        except asyncio.CancelledError:
            raise
        except (aiohttp.ClientError, KubeError, ValueError, KeyError, OSError) as exc:
            log.warning("watching %s: %s; retrying in %.0f s", path, exc, retry_s)
            await asyncio.sleep(retry_s)
