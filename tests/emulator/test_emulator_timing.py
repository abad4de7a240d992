"""Timing: with jitter 0 the emulator's latencies are the engine model's, plus delivery.

Measured at the client over loopback HTTP, so each value carries the HTTP round trip and the
event loop's timer granularity (about 1 ms each), and on a shared machine the odd scheduling
delay. Delivery only ever adds time, so TTFT is judged by the fastest of a few runs, which must
lie within [model - 1 ms, model + 6 ms]; TPOT is a mean over many steps.
"""

from __future__ import annotations

import statistics
import threading
from pathlib import Path
from typing import Any

import pytest
import yaml
from emulator_testkit import Http, Stream, make_profile

from disaggpool.core.profile import CalibrationProfile, profile_to_dict
from disaggpool.formats.profiles import resolve_profile

N = 100  # prompt tokens: BOS and N - 1 words


def prompt(i: int) -> str:
    """The i-th of distinct N-token prompts: the prefill engine caches prefixes, as vLLM's does,
    so a repeated prompt would be served from its cache."""
    return f"w{i} " + "w " * (N - 2)


TOL = 0.006  # seconds
RUNS = 5


def close_to_model(measured: list[float], expected: float) -> bool:
    return expected - 0.001 <= min(measured) <= expected + TOL


@pytest.fixture
def profile(tmp_path: Path) -> CalibrationProfile:
    """A slow profile (20 ms steps) written to a file, loaded as `--profile FILE` would."""
    prof = make_profile(decode={"d0": 0.020, "d1": 0.0, "d2": 1e-6})
    path = tmp_path / "slow.yaml"
    path.write_text(yaml.safe_dump(profile_to_dict(prof)))
    return resolve_profile(str(path))


def ttft(s: Stream, first: int = 0) -> float:
    return s.events[first][0] - s.sent_at


def tpot(s: Stream, first: int = 0) -> float:
    times = [t for t, data in s.events if data != "[DONE]"][first:]
    return (times[-1] - times[0]) / (len(times) - 1)


def test_lone_plain_request_matches_the_model(
    start_emulator: Any, http: Http, profile: CalibrationProfile
) -> None:
    emu = start_emulator(profile)
    http.sse(emu.url + "/v1/completions", {"prompt": "warm up", "max_tokens": 1, "stream": True})
    k = 12
    runs = [
        http.sse(
            emu.url + "/v1/completions", {"prompt": prompt(i), "max_tokens": k, "stream": True}
        )
        for i in range(RUNS)
    ]
    assert all(len(s.events) == k + 1 for s in runs)
    # As in vLLM, the prefill pass samples the first token; each decode step adds one more.
    expected_ttft = profile.prefill.prompt_time(N)
    expected_tpot = statistics.mean(profile.decode.step(1, N + i) for i in range(k - 1))
    measured = [ttft(s) for s in runs]
    assert close_to_model(measured, expected_ttft), (measured, expected_ttft)
    assert statistics.median(tpot(s) for s in runs) == pytest.approx(expected_tpot, abs=0.002)
    # One token only: a pure prefill, answered when the prefill iteration ends.
    body = {"max_tokens": 1, "stream": True}
    singles = [
        ttft(http.sse(emu.url + "/v1/completions", {**body, "prompt": prompt(RUNS + i)}))
        for i in range(RUNS)
    ]
    assert close_to_model(singles, profile.prefill.prompt_time(N)), singles


def test_prefill_and_decode_legs_match_the_model(
    start_emulator: Any, http: Http, profile: CalibrationProfile
) -> None:
    p, d = start_emulator(profile), start_emulator(profile)
    leg = {
        "max_tokens": 1,
        "stream": True,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    http.sse(p.url + "/v1/completions", {**leg, "prompt": "warm up"})
    prefills = [
        http.sse(p.url + "/v1/completions", {**leg, "prompt": prompt(i)}) for i in range(RUNS)
    ]
    measured = [ttft(s) for s in prefills]
    assert close_to_model(measured, profile.prefill.prompt_time(N)), measured
    k = 8
    decodes = []
    for i, s in enumerate(prefills):
        kv = s.chunks()[-1]["kv_transfer_params"]  # streaming P puts it on the finishing chunk
        assert kv["remote_num_tokens"] == N
        decodes.append(
            http.sse(
                d.url + "/v1/completions",
                {"prompt": prompt(i), "max_tokens": k, "stream": True, "kv_transfer_params": kv},
            )
        )
    assert all(len(s.events) == k + 1 for s in decodes)
    expected = profile.kv_transfer.time(N) + profile.decode.step(1, N)
    measured = [ttft(s) for s in decodes]
    assert close_to_model(measured, expected), (measured, expected)
    expected_tpot = profile.decode.step(1, N + k // 2)
    assert statistics.median(tpot(s) for s in decodes) == pytest.approx(expected_tpot, abs=0.002)


def test_concurrency_raises_tpot_as_the_profile_says(start_emulator: Any, http: Http) -> None:
    profile = make_profile(decode={"d0": 0.010, "d1": 0.005, "d2": 0.0})
    emu = start_emulator(profile)
    body = {"prompt": "short prompt", "max_tokens": 30, "stream": True}
    alone = http.sse(emu.url + "/v1/completions", body)
    assert tpot(alone) == pytest.approx(profile.decode.step(1, 0), abs=0.002)
    batch = 6
    streams: list[Stream] = []
    barrier = threading.Barrier(batch)

    def run() -> None:
        barrier.wait()
        streams.append(http.sse(emu.url + "/v1/completions", body))

    threads = [threading.Thread(target=run) for _ in range(batch)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    expected = profile.decode.step(batch, 0)  # 40 ms against 15 ms alone
    for s in streams:
        # After the first few steps every request has joined: the batch is `batch` wide.
        assert tpot(s, first=10) == pytest.approx(expected, abs=0.003)
