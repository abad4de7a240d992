"""Peers the tests compare against or check with (aiperf, checkov), each pinned and installed from
PyPI on first use into a virtual environment of its own under ``$DISAGGPOOL_PEER_ROOT`` (default
/var/cache/disaggpool/peers), so that their dependencies never meet ours. Where one cannot be
installed the test skips saying why, unless ``DISAGGPOOL_REQUIRE_PEERS=1`` or ``CI=true``, where
that is a failure.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

PEER_ROOT = Path(os.environ.get("DISAGGPOOL_PEER_ROOT", "/var/cache/disaggpool/peers"))


def required() -> bool:
    """Whether a peer that cannot be installed fails the test rather than skips it."""
    return os.environ.get("DISAGGPOOL_REQUIRE_PEERS") == "1" or os.environ.get("CI") == "true"


def installed(package: str, version: str, command: str = "") -> Path:
    """The path of `command` (default: the package's name) in the peer's own virtual
    environment, installing `package==version` there when it is missing."""
    venv = PEER_ROOT / f"{package}-{version}"
    exe = venv / "bin" / (command or package)
    if not exe.exists():
        try:
            venv.parent.mkdir(parents=True, exist_ok=True)
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
            pip = [str(venv / "bin" / "pip"), "install", "--quiet", f"{package}=={version}"]
            subprocess.run(pip, check=True, capture_output=True, text=True, timeout=900)
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", "") or exc
            message = f"{package} {version} could not be installed in {venv}: {detail}"
            if required():
                pytest.fail(message)
            pytest.skip(message)
    return exe
