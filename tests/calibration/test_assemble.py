"""The probe's pure last step (`calibration.assemble`): synthetic measurements of a known profile,
taken with a known request-path cost, must give back that profile, the discovered pod's
facts, and a report that says what was fitted; too few measurements must be a `ProbeError`."""

from __future__ import annotations

import dataclasses
import math

import pytest

from disaggpool.calibration import assemble, fit
from disaggpool.calibration.common import Measured, Pod, ProbeConfig, ProbeError, RequestPath
from disaggpool.core.hardware import builtin_profile

A40 = builtin_profile("a40-llama3-8b")
PATH = RequestPath("rejected twin requests", base_s=0.002, per_token_s=1e-6, samples=40)
POD = Pod("http://pod:8000", "the-model", 4096, 190_000, 16)
CFG = ProbeConfig(
    endpoint="http://pod:8000",
    name="fitted",
    gpu="a40",
    max_num_seqs=A40.max_num_seqs,
    max_num_batched_tokens=A40.max_num_batched_tokens,
    kv_bytes_per_token=int(A40.kv_transfer.bytes_per_token),
)


def measured(*, transfer: bool = True) -> Measured:
    """Noise-free measurements of A40, every TTFT with the request path's cost added."""
    pre = []
    for n in [16, 64, 256, 1024, 2048, 4096, 8000] * 3:
        engine = A40.prefill.p0 * math.ceil(n / A40.max_num_batched_tokens)
        engine += A40.prefill.p1 * n + A40.prefill.p2 * n * n
        pre.append(fit.PrefillSample(n, engine + PATH.base_s + PATH.per_token_s * n))
    dec = [
        fit.DecodeSample(b, b * ctx, A40.decode.step(b, b * ctx))
        for b in (1, 2, 4, 8, 16, 32, 64)
        for ctx in (44, 1548)
    ]
    xfer = [
        fit.TransferSample(
            n, A40.kv_transfer.time(n) + A40.decode.step(1, n) + PATH.base_s + PATH.per_token_s * n
        )
        for n in [32, 128, 512, 2048, 4096] * 3
    ]
    return Measured(pre, xfer if transfer else [], dec, 3, PATH)


def test_ttfts_are_taken_net_of_the_request_path() -> None:
    raw = measured()
    net = assemble.net_of_request_path(raw)
    assert [s.prompt_tokens for s in net.prefill] == [s.prompt_tokens for s in raw.prefill]
    for before, after in zip(raw.prefill, net.prefill, strict=True):
        n = before.prompt_tokens
        assert after.ttft_s == pytest.approx(before.ttft_s - 0.002 - 1e-6 * n)
    for before_x, after_x in zip(raw.transfer, net.transfer, strict=True):
        assert after_x.ttft_s == pytest.approx(
            before_x.ttft_s - 0.002 - 1e-6 * before_x.prompt_tokens
        )
    assert net.decode == raw.decode  # decode gaps carry no request path
    # Never below a microsecond: a TTFT shorter than the path is noise, not negative work.
    tiny = dataclasses.replace(raw, prefill=[fit.PrefillSample(16, 0.001)])
    assert assemble.net_of_request_path(tiny).prefill[0].ttft_s == 1e-6


def test_the_profile_is_the_true_one_with_the_pods_facts() -> None:
    net = assemble.net_of_request_path(measured())
    fits = assemble.fit_all(net, CFG)
    result = assemble.assemble(
        CFG, POD, net, fits, elapsed_s=12.3456, fitted_at="2026-01-02T03:04:05Z"
    )
    p = result.profile
    assert p.prefill.p1 == pytest.approx(A40.prefill.p1, rel=0.02)
    assert p.decode.d0 == pytest.approx(A40.decode.d0, rel=0.02)
    assert p.decode.d2 == pytest.approx(A40.decode.d2, rel=0.02)
    assert p.kv_transfer.bandwidth_bytes_per_s == pytest.approx(
        A40.kv_transfer.bandwidth_bytes_per_s, rel=0.05
    )
    assert (p.name, p.gpu, p.model, p.source) == ("fitted", "a40", "the-model", "probe")
    assert (p.kv_capacity_tokens, p.block_size, p.max_model_len) == (190_000, 16, 4096)
    assert p.fitted_at == "2026-01-02T03:04:05Z"
    assert p.quality == "good" and p.ttft_mape is not None and p.ttft_mape < 0.01
    assert p.unmeasured == () and p.transfer_measured  # measured with a peer: nothing marked
    report = result.report
    assert report["elapsed_s"] == 12.346
    assert report["http_overhead"] == {
        "from": "rejected twin requests",
        "seconds": 0.002,
        "seconds_per_prompt_token": 1e-6,
        "samples": 40,
    }
    assert report["samples"] == {
        "prefill": 21,
        "decode": 14,
        "decode_timed_by_server": 3,
        "transfer": 15,
        "partial_prefill": 0,
    }
    assert report["partial_prefill_error"] is None  # none measured: nothing to check
    assert report["measurements"]["prefill"][0] == [16, round(net.prefill[0].ttft_s, 6)]
    assert set(report["fits"]) == {"prefill", "decode", "transfer"}
    assert report["quality"] == p.quality and report["reason"] == p.notes
    assert report["unmeasured"] == []


def test_without_a_peer_the_transfer_defaults_are_used_and_said() -> None:
    net = assemble.net_of_request_path(measured(transfer=False))
    fits = assemble.fit_all(net, CFG)
    assert fits.transfer is None and len(fits.all()) == 2
    result = assemble.assemble(CFG, POD, net, fits, elapsed_s=1.0, fitted_at="t")
    kv = result.profile.kv_transfer
    assert (kv.k0, kv.bandwidth_bytes_per_s) == (
        assemble.DEFAULT_K0_S,
        assemble.DEFAULT_KV_BANDWIDTH,
    )
    assert "KV transfer not measured" in result.profile.notes
    assert "transfer" not in result.report["fits"]
    # The defaults are marked as such, and a decode profile carrying them is at most fair (its
    # prefill and decode fits alone are good on these noise-free measurements).
    assert result.profile.unmeasured == ("kv_transfer",)
    assert not result.profile.transfer_measured
    assert result.profile.quality == "fair" and "at most fair" in result.profile.notes
    assert result.report["unmeasured"] == ["kv_transfer"]
    assert result.report["quality"] == "fair"


def test_a_prefill_pods_unmeasured_transfer_is_marked_but_does_not_lower_its_verdict() -> None:
    """Nothing prices a prefill pod's KV transfer (the decode pod pulls the KV, and the cost
    model reads the decode pod's profile), so without a peer it is marked, not held against it."""
    cfg = dataclasses.replace(CFG, role="prefill")
    net = assemble.net_of_request_path(measured(transfer=False))
    result = assemble.assemble(
        cfg, POD, net, assemble.fit_all(net, cfg), elapsed_s=1.0, fitted_at="t"
    )
    assert result.profile.unmeasured == ("kv_transfer",)
    assert result.profile.quality == "good"
    assert "a prefill pod's is not used" in result.profile.notes


def test_too_few_measurements_are_a_probe_error() -> None:
    net = assemble.net_of_request_path(dataclasses.replace(measured(), decode=[]))
    with pytest.raises(ProbeError, match="too few measurements"):
        assemble.fit_all(net, CFG)


def _partial(p1_scale: float) -> list[fit.PrefillSample]:
    """Prompts of n tokens with h cached, as the pod answered them: A40's partial prefill with
    its linear term scaled by `p1_scale` (1: the model holds), request path included."""
    out = []
    for n, h in [(1024, 512), (2048, 1024), (4096, 2048), (8000, 3984)]:
        new = n - h
        engine = A40.prefill.p0 * math.ceil(new / A40.max_num_batched_tokens)
        engine += p1_scale * A40.prefill.p1 * new + A40.prefill.p2 * (n * n - h * h)
        out.append(fit.PrefillSample(n, engine + PATH.base_s + PATH.per_token_s * n, h))
    return out


@pytest.mark.parametrize(("p1_scale", "quality"), [(1.0, "good"), (2.0, "poor")])
def test_partial_prefills_check_the_cache_credit(p1_scale: float, quality: str) -> None:
    """The prefill model fitted on whole prompts predicts partly cached ones exactly when the
    pod computes only the uncached tokens; a pod that does not (twice the linear work here)
    fails the check, judged like a held-out error, and the report says so."""
    raw = dataclasses.replace(measured(), partial_prefill=_partial(p1_scale))
    net = assemble.net_of_request_path(raw)
    assert [s.cached_tokens for s in net.partial_prefill] == [512, 1024, 2048, 3984]
    result = assemble.assemble(
        CFG, POD, net, assemble.fit_all(net, CFG), elapsed_s=1.0, fitted_at="t"
    )
    error = result.report["partial_prefill_error"]
    assert result.report["samples"]["partial_prefill"] == 4
    assert result.profile.quality == quality
    if quality == "good":
        assert error < 0.01
    else:
        assert error > fit.FAIR_MAPE and "partial prefill error" in result.profile.notes


def test_a_fit_outside_the_physical_bounds_is_a_probe_error() -> None:
    """A decode step of a nanosecond is no engine's (`core.profile`'s bounds): the probe says so
    rather than deliver a profile the router and the operator would refuse."""
    raw = measured()
    instant = [dataclasses.replace(s, itl_s=1e-9) for s in raw.decode]
    net = assemble.net_of_request_path(dataclasses.replace(raw, decode=instant))
    fits = assemble.fit_all(net, CFG)
    with pytest.raises(ProbeError, match="not physical: decode"):
        assemble.assemble(CFG, POD, net, fits, elapsed_s=1.0, fitted_at="2026-01-01T00:00:00Z")
