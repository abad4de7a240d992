"""Two endpoint pickers, active/passive on a Lease in a real kube-apiserver, behind one real Envoy
1.40 that health-checks both, in front of emulated pods; a client sends a request every 0.1 s
through Envoy throughout.

Each picker is a `disaggpool sidecar` process. Only the leader answers SERVING on the ext_proc
service's health, so Envoy opens its streams there. The leader stopped with SIGTERM (a rolling
update) hands over without a failed request. The leader killed (SIGKILL) cannot release: until
the Lease runs out, Envoy finds it refusing connections, leaves it out and tries the stream again
on the standby (both unhealthy: Envoy's panic mode), which answers by its own view of the pool;
only the request in flight on the killed picker may fail. Once the standby leads, every request
succeeds and is routed by it. The handover times are printed (`-s`) and in
docs/high-availability.md.

Skips without the control-plane binaries or Envoy (tests/operator/k8s_cluster.py and
envoy_testkit.py say where they come from).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml
from envoy_testkit import running_envoy
from gateway_testkit import MODEL, Pool, metric

from disaggpool.localpool.processes import child_env, disaggpool_command, free_port, wait_http

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))

from k8s_cluster import Cluster, require_k8s, running_cluster

LEASE_S, RENEW_S, RETRY_S = 3.0, 2.0, 0.25
HEALTH_INTERVAL_S = 0.5
SHUTDOWN_DELAY_S = 3.0  # the operator renders 5 s: serving on, NOT_SERVING, after SIGTERM

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    require_k8s(("etcd", "kube-apiserver", "kube-controller-manager", "kubectl"))
    with running_cluster(tmp_path_factory.mktemp("pickers"), []) as c:
        yield c


class Picker:
    """One `disaggpool sidecar` process in gateway mode, electing on the Lease `pickers`."""

    def __init__(
        self,
        pool: Pool,
        cluster: Cluster,
        tmp: Path,
        identity: str,
        ports: tuple[int, int] = (0, 0),
    ) -> None:
        self.identity = identity
        self.http, self.ext_proc = (port or free_port() for port in ports)
        config = {
            "policy": "calibrated",
            "model": MODEL,
            "listen": {
                "http": f"127.0.0.1:{self.http}",
                "grpc": "127.0.0.1:0",
                "ext_proc": f"127.0.0.1:{self.ext_proc}",
            },
            "slo_classes": [{"name": "chat", "ttft_s": 3.0, "tpot_s": 0.2}],
            "scrape_interval_s": 0.2,
            "shutdown_delay_s": SHUTDOWN_DELAY_S,
            "tokenizer": {"kind": "emulator"},
            "pool": {"static": {"prefill": pool.urls("prefill"), "decode": pool.urls("decode")}},
            "profiles": {"dir": str(pool.profiles_dir)},
            "leader_election": {
                "namespace": "default",
                "name": "pickers",
                "identity": identity,
                "lease_duration_s": LEASE_S,
                "renew_deadline_s": RENEW_S,
                "retry_period_s": RETRY_S,
            },
        }
        path = tmp / f"{identity}.yaml"
        path.write_text(yaml.safe_dump(config))
        self.log = tmp / f"{identity}.log"
        env = child_env(KUBECONFIG=str(cluster.kubeconfig))
        for var in ("KUBERNETES_API", "KUBERNETES_SERVICE_HOST"):
            env.pop(var, None)
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                disaggpool_command("sidecar", "--config", str(path)),
                env=env, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        wait_http(f"{self.url}/readyz?exclude=leader", self.proc)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http}"

    def leading(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/readyz", timeout=2) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def routed(self) -> float:
        """Requests this picker routed (its `disaggpool_epp_decisions_total{code="routed"}`)."""
        return metric(self.url, "disaggpool_epp_decisions_total", code="routed")

    def stop(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Client(threading.Thread):
    """A completion through Envoy every 0.1 s: (sent at, status) of each, until stopped."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.results: list[tuple[float, int]] = []
        self._stop_event = threading.Event()

    def run(self) -> None:
        body = json.dumps({"model": MODEL, "prompt": "hello " * 20, "max_tokens": 2}).encode()
        while not self._stop_event.is_set():
            sent = time.monotonic()
            req = urllib.request.Request(
                f"{self.url}/v1/completions", body, {"Content-Type": "application/json"}
            )
            try:
                with urllib.request.urlopen(req, timeout=30) as resp:
                    resp.read()
                    status = resp.status
            except urllib.error.HTTPError as exc:
                status = exc.code
            except (urllib.error.URLError, OSError):
                status = 0
            self.results.append((sent, status))
            self._stop_event.wait(max(0.0, 0.1 - (time.monotonic() - sent)))

    def stop(self) -> None:
        self._stop_event.set()
        self.join(60)

    def failed(self, since: float = 0.0, until: float = float("inf")) -> list[tuple[float, int]]:
        return [(t, s) for t, s in self.results if since <= t < until and s != 200]

    def sent(self, since: float = 0.0, until: float = float("inf")) -> int:
        return sum(since <= t < until for t, _ in self.results)


def _envoy_health(admin: str) -> dict[int, bool]:
    """Envoy's view of the picker cluster: port -> healthy."""
    with urllib.request.urlopen(f"{admin}/clusters?format=json", timeout=5) as resp:
        doc = json.load(resp)
    (epp,) = [c for c in doc["cluster_statuses"] if c["name"] == "epp"]
    health: dict[int, bool] = {}
    for host in epp["host_statuses"]:
        flags = host["health_status"]
        port = int(host["address"]["socket_address"]["port_value"])
        health[port] = flags.get("eds_health_status") == "HEALTHY" and not any(
            v for k, v in flags.items() if k.startswith("failed") or k == "pending_active_hc"
        )
    return health


def _until(check: Callable[[], bool], what: str, timeout: float) -> float:
    """Seconds until `check()` holds; fails after `timeout`."""
    start = time.monotonic()
    while not check():
        assert time.monotonic() - start < timeout, f"timed out after {timeout} s: {what}"
        time.sleep(0.02)
    return time.monotonic() - start


def test_envoy_follows_the_lease_from_picker_to_picker(
    pool: Pool, cluster: Cluster, tmp_path: Path
) -> None:
    pickers: list[Picker] = []
    client: Client | None = None
    try:
        a = Picker(pool, cluster, tmp_path, "a")
        pickers.append(a)
        _until(a.leading, "a to lead", 20)
        b = Picker(pool, cluster, tmp_path, "b")
        pickers.append(b)
        with running_envoy(
            tmp_path, epp_port=a.ext_proc, more_pickers=[("127.0.0.1", b.ext_proc)],
            health_interval_s=HEALTH_INTERVAL_S,
        ) as envoy:  # fmt: skip
            _until(
                lambda: _envoy_health(envoy.admin) == {a.ext_proc: True, b.ext_proc: False},
                "Envoy to see the leader healthy and the standby not",
                10,
            )
            client = Client(envoy.url)
            client.start()
            _until(lambda: client.sent() >= 20, "20 requests", 30)
            assert client.failed() == []
            assert a.routed() >= 20 and b.routed() == 0  # the standby got no stream

            # A rolling update: SIGTERM, the Lease released, the leader serving on meanwhile.
            stopped = time.monotonic()
            a.stop(signal.SIGTERM)
            took_lease = _until(b.leading, "b to lead", 10)
            envoy_follows = _until(
                lambda: _envoy_health(envoy.admin).get(b.ext_proc, False),
                "Envoy to see b healthy", 10,
            )  # fmt: skip
            assert a.proc.wait(30) == 0
            routed_b = b.routed()
            _until(lambda: b.routed() >= routed_b + 20, "20 more requests routed by b", 30)
            drained = client.failed(since=stopped)
            print(
                f"\nSIGTERM: b held the Lease after {took_lease:.2f} s, Envoy saw it healthy "
                f"{envoy_follows:.2f} s later; {client.sent(since=stopped)} requests since, "
                f"{len(drained)} failed"
            )
            assert drained == []
            assert took_lease < LEASE_S - RETRY_S  # released, not run out

            # a comes back (a new pod at the same address) as the standby; then the leader is
            # killed and cannot release.
            a = Picker(pool, cluster, tmp_path, "a2", ports=(a.http, a.ext_proc))
            pickers.append(a)
            _until(
                lambda: _envoy_health(envoy.admin) == {a.ext_proc: False, b.ext_proc: True},
                "Envoy to see a2 as the standby", 10,
            )  # fmt: skip
            killed = time.monotonic()
            b.stop(signal.SIGKILL)
            took_lease = _until(a.leading, "a2 to lead", LEASE_S + RETRY_S + 5)
            as_standby = a.routed()  # what the standby routed while the Lease ran out
            envoy_follows = _until(
                lambda: _envoy_health(envoy.admin).get(a.ext_proc, False),
                "Envoy to see a2 healthy", 10,
            )  # fmt: skip
            settled = time.monotonic()
            routed_a = a.routed()
            _until(lambda: a.routed() >= routed_a + 20, "20 requests routed by a2", 30)
            window = client.failed(since=killed, until=settled)
            print(
                f"SIGKILL: a2 held the Lease after {took_lease:.2f} s, Envoy saw it healthy "
                f"{envoy_follows:.2f} s later; {client.sent(since=killed, until=settled)} "
                f"requests in that window, {len(window)} failed "
                f"(statuses {sorted({s for _, s in window})}), {as_standby:.0f} routed by a2 "
                "as the standby"
            )
            assert took_lease >= LEASE_S - RETRY_S  # the Lease ran out: nobody released it
            # Only the request in flight on the killed picker may fail: a stream refused by it
            # is tried again on the standby, which answers by its own view until it leads.
            assert len(window) <= 1, window
            assert as_standby > 0
            assert client.failed(since=settled) == []
    finally:
        if client is not None:
            client.stop()
        for p in pickers:
            p.close()
