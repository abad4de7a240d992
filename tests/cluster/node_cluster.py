"""A real single-node Kubernetes on this machine: what tests/cluster runs the product on.

etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kube-proxy and a kubelet (all
1.20.2, from scripts/k8s_env.sh's cache) with containerd 1.6 and runc 1.1 running the pods, on a
bridge CNI network. docs/test-node.md says what this node is and is not.

Network safety: every address the cluster hands out is in 198.18.0.0/15, the benchmarking range
(pods 198.18.0.0/24 on the bridge `dpool0`, whose own address 198.18.0.1 is the node's, the API
server's and the kubelet's; Services 198.19.0.0/24). The host routes all of 198.18.0.0/15 to the
bridge, pods get a route for that range only (no default route), nothing is masqueraded and
forwarding stays as it was (off on these machines: pod to Service to pod is the one path that
would need it, and nothing here takes it). `up` checks the routes before the first request and
refuses to start otherwise.

Everything `up` starts, `down` stops: processes by the PIDs recorded in the work directory, the
pods' containers (through the API, then containerd), their network namespaces, mounts, the
kubelet's and kube-proxy's iptables chains, the bridge and its route. One node at a time (the
bridge name is fixed). Run by hand: `scripts/cluster.sh up|down [DIR]`.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))

# The control plane as tests/operator runs it: kubectl and helm, the API server's auth settings.
from k8s_cluster import Cluster, apiserver_auth_args, free_port
from operator_testkit import TOKEN, write_kubeconfig

from disaggpool.kubeclient.paths import pod_ready

BIN = Path(os.environ.get("DISAGGPOOL_K8S_BIN", "/var/cache/disaggpool/k8s/current/bin"))
BRIDGE = "dpool0"
NODE_IP = "198.18.0.1"
POD_SUBNET = "198.18.0.0/24"
SERVICE_SUBNET = "198.19.0.0/24"
CONFINED = "198.18.0.0/15"  # all the cluster may reach besides loopback
NODE_NAME = "dpool-node"
API_PORT = 6443
SERVER = f"https://{NODE_IP}:{API_PORT}"
SANDBOX_IMAGE = "disaggpool.local/pause:3.4"
#: Where the tests install the operator (`helm install --namespace`).
OPERATOR_NAMESPACE = "disaggpool-system"
NEEDED = [
    *("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet"),
    *("kube-proxy", "kubectl", "helm", "containerd", "containerd-shim-runc-v2", "ctr", "runc"),
    *("umoci", "pause", "cni/bridge", "cni/host-local", "cni/loopback"),
]
REQUIRE_ENV = "DISAGGPOOL_REQUIRE_CLUSTER"


def unavailable() -> str:
    """Why a node cannot run here, or "" when it can."""
    if os.geteuid() != 0:
        return "the test node needs root (network namespaces, mounts, containerd)"
    missing = [b for b in NEEDED if not (BIN / b).is_file()]
    if missing:
        return f"{', '.join(missing)} not in {BIN} (run: bash scripts/k8s_env.sh)"
    if not (BIN.parent / "images" / "base-rootfs.tar").is_file():
        return f"no images/base-rootfs.tar beside {BIN} (run: bash scripts/k8s_env.sh)"
    if shutil.which("buildah") is None:
        return "no buildah to build the images with (run: bash scripts/k8s_env.sh)"
    return ""


# ------------------------------------------------------------------ network checks (pure)


def route_problems(routes: list[dict[str, str]], *, pod: bool) -> list[str]:
    """What is wrong with a routing table (`ip -j route` entries) for this node's rules.

    The host needs 198.18.0.0/15 on the bridge, so a packet to any address of the range
    stays on this machine. A pod needs exactly its subnet and 198.18.0.0/15, and no default route.
    """
    confined = ipaddress.ip_network(CONFINED)
    problems = []
    nets = {r["dst"]: r for r in routes}
    if pod:
        for r in routes:
            dst = r["dst"]
            if dst == "default" or not ipaddress.ip_network(dst).subnet_of(confined):
                problems.append(f"pod route to {dst} leaves {CONFINED}")
        if CONFINED not in nets:
            problems.append(f"pod has no route for {CONFINED}")
    else:
        r = nets.get(CONFINED)
        if r is None or r.get("dev") != BRIDGE:
            problems.append(f"host does not route {CONFINED} to {BRIDGE}")
        for r in routes:
            dst = r["dst"]
            if dst == "default" or r.get("dev") == BRIDGE:
                continue
            if ipaddress.ip_network(dst).overlaps(confined):
                problems.append(f"host route {dst} via {r.get('dev')} overlaps {CONFINED}")
    return problems


def ip_routes(netns_pid: int | None = None) -> list[dict[str, str]]:
    """The IPv4 routing table, of this host or of the network namespace of process `netns_pid`
    (read with `ip`, nothing sent)."""
    cmd = ["ip", "-4", "-j", "route", "show", "table", "main"]
    if netns_pid is not None:
        cmd = ["nsenter", "-t", str(netns_pid), "-n", *cmd]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return list(json.loads(out or "[]"))


# ------------------------------------------------------------------ the node


class NodeCluster(Cluster):
    """The running node: kubectl and helm as in tests/operator (`Cluster`), plus containerd's
    `ctr` and the polling the node's tests need."""

    @classmethod
    def at(cls, workdir: Path) -> NodeCluster:
        return cls(workdir, SERVER, workdir / "kubeconfig", BIN)

    @property
    def containerd_socket(self) -> Path:
        return self.workdir / "containerd" / "containerd.sock"

    def ctr(self, *args: str, check: bool = True) -> str:
        sock = str(self.containerd_socket)
        return self.run(BIN / "ctr", "-a", sock, "-n", "k8s.io", *args, check=check)

    def get(self, *args: str) -> dict:
        return dict(json.loads(self.kubectl("get", *args, "-o", "json")))

    def wait_for(self, what: str, check, timeout: float = 180.0, every: float = 1.0):
        """Poll `check()` until it returns something truthy; fail naming `what`, with the
        kubelet's last lines."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = check()
            if got:
                return got
            time.sleep(every)
        log = self.workdir / "logs" / "kubelet.log"
        tail = log.read_text(errors="replace")[-3000:] if log.exists() else "(no kubelet yet)"
        raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n{tail}")

    def container_pid(self, namespace: str, pod: str, container: str) -> int:
        """The host PID of a running container's first process (for nsenter and /proc)."""
        doc = self.get("pod", "-n", namespace, pod)
        for status in doc["status"].get("containerStatuses", []):
            if status["name"] == container and status.get("containerID"):
                cid = status["containerID"].split("://", 1)[1]
                for line in self.ctr("task", "ls").splitlines()[1:]:
                    parts = line.split()
                    if parts and parts[0] == cid:
                        return int(parts[1])
        raise AssertionError(f"no running container {container} in {namespace}/{pod}")


def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), check=check, capture_output=True, text=True)


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _bridge_up(d: Path) -> None:
    _clear_a_dead_node()
    _sh("ip", "link", "add", BRIDGE, "type", "bridge")
    # The bridge names its owner (the process starting the node, and the workdir), so a later
    # run can tell a node that is up from one a killed run left behind.
    _sh("ip", "link", "set", BRIDGE, "alias", f"{os.getpid()} {d}")
    _sh("ip", "addr", "add", f"{NODE_IP}/24", "dev", BRIDGE)
    _sh("ip", "link", "set", BRIDGE, "up")
    _sh("ip", "route", "add", CONFINED, "dev", BRIDGE)
    problems = route_problems(ip_routes(), pod=False)
    if problems:
        raise RuntimeError("refusing to start the node: " + "; ".join(problems))


def _clear_a_dead_node() -> None:
    """Stop what a killed run left behind (its bridge, routes, mounts, iptables chains), or
    refuse to start beside a node that is still up."""
    shown = _sh("ip", "-j", "link", "show", BRIDGE, check=False)
    if shown.returncode != 0:
        return
    workdir = left_by_a_killed_run(json.loads(shown.stdout)[0].get("ifalias", ""))
    print(f"stopping the test node a killed run left in {workdir}", file=sys.stderr)
    down(workdir)


def left_by_a_killed_run(owner: str) -> Path:
    """The workdir of the node whose bridge names `owner` ("PID WORKDIR"), when neither the
    process that started it nor any it spawned is alive; otherwise the node may be up: refuse."""
    owner_pid, _, workdir = owner.partition(" ")
    if not owner_pid.isdigit() or not workdir:
        raise RuntimeError(f"{BRIDGE} exists: another test node is up (scripts/cluster.sh down)")
    pids = [int(owner_pid), *(pid for pid, _ in _recorded(Path(workdir)))]
    if any(_alive(pid) for pid in pids):
        raise RuntimeError(
            f"{BRIDGE} exists: the test node in {workdir} is up (scripts/cluster.sh down {workdir})"
        )
    return Path(workdir)


def _configs(d: Path, ports: dict[str, int]) -> None:
    """containerd, CNI and kubelet configuration, every address set explicitly."""
    _write(d / "tokens.csv", f"{TOKEN},admin,admin-uid,system:masters\n")
    write_kubeconfig(d, SERVER, TOKEN)
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    _write(
        d / "containerd" / "config.toml",
        f"""version = 2
root = "{d / "containerd" / "root"}"
state = "{d / "containerd" / "state"}"
[grpc]
  address = "{d / "containerd" / "containerd.sock"}"
[ttrpc]
  address = "{d / "containerd" / "containerd.sock.ttrpc"}"
[{cri}]
  sandbox_image = "{SANDBOX_IMAGE}"
  # This machine does not let a process lower its OOM score below its parent's (-998 for the
  # sandbox): keep containerd's own as the floor.
  restrict_oom_score_adj = true
  [{cri}.cni]
    bin_dir = "{BIN / "cni"}"
    conf_dir = "{d / "cni"}"
  [{cri}.containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [{cri}.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [{cri}.containerd.runtimes.runc.options]
        BinaryName = "{BIN / "runc"}"
        Root = "{d / "containerd" / "runc"}"
""",
    )
    _write(
        d / "cni" / "10-disaggpool.conflist",
        json.dumps(
            {
                "cniVersion": "0.4.0",
                "name": "disaggpool",
                "plugins": [
                    {
                        "type": "bridge",
                        "bridge": BRIDGE,
                        # The bridge's address is set by the harness; the plugin must neither
                        # make pods route everything through it nor masquerade their traffic.
                        "isGateway": False,
                        "isDefaultGateway": False,
                        "ipMasq": False,
                        "hairpinMode": True,
                        "ipam": {
                            "type": "host-local",
                            "dataDir": str(d / "cni-ipam"),
                            "ranges": [[{"subnet": POD_SUBNET, "gateway": NODE_IP}]],
                            "routes": [{"dst": CONFINED, "gw": NODE_IP}],
                        },
                    }
                ],
            }
        ),
    )
    _write(d / "resolv.conf", "")  # no DNS on this node; pods get no nameserver
    _write(
        d / "kubelet.yaml",
        f"""apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: {NODE_IP}
port: {ports["kubelet"]}
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: {ports["kubelet_healthz"]}
authentication: {{anonymous: {{enabled: false}}, webhook: {{enabled: true}}}}
authorization: {{mode: AlwaysAllow}}
cgroupDriver: cgroupfs
cgroupsPerQOS: false
enforceNodeAllocatable: []
failSwapOn: false
resolvConf: {d / "resolv.conf"}
# Locally imported images only: never garbage-collect them, never evict for disk.
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {{"memory.available": "0%", "nodefs.available": "0%", "imagefs.available": "0%"}}
""",
    )


class _Procs:
    """Processes started by `up`, their PIDs in `pids` (one per line) so `down` finds them from
    another process too."""

    def __init__(self, d: Path) -> None:
        self.d = d
        (d / "logs").mkdir(parents=True, exist_ok=True)

    def spawn(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        log = (self.d / "logs" / f"{name}.log").open("wb")
        proc = subprocess.Popen(
            [str(BIN / name), *args], stdout=log, stderr=log, start_new_session=True
        )
        with (self.d / "pids").open("a") as f:
            f.write(f"{proc.pid} {name}\n")
        return proc


def up(workdir: Path) -> NodeCluster:
    """Start the node in `workdir` and return once it is Ready with the images imported."""
    why = unavailable()
    if why:
        raise RuntimeError(why)
    d = workdir.resolve()
    d.mkdir(parents=True, exist_ok=True)
    (d / "netns-before").write_text("\n".join(sorted(_netns())))
    _bridge_up(d)
    node = NodeCluster.at(d)
    try:
        ports = {k: free_port() for k in ("etcd", "peer", "kubelet", "kubelet_healthz")}
        ports |= {k: free_port() for k in ("proxy_healthz", "proxy_metrics")}
        _configs(d, ports)
        _sh("openssl", "genrsa", "-out", str(d / "sa.key"), "2048")
        _sh("openssl", "rsa", "-in", str(d / "sa.key"), "-pubout", "-out", str(d / "sa.pub"))
        procs = _Procs(d)
        etcd = f"http://127.0.0.1:{ports['etcd']}"
        peer = f"http://127.0.0.1:{ports['peer']}"
        procs.spawn(
            "etcd",
            f"--data-dir={d / 'etcd'}",
            f"--listen-client-urls={etcd}",
            f"--advertise-client-urls={etcd}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=default={peer}",
            "--log-level=warn",
        )
        procs.spawn(
            "kube-apiserver",
            f"--etcd-servers={etcd}",
            f"--bind-address={NODE_IP}",
            f"--advertise-address={NODE_IP}",
            f"--secure-port={API_PORT}",
            *apiserver_auth_args(d),
            f"--service-cluster-ip-range={SERVICE_SUBNET}",
        )
        node.wait_for(
            "the API server", lambda: node.kubectl("get", "--raw", "/readyz", check=False) == "ok"
        )
        kc = f"--kubeconfig={node.kubeconfig}"
        procs.spawn(
            "kube-controller-manager",
            kc,
            "--leader-elect=false",
            "--port=0",
            "--secure-port=0",
            f"--service-account-private-key-file={d / 'sa.key'}",
            f"--root-ca-file={d / 'certs' / 'apiserver.crt'}",
            "--controllers=*,tokencleaner",
        )
        procs.spawn("kube-scheduler", kc, "--leader-elect=false", "--port=0", "--secure-port=0")
        procs.spawn("containerd", f"--config={d / 'containerd' / 'config.toml'}")
        node.wait_for("containerd", lambda: node.containerd_socket.exists())
        import_images(node)
        procs.spawn(
            "kubelet",
            kc,
            f"--config={d / 'kubelet.yaml'}",
            "--container-runtime=remote",
            f"--container-runtime-endpoint=unix://{node.containerd_socket}",
            f"--root-dir={d / 'kubelet'}",
            f"--cert-dir={d / 'kubelet-pki'}",
            f"--node-ip={NODE_IP}",
            f"--hostname-override={NODE_NAME}",
        )
        procs.spawn(
            "kube-proxy",
            kc,
            f"--hostname-override={NODE_NAME}",
            f"--bind-address={NODE_IP}",
            f"--healthz-bind-address=127.0.0.1:{ports['proxy_healthz']}",
            f"--metrics-bind-address=127.0.0.1:{ports['proxy_metrics']}",
            f"--cluster-cidr={POD_SUBNET}",
            "--proxy-mode=iptables",
            # Leave the machine's conntrack settings alone.
            "--conntrack-max-per-core=0",
            "--conntrack-tcp-timeout-established=0",
            "--conntrack-tcp-timeout-close-wait=0",
        )
        node.wait_for("the node to be Ready", lambda: _node_ready(node))
        node.wait_for(
            "the default service account",
            lambda: "default" in node.kubectl("get", "sa", "-o", "name", check=False),
        )
    except BaseException:
        down(d)
        raise
    return node


def _node_ready(node: NodeCluster) -> bool:
    out = node.kubectl("get", "node", NODE_NAME, "-o", "json", check=False)
    with contextlib.suppress(ValueError):
        return pod_ready(json.loads(out))  # a Node's Ready condition reads the same way
    return False


def _netns() -> set[str]:
    netns = Path("/var/run/netns")
    return {p.name for p in netns.glob("*")} if netns.is_dir() else set()


def import_images(node: NodeCluster) -> None:
    """Build the local images (tests/cluster/images.py) and import them into containerd."""
    from images import build_images

    for archive, name in build_images(node.workdir / "images", BIN):
        node.ctr("images", "import", "--base-name", name, str(archive))


def down(workdir: Path) -> None:
    """Stop everything `up` started in `workdir` (idempotent; also after a failed `up`)."""
    d = workdir.resolve()
    node = NodeCluster.at(d)
    pids = _recorded(d)
    if any(name == "kubelet" for _, name in pids) and node.kubeconfig.exists():
        # Nothing may recreate the pods (Deployments, Jobs, the operator) while the kubelet
        # tears them down through the runtime (netns, veths, mounts).
        for pid, name in pids:
            if name == "kube-controller-manager":
                _stop(pid)
        node.kubectl(
            "delete",
            "pods",
            "--all",
            "-A",
            "--grace-period=0",
            "--force",
            "--wait=false",
            check=False,
        )
        with contextlib.suppress(AssertionError):
            node.wait_for("pods to be gone", lambda: not _tasks(node), timeout=60, every=1)
    for pid, _name in reversed(pids):
        _stop(pid)
    # What outlives them: containerd's shims (and their containers), mounts, network namespaces.
    sock = str(d / "containerd" / "containerd.sock")
    _sh("pkill", "-KILL", "-f", f"containerd-shim-runc-v2 .*-address {sock}", check=False)
    for mount in reversed(_mounts_under(d)):
        _sh("umount", "-l", mount, check=False)
    before_file = d / "netns-before"
    before = set(before_file.read_text().split()) if before_file.exists() else _netns()
    for ns in _netns() - before:
        if ns.startswith("cni-"):
            _sh("ip", "netns", "delete", ns, check=False)
    _iptables_cleanup()
    _sh("ip", "link", "delete", BRIDGE, check=False)  # its routes go with it
    (d / "pids").unlink(missing_ok=True)


def _iptables_cleanup() -> None:
    """Remove the KUBE-* chains the kubelet and kube-proxy made, and the jumps to them."""
    for table in ("filter", "nat", "mangle"):
        rules = _sh("iptables", "-w", "-t", table, "-S", check=False).stdout.splitlines()
        for rule in rules:
            parts = shlex.split(rule)
            if parts[:1] == ["-A"] and not parts[1].startswith("KUBE-") and "KUBE-" in rule:
                _sh("iptables", "-w", "-t", table, "-D", *parts[1:], check=False)
        chains = [r.split()[1] for r in rules if r.startswith("-N KUBE-")]
        for chain in chains:
            _sh("iptables", "-w", "-t", table, "-F", chain, check=False)
        for chain in chains:
            _sh("iptables", "-w", "-t", table, "-X", chain, check=False)


def _stop(pid: int, grace_s: float = 10.0) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _tasks(node: NodeCluster) -> list[str]:
    out = node.ctr("task", "ls", check=False)
    return [line for line in out.splitlines()[1:] if line.strip()]


def _recorded(d: Path) -> list[tuple[int, str]]:
    path = d / "pids"
    if not path.exists():
        return []
    return [(int(p), n) for p, n in (line.split() for line in path.read_text().splitlines())]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
        return state != "Z"
    return False


def _mounts_under(d: Path) -> list[str]:
    mounts = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        target = line.split()[4]
        if target == str(d) or target.startswith(f"{d}/"):
            mounts.append(target)
    return mounts


@contextlib.contextmanager
def running_node(workdir: Path) -> Iterator[NodeCluster]:
    node = up(workdir)
    try:
        yield node
    finally:
        down(workdir)


def main(argv: list[str]) -> int:
    if len(argv) < 1 or argv[0] not in ("up", "down"):
        print("usage: node_cluster.py up|down [DIR]", file=sys.stderr)
        return 2
    workdir = Path(argv[1] if len(argv) > 1 else "/tmp/disaggpool-node")
    if argv[0] == "up":
        node = up(workdir)
        print(f"node {NODE_NAME} Ready; KUBECONFIG={node.kubeconfig}")
        print(f"stop it with: scripts/cluster.sh down {workdir}")
    else:
        down(workdir)
        print(f"stopped everything started in {workdir}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    raise SystemExit(main(sys.argv[1:]))
