"""`disaggpool calibrate` error paths that need no pod: bad arguments and unreachable pods."""

from __future__ import annotations

import socket

import pytest

from disaggpool.cli import main


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_missing_endpoint_exits_2(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DISAGGPOOL_ENDPOINT", raising=False)
    assert main(["calibrate", "--out", "-"]) == 2
    assert "endpoint" in capsys.readouterr().err


def test_missing_destination_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["calibrate", "--endpoint", "http://127.0.0.1:1"]) == 2
    assert "--out" in capsys.readouterr().err


def test_the_role_is_required(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A prefill pod probed without `--role` must not get a decode pod's verdict: nothing on a
    vLLM pod says which it is (both run the same NIXL `kv_both` connector), so the caller says."""
    monkeypatch.delenv("DISAGGPOOL_ROLE", raising=False)
    assert main(["calibrate", "--endpoint", "http://127.0.0.1:1", "--out", "-"]) == 2
    assert "--role" in capsys.readouterr().err
    monkeypatch.setenv("DISAGGPOOL_ROLE", "both")
    assert main(["calibrate", "--endpoint", "http://127.0.0.1:1", "--out", "-"]) == 2
    assert "DISAGGPOOL_ROLE" in capsys.readouterr().err


def test_unreachable_pod_exits_4_and_writes_nothing(
    tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "p.yaml"
    pod = f"http://127.0.0.1:{free_port()}"
    code = main(["calibrate", "--endpoint", pod, "--role", "prefill", "--out", str(out)])
    assert code == 4
    assert not out.exists()
    assert "probe failed" in capsys.readouterr().err


def test_non_positive_budget_is_rejected() -> None:
    with pytest.raises(SystemExit) as exc:
        main(["calibrate", "--endpoint", "http://x", "--out", "-", "--budget-seconds", "0"])
    assert exc.value.code == 2


def test_environment_configures_a_job(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DISAGGPOOL_ENDPOINT", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("DISAGGPOOL_OUT", "-")
    monkeypatch.setenv("DISAGGPOOL_ROLE", "decode")
    # parsed from the environment: gets as far as trying the (closed) port
    assert main(["calibrate"]) == 4


def test_a_poor_fit_exits_3_unless_accepted(
    monkeypatch: pytest.MonkeyPatch, tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The profile is written either way; only the exit code (what a Job's retry sees) differs."""
    import dataclasses

    from disaggpool.calibration import probe
    from disaggpool.calibration.common import ProbeResult
    from disaggpool.core.hardware import builtin_profile
    from disaggpool.formats.profiles import load_profile

    poor = dataclasses.replace(
        builtin_profile("a40-qwen2.5-3b"), quality="poor", ttft_mape=0.6, tpot_mape=0.4
    )
    monkeypatch.setattr(
        probe,
        "run_probe",
        lambda cfg, progress=None, started=None: ProbeResult(poor, {"elapsed_s": 1.0}),
    )
    for extra, code in (([], 3), (["--accept-poor"], 0)):
        out = tmp_path / f"p{code}.yaml"
        args = ["calibrate", "--endpoint", "http://127.0.0.1:1", "--out", str(out), *extra]
        assert main([*args, "--role", "decode"]) == code
        assert load_profile(out).quality == "poor"
    monkeypatch.setenv("DISAGGPOOL_ACCEPT_POOR", "1")
    monkeypatch.setenv("DISAGGPOOL_ROLE", "decode")
    assert main(["calibrate", "--endpoint", "http://x:1", "--out", str(tmp_path / "e.yaml")]) == 0
