#!/usr/bin/env bash
# Set up a virtual environment in .venv and run every check: lint, format, types, tests.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/pip install --quiet --upgrade pip
.venv/bin/pip install --quiet -e '.[dev]'
.venv/bin/ruff check src tests bench
.venv/bin/ruff format --check src tests bench
.venv/bin/mypy
.venv/bin/lint-imports  # the layering contracts in pyproject.toml (docs/architecture.md)
.venv/bin/pytest -q
