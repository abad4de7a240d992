"""Active/passive router replicas (`sidecar.leader`) against a real kube-apiserver 1.20.2: one
replica leads, the other stands by; a leader that stops renewing loses the Lease once it runs
out; a released Lease is taken at the standby's next try; two replicas writing at the same
resourceVersion get one winner; and each failure the elector handles (API server unreachable,
hanging, refusing, the Lease taken from under a leader) does what `sidecar/leader.py` says.

Skips without the control-plane binaries (tests/operator/k8s_cluster.py says where they come
from); fails instead with ``DISAGGPOOL_REQUIRE_K8S=1``.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))

from k8s_cluster import Cluster, require_k8s, running_cluster

from disaggpool.core.lease import LeaseTimings, micro_time
from disaggpool.errors import InputError
from disaggpool.kubeclient import ApiError, Kube, load_credentials, path_for
from disaggpool.sidecar.app import start_sidecar
from disaggpool.sidecar.config import LeaderElectionConfig, LeaderEndpoints, parse_config
from disaggpool.sidecar.leader import LeaderElector

NS = "default"
API = "coordination.k8s.io/v1"
#: Short timings, so that an expiry takes seconds: lease 3 s, renew deadline 2 s, retry 0.25 s.
FAST = LeaseTimings(lease_duration_s=3.0, renew_deadline_s=2.0, retry_period_s=0.25)

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    require_k8s(("etcd", "kube-apiserver", "kube-controller-manager", "kubectl"))
    with running_cluster(tmp_path_factory.mktemp("lease"), []) as c:
        yield c


class _Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()


class FakeService:
    """What the elector touches of a `RoutingService`: its registry and `standby`."""

    def __init__(self) -> None:
        self.metrics = _Metrics()
        self.standby = ""


class FaultyKube(Kube):
    """A real client whose calls can be made to fail, hang, or wait for each other."""

    def __init__(self, cluster: Cluster) -> None:
        super().__init__(load_credentials(str(cluster.kubeconfig)))
        self.fault: str = ""  # "", "down" (connection refused), "hang", "forbidden", "bug"
        self.barrier: asyncio.Barrier | None = None  # writes wait for each other

    async def _gate(self, method: str, path: str) -> None:
        if self.fault == "down":
            raise aiohttp.ClientConnectionError("connection refused (injected)")
        if self.fault == "hang":
            await asyncio.sleep(3600)
        if self.fault == "forbidden":
            raise ApiError(method, path, 403, "leases is forbidden (injected)")
        if self.fault == "bug":
            raise ValueError("an error the elector does not expect (injected)")

    async def get(self, path: str) -> dict[str, Any] | None:
        await self._gate("GET", path)
        return await super().get(path)

    async def create(self, path: str, body: Any) -> dict[str, Any]:
        await self._gate("POST", path)
        if self.barrier is not None:
            await self.barrier.wait()
        return await super().create(path, body)

    async def replace(self, path: str, body: Any) -> dict[str, Any]:
        await self._gate("PUT", path)
        if self.barrier is not None:
            await self.barrier.wait()
        return await super().replace(path, body)


class Replica:
    """One elector and its loop (what the sidecar's supervisor runs), stoppable as a kill."""

    def __init__(
        self, cluster: Cluster, lease: str, identity: str, endpoints: LeaderEndpoints | None = None
    ) -> None:
        self.kube = FaultyKube(cluster)
        self.service = FakeService()
        config = LeaderElectionConfig(NS, lease, identity, FAST, endpoints)
        self.elector = LeaderElector(config, self.service, kube=lambda: self.kube)  # type: ignore[arg-type]
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        async def loop() -> None:
            while True:
                await self.elector.step()
                await asyncio.sleep(FAST.retry_period_s)

        self._task = asyncio.get_running_loop().create_task(loop())

    async def kill(self) -> None:
        """Stop trying without releasing: what a killed pod leaves behind."""
        task, self._task = self._task, None
        while task is not None and not task.done():
            task.cancel()  # again if a cancellation was lost on the way
            await asyncio.wait([task], timeout=1.0)
        if task is not None and not task.cancelled():
            task.exception()  # retrieved: a loop that ended on an error is not reported again

    async def close(self) -> None:
        await self.kill()
        await self.kube.close()

    @property
    def gauge(self) -> float:
        return float(self.service.metrics.registry.get_sample_value("disaggpool_leader") or 0.0)

    @property
    def errors(self) -> float:
        name = "disaggpool_leader_election_errors_total"
        return float(self.service.metrics.registry.get_sample_value(name) or 0.0)


@contextlib.asynccontextmanager
async def replicas(cluster: Cluster, lease: str, *names: str) -> AsyncIterator[list[Replica]]:
    made = [Replica(cluster, lease, n) for n in names]
    try:
        yield made
    finally:
        for r in made:
            await r.close()


async def until(check: Callable[[], bool], what: str, timeout: float) -> float:
    """Seconds until `check()` holds; fails after `timeout`."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.02)
    return time.monotonic() - start


async def lease_spec(cluster: Cluster, name: str) -> dict[str, Any]:
    kube = Kube(load_credentials(str(cluster.kubeconfig)))
    try:
        obj = await kube.get(path_for(API, "Lease", NS, name))
    finally:
        await kube.close()
    assert obj is not None, f"no Lease {name}"
    return dict(obj["spec"])


async def lead_and_stand_by(a: Replica, b: Replica, *, wait: bool = True) -> None:
    """Start `a` until it leads, then `b` (until it stands by, with `wait`)."""
    a.start()
    await until(lambda: a.elector.leading, "a to lead", 10)
    b.start()
    if wait:
        await until(lambda: b.service.standby.endswith("held by a"), "b to stand by", 10)


def leaders(rs: list[Replica]) -> list[str]:
    return [r.elector.identity for r in rs if r.elector.leading]


@pytest.mark.asyncio
async def test_one_leads_and_the_other_stands_by(cluster: Cluster) -> None:
    async with replicas(cluster, "one-leads", "a", "b") as (a, b):
        await lead_and_stand_by(a, b, wait=False)
        await asyncio.sleep(4 * FAST.retry_period_s + FAST.lease_duration_s)  # past one lease
        assert leaders([a, b]) == ["a"]  # a renews, so b never may take it
        assert a.service.standby == "" and a.gauge == 1.0
        assert b.service.standby == f"standby: lease {NS}/one-leads held by a" and b.gauge == 0.0
        spec = await lease_spec(cluster, "one-leads")
        assert spec["holderIdentity"] == "a"
        assert spec["leaseDurationSeconds"] == 3 and spec["leaseTransitions"] == 0
        assert spec["renewTime"] > spec["acquireTime"]  # renewed since taken


@pytest.mark.asyncio
async def test_a_killed_leader_is_replaced_once_its_lease_runs_out(cluster: Cluster) -> None:
    async with replicas(cluster, "killed", "a", "b") as (a, b):
        await lead_and_stand_by(a, b)
        await a.kill()
        took = await until(lambda: b.elector.leading, "b to take over", 15)
        # Not before the lease ran out on b's clock (b saw a's last renewal at most one retry
        # period before the kill), and within a lease, a retry period and slack after it.
        assert FAST.lease_duration_s - FAST.retry_period_s - 0.1 <= took
        assert took <= FAST.lease_duration_s + FAST.retry_period_s + 1.0
        spec = await lease_spec(cluster, "killed")
        assert spec["holderIdentity"] == "b" and spec["leaseTransitions"] == 1
        print(f"\nkilled leader replaced after {took:.2f} s (lease {FAST.lease_duration_s:g} s)")


@pytest.mark.asyncio
async def test_a_released_lease_is_taken_at_the_next_try(cluster: Cluster) -> None:
    async with replicas(cluster, "released", "a", "b") as (a, b):
        await lead_and_stand_by(a, b)
        await a.kill()  # the loop stops, as the supervisor's does on SIGTERM...
        await a.elector.release()  # ...and the drain writes the Lease free
        assert not a.elector.leading and a.gauge == 0.0
        assert a.service.standby == f"standby: lease {NS}/released released"
        took = await until(lambda: b.elector.leading, "b to take over", 10)
        assert took < FAST.lease_duration_s  # no expiry waited for
        assert took <= FAST.retry_period_s + 0.5
        await a.elector.step()  # released for good: a stopped trying
        assert not a.elector.leading
        spec = await lease_spec(cluster, "released")
        assert spec["holderIdentity"] == "b" and spec["leaseTransitions"] == 1


@pytest.mark.asyncio
async def test_a_release_that_meets_its_own_renewal_frees_the_lease(cluster: Cluster) -> None:
    """SIGTERM during a renewal: the renewal lands first, so the release's write, made at the
    version the leader last knew, gets a 409. It reads the Lease again and, still the holder,
    frees it at the new version (found through Envoy: the standby waited out a whole lease)."""
    async with replicas(cluster, "renewed", "a", "b") as (a, b):
        await lead_and_stand_by(a, b)
        await a.kill()
        kube = Kube(load_credentials(str(cluster.kubeconfig)))
        try:  # a's renewal, in flight when the drain began, lands: a new resourceVersion
            path = path_for(API, "Lease", NS, "renewed")
            obj = await kube.get(path)
            assert obj is not None and obj["spec"]["holderIdentity"] == "a"
            obj["spec"]["renewTime"] = micro_time(dt.datetime.now(dt.UTC))
            await kube.replace(path, obj)
        finally:
            await kube.close()
        await a.elector.release()
        took = await until(lambda: b.elector.leading, "b to take over", 10)
        assert took <= FAST.retry_period_s + 0.5  # released, not run out
        assert a.errors == 0.0


@pytest.mark.asyncio
async def test_two_writes_at_one_resource_version_have_one_winner(cluster: Cluster) -> None:
    async with replicas(cluster, "race", "a", "b") as (a, b):
        barrier = asyncio.Barrier(2)
        a.kube.barrier = b.kube.barrier = barrier
        # Both read "no Lease" and create it at once: the API server takes one (409 for the other).
        await asyncio.gather(a.elector.step(), b.elector.step())
        assert len(leaders([a, b])) == 1
        (first,) = leaders([a, b])
        loser = b if first == "a" else a
        assert loser.service.standby.startswith("standby") and loser.errors == 0.0  # a lost race
        winner = a if loser is b else b
        # The winner dies; after the lease both read the same expired record and replace it at
        # its resourceVersion at once: again exactly one write succeeds.
        await asyncio.sleep(FAST.lease_duration_s + 0.2)
        third = Replica(cluster, "race", "c")
        try:
            third.kube.barrier = barrier
            await asyncio.gather(loser.elector.step(), third.elector.step())  # both saw it now
            await asyncio.sleep(FAST.lease_duration_s + 0.2)  # ...and waited out the lease
            await asyncio.gather(loser.elector.step(), third.elector.step())
            assert len(leaders([loser, third])) == 1
            spec = await lease_spec(cluster, "race")
            assert spec["holderIdentity"] in (loser.elector.identity, "c")
            assert spec["holderIdentity"] != winner.elector.identity
            assert spec["leaseTransitions"] == 1
        finally:
            await third.close()


@pytest.mark.asyncio
async def test_a_leader_cut_off_from_the_api_server_steps_down_before_the_lease_ends(
    cluster: Cluster,
) -> None:
    async with replicas(cluster, "cut-off", "a", "b") as (a, b):
        await lead_and_stand_by(a, b, wait=False)
        a.kube.fault = "down"
        stepped = await until(lambda: not a.elector.leading, "a to step down", 10)
        assert stepped <= FAST.renew_deadline_s + FAST.retry_period_s + 0.5
        assert "not renewed for 2 s" in a.service.standby and a.gauge == 0.0
        assert a.errors >= 1
        await until(lambda: b.elector.leading, "b to take over", 10)
        a.kube.fault = ""  # back: a sees b's Lease and stays a standby
        await asyncio.sleep(4 * FAST.retry_period_s)
        assert leaders([a, b]) == ["b"] and a.service.standby.endswith("held by b")


@pytest.mark.asyncio
async def test_a_hanging_renewal_is_cut_off_at_the_renew_deadline(cluster: Cluster) -> None:
    async with replicas(cluster, "hang", "a") as (a,):
        a.start()
        await until(lambda: a.elector.leading, "a to lead", 10)
        a.kube.fault = "hang"
        stepped = await until(lambda: not a.elector.leading, "a to step down", 10)
        assert stepped <= FAST.renew_deadline_s + FAST.retry_period_s + 1.0  # cut at the deadline
        a.kube.fault = ""
        await until(lambda: a.elector.leading, "a to lead again (its own Lease)", 10)


@pytest.mark.asyncio
async def test_no_rights_on_leases_stands_by_and_counts(cluster: Cluster) -> None:
    async with replicas(cluster, "forbidden", "a") as (a,):
        a.kube.fault = "forbidden"
        a.start()
        await until(lambda: a.errors >= 3, "three failed tries", 30)
        assert not a.elector.leading and a.service.standby.startswith("standby")
        a.kube.fault = ""
        await until(lambda: a.elector.leading, "a to lead once allowed", 10)


@pytest.mark.asyncio
async def test_an_unexpected_error_makes_the_leader_stand_by_before_the_supervisor_backs_off(
    cluster: Cluster,
) -> None:
    async with replicas(cluster, "bug", "a") as (a,):
        await a.elector.step()
        assert a.elector.leading
        a.kube.fault = "bug"
        with pytest.raises(ValueError, match="does not expect"):
            await a.elector.step()  # raised to the supervisor, which counts it...
        assert not a.elector.leading and a.gauge == 0.0  # ...after standing by
        assert a.service.standby.endswith(
            "(ValueError: an error the elector does not expect (injected))"
        )
        a.kube.fault = ""
        await a.elector.step()
        assert a.elector.leading  # its own Lease again


@pytest.mark.asyncio
async def test_a_leader_whose_lease_was_taken_steps_down(cluster: Cluster) -> None:
    async with replicas(cluster, "taken", "a") as (a,):
        await a.elector.step()
        assert a.elector.leading
        # Another writer takes the Lease (a hand with kubectl, or a replica whose clock ran
        # far ahead): at its next try a reads the new holder and steps down at once.
        kube = Kube(load_credentials(str(cluster.kubeconfig)))
        try:
            path = path_for(API, "Lease", NS, "taken")
            obj = await kube.get(path)
            assert obj is not None
            obj["spec"]["holderIdentity"] = "intruder"
            await kube.replace(path, obj)
        finally:
            await kube.close()
        await a.elector.step()
        assert not a.elector.leading and a.gauge == 0.0
        assert a.service.standby == f"standby: lease {NS}/taken held by intruder"


async def _apply_empty_endpoints(cluster: Cluster, name: str) -> None:
    """A Service without a selector and its Endpoints, empty: what the operator renders."""
    kube = Kube(load_credentials(str(cluster.kubeconfig)))
    try:
        ports = [{"name": "http", "port": 8000}, {"name": "grpc-epp", "port": 9002}]
        service = {"metadata": {"name": name}, "spec": {"ports": ports}}
        await kube.create(path_for("v1", "Service", NS), service)
        await kube.create(path_for("v1", "Endpoints", NS), {"metadata": {"name": name}})
    finally:
        await kube.close()


async def _pointed_at(cluster: Cluster, name: str) -> tuple[dict[str, Any], list[str]]:
    """The Endpoints `name`, and the addresses of the EndpointSlices the controller manager
    mirrors from them (what kube-proxy of 1.20 reads)."""
    kube = Kube(load_credentials(str(cluster.kubeconfig)))
    try:
        ep = await kube.get(path_for("v1", "Endpoints", NS, name)) or {}
        slices = await kube.list(
            f"/apis/discovery.k8s.io/v1beta1/namespaces/{NS}/endpointslices",
            {"kubernetes.io/service-name": name},
        )
    finally:
        await kube.close()
    mirrored = [a for sl in slices for e in sl.get("endpoints") or [] for a in e["addresses"]]
    return ep, mirrored


def _addresses(ep: dict[str, Any]) -> list[str]:
    return [a["ip"] for sub in ep.get("subsets") or [] for a in sub.get("addresses") or []]


async def _settle(cluster: Cluster, name: str, ip: str) -> dict[str, Any]:
    """The Endpoints `name` once they, and their mirrored slice, hold `ip` alone."""
    deadline = time.monotonic() + 30  # the mirroring controller syncs within seconds
    while True:
        ep, mirrored = await _pointed_at(cluster, name)
        if _addresses(ep) == [ip] and mirrored == [ip]:
            return ep
        assert time.monotonic() < deadline, (ip, ep, mirrored)
        await asyncio.sleep(0.2)


def _endpoints(name: str, address: str) -> LeaderEndpoints:
    return LeaderEndpoints(name, (("http", 8000), ("grpc-epp", 9002)), address)


@pytest.mark.parametrize(
    ("address", "pod_ip", "words"),
    [("", None, "not set, and $POD_IP is unset"), ("", "pod", "not an IP address: 'pod'"),
     ("198.18.0.300", None, "not an IP address")],
)  # fmt: skip
def test_an_address_that_is_no_ip_is_refused_at_start(
    address: str, pod_ip: str | None, words: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if pod_ip is None:
        monkeypatch.delenv("POD_IP", raising=False)
    else:
        monkeypatch.setenv("POD_IP", pod_ip)
    config = LeaderElectionConfig(NS, "l", "a", FAST, _endpoints("r", address))
    with pytest.raises(InputError, match=r"leader_election\.endpoints\.address") as err:
        LeaderElector(config, FakeService())  # type: ignore[arg-type]
    assert words in str(err.value)


@pytest.mark.asyncio
async def test_the_leader_points_the_services_endpoints_at_itself(cluster: Cluster) -> None:
    """With `endpoints`, the traffic follows the Lease: the leader writes its address into the
    selector-less Service's Endpoints (mirrored into an EndpointSlice for kube-proxy), and the
    replica that takes over from a dead leader writes its own."""
    await _apply_empty_endpoints(cluster, "routers")
    a = Replica(cluster, "pointed", "a", _endpoints("routers", "198.18.0.11"))
    b = Replica(cluster, "pointed", "b", _endpoints("routers", "198.18.0.12"))
    try:
        await lead_and_stand_by(a, b)
        ep = await _settle(cluster, "routers", "198.18.0.11")
        (subset,) = ep["subsets"]
        assert {(p["name"], p["port"]) for p in subset["ports"]} == {
            ("http", 8000), ("grpc-epp", 9002),
        }  # fmt: skip
        assert subset["addresses"][0]["targetRef"]["kind"] == "Pod"
        assert a.errors == 0.0 and b.errors == 0.0  # the standby wrote nothing
        await a.kill()
        await until(lambda: b.elector.leading, "b to take over", 15)
        await _settle(cluster, "routers", "198.18.0.12")
    finally:
        await a.close()
        await b.close()


@pytest.mark.asyncio
async def test_endpoints_that_cannot_be_written_are_counted_and_written_once_they_can(
    cluster: Cluster,
) -> None:
    """The Lease is held either way: a leader whose Endpoints are missing keeps leading, counts
    each failed write, and points them at itself at a later renewal once they exist."""
    a = Replica(cluster, "unpointed", "a", _endpoints("later", "198.18.0.13"))
    try:
        a.start()
        await until(lambda: a.elector.leading and a.errors >= 2, "a to lead, unpointed", 10)
        await _apply_empty_endpoints(cluster, "later")
        await _settle(cluster, "later", "198.18.0.13")
        assert a.elector.leading
    finally:
        await a.close()


@pytest.mark.asyncio
async def test_the_sidecar_stands_by_until_it_leads_and_hands_over_on_drain(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig))
    for var in ("KUBERNETES_API", "KUBERNETES_SERVICE_HOST"):
        monkeypatch.delenv(var, raising=False)

    def config(identity: str) -> Any:
        return parse_config(
            {
                "model": "m",
                "listen": {"http": "127.0.0.1:0", "grpc": "127.0.0.1:0"},
                "slo_classes": [{"name": "c", "ttft_s": 1, "tpot_s": 0.1}],
                "scrape_interval_s": 30,
                "pool": {  # nothing listens there: the pool is unusable, readiness 503
                    "static": {
                        "prefill": [{"name": "p0", "url": "http://127.0.0.1:9"}],
                        "decode": [{"name": "d0", "url": "http://127.0.0.1:9"}],
                    }
                },
                "leader_election": {
                    "namespace": NS,
                    "name": "sidecars",
                    "identity": identity,
                    "lease_duration_s": 3,
                    "renew_deadline_s": 2,
                    "retry_period_s": 0.25,
                },
            }
        )

    a = await start_sidecar(config("a"))
    b = await start_sidecar(config("b"))
    try:
        async with aiohttp.ClientSession() as http:

            async def readyz(url: str, query: str = "") -> str:
                async with http.get(f"{url}/readyz{query}") as r:
                    body = await r.json()
                    return str(body.get("status") or body.get("error"))

            assert a.leader is not None and b.leader is not None
            await until(lambda: a.leader.leading or b.leader.leading, "a leader", 10)  # type: ignore[union-attr]
            lead, stand = (a, b) if a.leader.leading else (b, a)
            await until(lambda: "held by" in stand.service.standby, "the other to stand by", 10)
            assert (await readyz(stand.url)).startswith(f"standby: lease {NS}/sidecars held by")
            # The kubelet's check where the leader steers traffic by Endpoints leaves out the
            # leadership: the standby is then as ready as its pool (here: no pod, so not).
            assert (
                await readyz(stand.url, "?exclude=leader")
            ) == "no healthy prefill or decode pod"
            assert (await readyz(stand.url, "?exclude=etcd")).startswith("exclude: no such check")
            assert not (await readyz(lead.url)).startswith("standby")  # no pods: 503 for that
            assert "leader_election" in lead.supervisor.states()
            await lead.drain()  # SIGTERM: release first, then close
            took = await until(lambda: stand.leader.leading, "the standby to lead", 10)  # type: ignore[union-attr]
            assert took < 3.0
            assert not (await readyz(stand.url)).startswith("standby")
    finally:
        for sc in (a, b):
            with contextlib.suppress(Exception):
                await sc.close()
