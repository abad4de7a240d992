"""Where a fitted profile goes: a file, stdout, or a ConfigMap through the Kubernetes API.

The probe runs as a Kubernetes Job; the operator reads the ConfigMap it writes. The ConfigMap
is written with the pod's service-account token over the API server's REST interface (create,
or merge-patch when it exists), so the probe image needs no Kubernetes client library. Outside a
cluster, `KUBERNETES_API` and `KUBERNETES_TOKEN` point it at any API server (tests use that).
"""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from pathlib import Path

from disaggpool.core.profile import CalibrationProfile
from disaggpool.formats.profiles import dump_profile
from disaggpool.kubeapi import KubeUnavailable, credentials

__all__ = ["SinkError", "write_configmap", "write_profile"]

PROFILE_KEY = "profile.yaml"


class SinkError(RuntimeError):
    """The profile could not be delivered."""


def write_profile(profile: CalibrationProfile, out: str) -> None:
    """`out` is a path (.yaml/.yml/.json) or '-' for stdout."""
    if out == "-":
        sys.stdout.write(dump_profile(profile))
        return
    path = Path(out)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            dump_profile(profile, "json" if path.suffix == ".json" else "yaml"), encoding="utf-8"
        )
    except OSError as exc:
        raise SinkError(f"{out}: cannot write: {exc.strerror or exc}") from None


def write_configmap(
    profile: CalibrationProfile,
    target: str,
    report: dict[str, object],
    labels: dict[str, str] | None = None,
) -> None:
    """Create or replace ConfigMap `namespace/name` holding the profile and the fit report."""
    namespace, _, name = target.partition("/")
    if not namespace or not name:
        raise SinkError(f"--configmap: expected NAMESPACE/NAME, got {target!r}")
    try:
        base, token, context = credentials()
    except KubeUnavailable as exc:
        raise SinkError(str(exc)) from None
    body = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": namespace, "labels": labels or {}},
        "data": {PROFILE_KEY: dump_profile(profile), "report.json": json.dumps(report, indent=1)},
    }
    url = f"{base}/api/v1/namespaces/{namespace}/configmaps"
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}

    def send(method: str, target_url: str, content_type: str = "application/json") -> int:
        hdrs = {**headers, "Content-Type": content_type}
        req = urllib.request.Request(target_url, json.dumps(body).encode(), hdrs, method=method)
        try:
            with urllib.request.urlopen(req, context=context, timeout=30) as resp:
                return int(resp.status)
        except urllib.error.HTTPError as exc:
            return int(exc.code)
        except (urllib.error.URLError, OSError) as exc:
            raise SinkError(f"Kubernetes API at {base} unreachable: {exc}") from None

    status = send("POST", url)
    if status == 409:  # exists (a re-probe): merge-patch its data and labels
        status = send("PATCH", f"{url}/{name}", "application/merge-patch+json")
    if status not in (200, 201):
        raise SinkError(f"writing ConfigMap {target} failed with HTTP {status}")
