"""The layering contracts cover the whole package, and docs/layout.md names real paths.

`lint-imports` (run by scripts/test.sh) checks only the modules a contract names: a new top-level
module missing from the layers contract would escape every rule. These tests fail when that
happens, and when the layout table names a path that does not exist or misses a module.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import disaggpool

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = Path(disaggpool.__file__).parent


def _layers() -> list[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (layers,) = [c for c in config["contracts"] if c["id"] == "layers"]
    return [m.strip() for layer in layers["layers"] for m in re.split(r"[|:]", layer)]


def test_every_top_level_module_has_a_layer() -> None:
    modules = {
        p.stem if p.is_file() else p.name
        for p in PACKAGE.iterdir()
        if (p.suffix == ".py" and p.stem != "__init__")
        or (p.is_dir() and (p / "__init__.py").exists())
    }
    layered = set(_layers())
    assert modules - layered == set(), "add these modules to the layers contract in pyproject.toml"
    assert layered - modules == set(), "the layers contract names modules that do not exist"


def _layout_rows() -> list[tuple[list[Path], str]]:
    """(paths of the first cell, the job cell) per row of docs/layout.md's table.

    A bare file name after a full path in the same cell is that path's sibling
    (`src/disaggpool/labels.py`, `promtext.py`).
    """
    rows = []
    for line in (ROOT / "docs" / "layout.md").read_text().splitlines():
        if not line.startswith("| `"):
            continue
        _, first, job, _ = line.split("|", 3)
        paths: list[Path] = []
        for name in re.findall(r"`([^`]+)`", first):
            if "/" in name.rstrip("/") or not paths:
                paths.append(ROOT / name)
            else:
                paths.append(paths[-1].parent / name)
        rows.append((paths, job))
    return rows


def test_layout_table_names_existing_paths() -> None:
    rows = _layout_rows()
    assert len(rows) >= 10
    for paths, _ in rows:
        for path in paths:
            assert path.exists(), f"docs/layout.md names {path.relative_to(ROOT)}: missing"


def test_layout_table_finds_every_module() -> None:
    """Every module of the package is named in the layout table: a package's modules in its row,
    a top-level module in a row of its own."""
    rows = _layout_rows()
    named = {path for paths, _ in rows for path in paths}
    for module in sorted(PACKAGE.rglob("*.py")):
        if module.name in ("__init__.py", "__main__.py") or "router" in module.parts:
            continue
        if module.parent == PACKAGE:
            assert module in named, f"docs/layout.md lacks {module.relative_to(ROOT)}"
            continue
        row = [job for paths, job in rows if module.parent in paths]
        assert row, f"docs/layout.md has no row for {module.parent.relative_to(ROOT)}/"
        assert f"`{module.stem}`" in row[0], (
            f"docs/layout.md: the row of {module.parent.relative_to(ROOT)}/ lacks `{module.stem}`"
        )
