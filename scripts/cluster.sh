#!/usr/bin/env bash
# Start or stop the single-node test Kubernetes (tests/cluster/node_cluster.py, docs/test-node.md)
# by hand. Needs root and `bash scripts/k8s_env.sh` first.
#   scripts/cluster.sh up [DIR]     start it (default DIR /tmp/disaggpool-node); prints KUBECONFIG
#   scripts/cluster.sh down [DIR]   stop everything `up` started in DIR
set -euo pipefail
cd "$(dirname "$0")/.."
PY=python3
[[ -x .venv/bin/python ]] && PY=.venv/bin/python
exec "$PY" tests/cluster/node_cluster.py "$@"
