"""The committed generated code is what scripts/gen_protos.sh makes from protos/ today."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    subprocess.run(
        ["bash", str(ROOT / "scripts" / "gen_protos.sh"), str(tmp_path)],
        check=True,
        env=env,
        capture_output=True,
    )
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert generated, "the script generated nothing"
    stale = [
        str(rel)
        for rel in generated
        if (ROOT / "src" / rel).read_bytes() != (tmp_path / rel).read_bytes()
    ]
    assert not stale, f"regenerate with: bash scripts/gen_protos.sh ({', '.join(stale)})"
