"""The one Kubernetes API client of disaggpool: credentials, REST paths, reads, writes and watches.

Callers: the operator (`operator.reconcile`, `operator.handlers`: get/list/create/merge-patch/
delete/event), the router sidecar (`sidecar.collectors`: `Kube.watch` of its pods and profile
ConfigMaps) and the probe (`calibration.sinks`: `Kube.create_or_patch_configmap`). Import from
here; the modules are

* `credentials` -- where the API server is and how to authenticate (`load_credentials`);
* `paths`       -- REST paths, label selectors, small object accessors (pure);
* `client`      -- `Kube`, the async REST client (aiohttp), and `ApiError`.
"""

from __future__ import annotations

from disaggpool.kubeclient.client import ApiError, Kube, Objects
from disaggpool.kubeclient.credentials import (
    SA_DIR,
    Credentials,
    KubeUnavailable,
    load_credentials,
)
from disaggpool.kubeclient.paths import matches, parse_selector, path_for, pod_ready

__all__ = [
    "SA_DIR",
    "ApiError",
    "Credentials",
    "Kube",
    "KubeUnavailable",
    "Objects",
    "load_credentials",
    "matches",
    "parse_selector",
    "path_for",
    "pod_ready",
]
