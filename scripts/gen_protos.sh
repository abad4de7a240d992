#!/usr/bin/env bash
# Regenerate the Python code of protos/ into src/ (committed; tests fail when it is stale).
# Usage: bash scripts/gen_protos.sh [OUT_DIR]   (default: src)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-src}
py=${PYTHON:-.venv/bin/python}
mapfile -t protos < <(cd protos && find . -name '*.proto' | sed 's|^\./||' | sort)
"$py" -m grpc_tools.protoc -Iprotos --python_out="$out" --pyi_out="$out" \
  --grpc_python_out="$out" "${protos[@]}"
# Packages for the generated modules (protoc writes none), each with a docstring saying so.
for p in "${protos[@]}"; do
  d=$(dirname "$p")
  while [ "$d" != "." ] && [ "$d" != "disaggpool" ]; do
    printf '"""Generated from protos/%s by scripts/gen_protos.sh: do not edit."""\n' "$d" \
      > "$out/$d/__init__.py"
    d=$(dirname "$d")
  done
done
