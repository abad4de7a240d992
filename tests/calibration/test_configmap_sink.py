"""The probe's ConfigMap sink against kmock, a protocol-faithful Kubernetes API emulator."""

from __future__ import annotations

import asyncio

import pytest
import yaml

from disaggpool.calibration import sinks
from disaggpool.core.hardware import builtin_profile
from disaggpool.core.profile import profile_from_dict


@pytest.mark.asyncio
async def test_probe_writes_then_updates_its_configmap(
    kmock, monkeypatch: pytest.MonkeyPatch
) -> None:
    kmock.resources.load_bundled()
    monkeypatch.setenv("KUBERNETES_API", str(kmock.url))
    monkeypatch.setenv("KUBERNETES_TOKEN", "test-token")
    first = builtin_profile("a40-llama3-8b")
    await asyncio.to_thread(
        sinks.write_configmap, first, "serving/decode-0-profile", {"quality": "good"}
    )
    stored = kmock.objects["v1/configmaps", "serving", "decode-0-profile"]
    assert profile_from_dict(yaml.safe_load(stored["data"][sinks.PROFILE_KEY])) == first

    second = builtin_profile("h100-llama3-8b")  # a re-probe replaces the profile
    await asyncio.to_thread(
        sinks.write_configmap, second, "serving/decode-0-profile", {"quality": "good"}
    )
    stored = kmock.objects["v1/configmaps", "serving", "decode-0-profile"]
    assert profile_from_dict(yaml.safe_load(stored["data"][sinks.PROFILE_KEY])) == second


def test_bad_target_and_missing_cluster_are_clear_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    profile = builtin_profile("a40-llama3-8b")
    with pytest.raises(sinks.SinkError, match="NAMESPACE/NAME"):
        sinks.write_configmap(profile, "just-a-name", {})
    for var in ("KUBERNETES_API", "KUBERNETES_SERVICE_HOST"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(sinks.SinkError, match="not in a cluster"):
        sinks.write_configmap(profile, "ns/name", {})
