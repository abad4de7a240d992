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


def test_unreachable_pod_exits_4_and_writes_nothing(
    tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "p.yaml"
    code = main(["calibrate", "--endpoint", f"http://127.0.0.1:{free_port()}", "--out", str(out)])
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
    # parsed from the environment: gets as far as trying the (closed) port
    assert main(["calibrate"]) == 4
