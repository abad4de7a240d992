"""Where a fitted profile goes: a file, stdout, or a ConfigMap through the Kubernetes API.

The probe runs as a Kubernetes Job; the operator and the router read the ConfigMap it writes
(the profile under `labels.PROFILE_KEY`). The write goes through `kubeclient` with the pod's
service-account token: a merge-patch of the ConfigMap the operator created for it (the probe's
Role may patch that one and may not create any), or a create where none exists (a probe run by
hand with broader rights). With `owner` (``--configmap-owner POOL/UID``) the ConfigMap carries an
owner reference to that DisaggPool: the router counts only its own pool's profiles. Outside a
cluster `KUBERNETES_API` and `KUBERNETES_TOKEN`, or a kubeconfig, point it at any API server
(tests use that). Called by
the `disaggpool calibrate` command, which is synchronous: `write_configmap` runs the async client
on its own event loop, so it must not be called from a running loop's thread.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Mapping
from pathlib import Path

import aiohttp

from disaggpool.core.profile import CalibrationProfile
from disaggpool.errors import InputError
from disaggpool.formats.profiles import dump_profile
from disaggpool.kubeclient import ApiError, Kube, KubeUnavailable, load_credentials
from disaggpool.labels import API_VERSION, KIND, PROFILE_KEY, REPORT_KEY

__all__ = ["SinkError", "pool_owner", "write_configmap", "write_profile"]


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


def pool_owner(text: str | None) -> dict[str, object] | None:
    """``POOL/UID`` (the --configmap-owner flag) -> the owner reference to that DisaggPool; the
    same one the operator puts on what it creates (a controller reference), so that a probe's
    write changes nothing the operator set."""
    if not text:
        return None
    name, sep, uid = text.partition("/")
    if not sep or not name or not uid or "/" in uid:
        raise InputError("--configmap-owner", text, "expected POOL/UID")
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": name,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def write_configmap(
    profile: CalibrationProfile,
    target: str,
    report: Mapping[str, object],
    labels: Mapping[str, str] | None = None,
    *,
    owner: Mapping[str, object] | None = None,
) -> None:
    """Write ConfigMap `namespace/name` holding the profile and the fit report (patch, else
    create), owned by `owner` when given (`pool_owner`)."""
    namespace, _, name = target.partition("/")
    if not namespace or not name:
        raise SinkError(f"--configmap: expected NAMESPACE/NAME, got {target!r}")
    try:
        credentials = load_credentials()
    except KubeUnavailable as exc:
        raise SinkError(str(exc)) from None
    data = {PROFILE_KEY: dump_profile(profile), REPORT_KEY: json.dumps(dict(report), indent=1)}

    async def send() -> None:
        kube = Kube(credentials)
        try:
            await kube.create_or_patch_configmap(namespace, name, data, labels, owner=owner)
        finally:
            await kube.close()

    try:
        asyncio.run(send())
    except ApiError as exc:
        raise SinkError(f"writing ConfigMap {target} failed with HTTP {exc.status}") from None
    except (aiohttp.ClientError, OSError) as exc:
        why = str(exc) or type(exc).__name__  # a timeout has no message
        raise SinkError(f"Kubernetes API at {credentials.base} unreachable: {why}") from None
