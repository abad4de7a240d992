"""A real control plane for the e2e tests: etcd 3.4, kube-apiserver and controller-manager 1.20.2.

The binaries come from scripts/k8s_env.sh (built from Debian's source package, cached under
/var/cache/disaggpool/k8s; .ci/run builds them when missing). When they are absent the tests that
need them skip (`require_k8s`), or fail with the reason when ``DISAGGPOOL_REQUIRE_K8S=1`` (what CI
sets, so a broken build cannot turn the e2e layer into silent skips). There is no scheduler and
no kubelet: Deployments get ReplicaSets and Pods (the controller manager), pods stay Pending until
a test plays the kubelet by patching their status. The controller manager also runs the garbage
collector (owner references) and the service-account token controller (the operator and the probe
then run with their own, RBAC-limited tokens).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from operator_testkit import TOKEN, write_kubeconfig

CACHE_BIN = Path(os.environ.get("DISAGGPOOL_K8S_BIN", "/var/cache/disaggpool/k8s/current/bin"))
BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kubectl", "helm")


REQUIRE_ENV = "DISAGGPOOL_REQUIRE_K8S"


def binaries_missing(binaries: Sequence[str] = BINARIES) -> str:
    """Why the e2e layer cannot run here, or "" when it can."""
    missing = [b for b in binaries if not (CACHE_BIN / b).is_file()]
    if missing:
        return f"{', '.join(missing)} not in {CACHE_BIN} (run: bash scripts/k8s_env.sh)"
    return ""


def require_k8s(binaries: Sequence[str] = BINARIES) -> None:
    """Skip the calling test (or fixture) when `binaries` are missing; with
    ``DISAGGPOOL_REQUIRE_K8S=1`` fail it instead, naming what is missing."""
    import pytest  # only the tests need it; bench/operator_reconcile.py imports this module too

    why = binaries_missing(binaries)
    if not why:
        return
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{REQUIRE_ENV}=1 but {why}", pytrace=False)
    pytest.skip(why)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Cluster:
    workdir: Path
    server: str
    kubeconfig: Path
    bin: Path

    def kubectl(self, *args: str, check: bool = True, stdin: str | None = None) -> str:
        return self.run(self.bin / "kubectl", *args, check=check, stdin=stdin)

    def helm(self, *args: str, check: bool = True) -> str:
        return self.run(self.bin / "helm", *args, check=check)

    def run(self, exe: Path, *args: str, check: bool = True, stdin: str | None = None) -> str:
        env = {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "HOME": str(self.workdir),  # helm/kubectl caches stay out of the real home
            "HELM_CACHE_HOME": str(self.workdir / "helm-cache"),
            "HELM_CONFIG_HOME": str(self.workdir / "helm-config"),
            "HELM_DATA_HOME": str(self.workdir / "helm-data"),
        }
        proc = subprocess.run(
            [str(exe), *args],
            env=env,
            input=stdin,
            capture_output=True,
            text=True,
            timeout=300,  # under `kubectl rollout status --timeout=240s` on the test node
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"{exe.name} {' '.join(args)} failed ({proc.returncode}):\n"
                f"{proc.stdout}\n{proc.stderr}"
            )
        return proc.stdout + proc.stderr if not check else proc.stdout

    def sa_token(self, namespace: str, name: str, timeout: float = 60.0) -> str:
        """The token the controller manager minted for a service account (1.20: a Secret)."""
        import base64
        import json

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            doc = json.loads(self.kubectl("get", "secrets", "-n", namespace, "-o", "json"))
            for item in doc["items"]:
                ann = item["metadata"].get("annotations") or {}
                if (
                    item.get("type") == "kubernetes.io/service-account-token"
                    and ann.get("kubernetes.io/service-account.name") == name
                    and (item.get("data") or {}).get("token")
                ):
                    return base64.b64decode(item["data"]["token"]).decode()
            time.sleep(0.5)
        raise AssertionError(f"no token for service account {namespace}/{name}")

    def kubeconfig_for(self, directory: Path, token: str) -> Path:
        directory.mkdir(parents=True, exist_ok=True)
        return write_kubeconfig(directory, self.server, token)


def apiserver_auth_args(d: Path) -> list[str]:
    """kube-apiserver's certificates, token and service-account settings in directory `d`
    (tokens.csv, sa.key, sa.pub; certs/ is generated), shared with the test node."""
    return [
        f"--cert-dir={d / 'certs'}",
        "--insecure-port=0",
        f"--token-auth-file={d / 'tokens.csv'}",
        "--authorization-mode=RBAC",
        "--service-account-issuer=https://kubernetes.default.svc",
        f"--service-account-key-file={d / 'sa.pub'}",
        f"--service-account-signing-key-file={d / 'sa.key'}",
    ]


@contextlib.contextmanager
def running_cluster(workdir: Path, crds: list[Path]) -> Iterator[Cluster]:
    """Start the control plane, apply `crds` before the controller manager starts (its garbage
    collector only sees CRDs that existed at its last discovery), stop everything afterwards."""
    b = CACHE_BIN
    d = workdir / "k8s"
    shutil.rmtree(d, ignore_errors=True)
    (d / "certs").mkdir(parents=True)
    subprocess.run(
        ["openssl", "genrsa", "-out", str(d / "sa.key"), "2048"], check=True, capture_output=True
    )
    subprocess.run(
        ["openssl", "rsa", "-in", str(d / "sa.key"), "-pubout", "-out", str(d / "sa.pub")],
        check=True,
        capture_output=True,
    )
    (d / "tokens.csv").write_text(f"{TOKEN},admin,admin-uid,system:masters\n")
    client, peer, secure = free_port(), free_port(), free_port()
    procs: list[subprocess.Popen[bytes]] = []

    def spawn(name: str, *args: str) -> None:
        log = (d / f"{name}.log").open("wb")
        procs.append(subprocess.Popen([str(b / name), *args], stdout=log, stderr=log))

    try:
        spawn(
            "etcd",
            "--data-dir",
            str(d / "etcd"),
            "--listen-client-urls",
            f"http://127.0.0.1:{client}",
            "--advertise-client-urls",
            f"http://127.0.0.1:{client}",
            "--listen-peer-urls",
            f"http://127.0.0.1:{peer}",
            "--initial-advertise-peer-urls",
            f"http://127.0.0.1:{peer}",
            "--initial-cluster",
            f"default=http://127.0.0.1:{peer}",
            "--log-level",
            "warn",
        )
        spawn(
            "kube-apiserver",
            f"--etcd-servers=http://127.0.0.1:{client}",
            "--bind-address=127.0.0.1",
            f"--secure-port={secure}",
            *apiserver_auth_args(d),
            "--service-cluster-ip-range=198.19.0.0/24",
            "--disable-admission-plugins=ServiceAccount",
        )
        server = f"https://127.0.0.1:{secure}"
        cluster = Cluster(workdir, server, write_kubeconfig(workdir, server), b)
        _wait_ready(server, procs, d)
        for crd in crds:
            cluster.kubectl("apply", "-f", str(crd))
        for crd in crds:
            cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", "-f", str(crd))
        spawn(
            "kube-controller-manager",
            f"--kubeconfig={cluster.kubeconfig}",
            "--leader-elect=false",
            "--port=0",
            "--secure-port=0",
            f"--service-account-private-key-file={d / 'sa.key'}",
            f"--root-ca-file={d / 'certs' / 'apiserver.crt'}",
            "--use-service-account-credentials=false",
            "--controllers=*,tokencleaner",
        )
        yield cluster
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in reversed(procs):
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _wait_ready(server: str, procs: list[subprocess.Popen[bytes]], d: Path) -> None:
    import ssl

    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            logs = "\n".join(f.read_text(errors="replace")[-2000:] for f in d.glob("*.log"))
            raise AssertionError(f"control plane exited early:\n{logs}")
        req = urllib.request.Request(
            f"{server}/readyz", headers={"Authorization": f"Bearer {TOKEN}"}
        )
        with (
            contextlib.suppress(OSError),
            urllib.request.urlopen(req, context=ctx, timeout=2) as resp,
        ):
            if resp.status == 200:
                return
        time.sleep(0.2)
    raise AssertionError("kube-apiserver not ready within 60 s")
