"""The probe's ConfigMap sink against kmock, a protocol-faithful Kubernetes API emulator, and
the `--configmap-owner` value it sets as the owner."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import yaml

from disaggpool.calibration import sinks
from disaggpool.core.hardware import builtin_profile
from disaggpool.core.profile import profile_from_dict
from disaggpool.errors import InputError
from disaggpool.labels import PROFILE_KEY, REPORT_KEY
from disaggpool.operator.names import PoolRef, owner_reference


@pytest.mark.asyncio
async def test_probe_writes_then_updates_its_configmap(
    kmock, monkeypatch: pytest.MonkeyPatch
) -> None:
    kmock.resources.load_bundled()
    monkeypatch.setenv("KUBERNETES_API", str(kmock.url))
    monkeypatch.setenv("KUBERNETES_TOKEN", "test-token")
    first = builtin_profile("a40-llama3-8b")
    labels = {"disaggpool.io/pod": "decode-0", "disaggpool.io/profile": "true"}
    await asyncio.to_thread(
        sinks.write_configmap, first, "serving/decode-0-profile", {"quality": "good"}, labels
    )
    stored = kmock.objects["v1/configmaps", "serving", "decode-0-profile"]
    assert profile_from_dict(yaml.safe_load(stored["data"][PROFILE_KEY])) == first
    assert json.loads(stored["data"][REPORT_KEY]) == {"quality": "good"}
    assert stored["metadata"]["labels"] == labels

    second = builtin_profile("h100-llama3-8b")  # a re-probe replaces the profile
    await asyncio.to_thread(
        sinks.write_configmap, second, "serving/decode-0-profile", {"quality": "poor"}, labels
    )
    stored = kmock.objects["v1/configmaps", "serving", "decode-0-profile"]
    assert profile_from_dict(yaml.safe_load(stored["data"][PROFILE_KEY])) == second
    assert json.loads(stored["data"][REPORT_KEY]) == {"quality": "poor"}


def test_bad_target_and_missing_cluster_are_clear_errors(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    profile = builtin_profile("a40-llama3-8b")
    with pytest.raises(sinks.SinkError, match="NAMESPACE/NAME"):
        sinks.write_configmap(profile, "just-a-name", {})
    for var in ("KUBERNETES_API", "KUBERNETES_SERVICE_HOST"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-kubeconfig"))  # the last source, absent
    with pytest.raises(sinks.SinkError, match="not in a cluster"):
        sinks.write_configmap(profile, "ns/name", {})


@pytest.mark.asyncio
async def test_an_unreachable_or_refusing_api_server_names_the_target(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The probe CLI prints these and exits 4; each names what could not be written where."""
    import socket

    from aiohttp import web

    profile = builtin_profile("a40-llama3-8b")
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    monkeypatch.setenv("KUBERNETES_API", f"http://127.0.0.1:{dead}")
    monkeypatch.setenv("KUBERNETES_TOKEN", "t")
    with pytest.raises(sinks.SinkError, match=f"Kubernetes API at http://127.0.0.1:{dead} unr"):
        await asyncio.to_thread(sinks.write_configmap, profile, "ns/name", {})

    async def forbidden(request: web.Request) -> web.Response:
        return web.json_response({"kind": "Status", "code": 403}, status=403)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", forbidden)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = runner.addresses[0][1]
        monkeypatch.setenv("KUBERNETES_API", f"http://127.0.0.1:{port}")
        with pytest.raises(sinks.SinkError, match="writing ConfigMap ns/name failed with HTTP 403"):
            await asyncio.to_thread(sinks.write_configmap, profile, "ns/name", {})
    finally:
        await runner.cleanup()


def test_configmap_owner_flag_parses_and_names_bad_values() -> None:
    owner = sinks.pool_owner("small/1234-abcd")
    # The same reference the operator sets (`names.owner_reference`): the probe's write changes
    # nothing the operator created, and needs no right to set blockOwnerDeletion anew.
    assert owner == owner_reference(PoolRef("small", "serving", "1234-abcd"))
    assert sinks.pool_owner(None) is None and sinks.pool_owner("") is None
    for bad in ("small", "small/", "/uid", "a/b/c"):
        with pytest.raises(InputError, match="POOL/UID"):
            sinks.pool_owner(bad)
