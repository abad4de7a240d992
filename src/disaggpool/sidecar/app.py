"""One sidecar process: routing service, collectors, gRPC server, HTTP front door and (with
`listen.ext_proc`) the endpoint picker behind Envoy, on one loop.

`disaggpool sidecar --config FILE` calls `run_forever`; tests and the demo use `start_sidecar`,
which returns a `RunningSidecar` with the bound ports (0 in the config picks free ones) and an
async `close`. Everything shares one asyncio loop, so the routing service needs no locks. Every
background loop (the collectors', the gRPC health publisher, the pool writer) runs under one
`Supervisor`, which `/livez` reads. The endpoint picker (`sidecar.epp`) has a gRPC server of
its own, with the same credentials as the gRPC port and a health service answering for
``liveness`` (the supervised loops), ``readiness`` (the pool usable, as `/readyz`) and the
ext_proc service itself, as gateways probe it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal

import aiohttp
import grpc
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from disaggpool.sidecar.auth import KeyFile, TokenInterceptor, server_credentials
from disaggpool.sidecar.autoscale import DecodeRecommender, PrefillRecommender
from disaggpool.sidecar.book_bus import BookBus
from disaggpool.sidecar.collectors import Collectors
from disaggpool.sidecar.config import SidecarConfig, is_loopback
from disaggpool.sidecar.epp import EXT_PROC_SERVICE, ExtProcServicer
from disaggpool.sidecar.frontdoor import FrontDoor
from disaggpool.sidecar.grpc_server import SERVICE_NAME, add_router, health_status
from disaggpool.sidecar.leader import LeaderElector
from disaggpool.sidecar.pool_writer import AnnotationSource, DriftReport, PoolWriter
from disaggpool.sidecar.service import RoutingService
from disaggpool.sidecar.supervise import Supervisor
from disaggpool.sidecar.tokens import PromptCounter

__all__ = ["RunningSidecar", "run_forever", "start_sidecar"]

log = logging.getLogger("disaggpool.sidecar")


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _joined(host: str, port: int) -> str:
    """`host:port` as a client dials it (IPv6 in brackets; no host: every IPv4 interface)."""
    host = host or "0.0.0.0"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclasses.dataclass
class RunningSidecar:
    service: RoutingService
    collectors: Collectors
    supervisor: Supervisor
    http_port: int
    grpc_port: int
    _runner: web.AppRunner
    _grpc: grpc.aio.Server
    _session: aiohttp.ClientSession
    _health: health.aio.HealthServicer
    pool_writer: PoolWriter | None = None
    ext_proc_port: int = 0  # 0: no endpoint picker
    _ext_proc: grpc.aio.Server | None = None
    _ext_proc_health: health.aio.HealthServicer | None = None
    book_bus: BookBus | None = None  # with `shared_books`
    leader: LeaderElector | None = None  # with `leader_election`

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def ext_proc_target(self) -> str:
        return f"127.0.0.1:{self.ext_proc_port}"

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    async def drain(self) -> None:
        """What SIGTERM does. For `shutdown_delay_s` the router serves on while its health
        (HTTP `/health`, the gRPC health service) reports it draining and every answer closes
        its connection, so Kubernetes takes the pod out of the Service's endpoints before it
        stops listening; then `close` finishes the requests in flight. A leader first writes
        its Lease free, so a standby takes over at its next try (`sidecar.leader`)."""
        self.service.draining = True
        if self.leader is not None:
            await self.leader.release()
        await _publish_health(self._health, self.service)
        if self._ext_proc_health is not None:
            await _publish_epp_health(self._ext_proc_health, self.service, self.supervisor)
        await asyncio.sleep(self.service.config.shutdown_delay_s)
        await self.close()

    async def close(self) -> None:
        """Stop listening, then wait for the requests in flight (at most `shutdown_timeout_s`;
        their upstream legs need the session and the collectors' view of the pods)."""
        await self._grpc.stop(grace=1.0)  # Route and Report answer in microseconds
        if self._ext_proc is not None:
            # Its streams last as long as their answers: wait for them as for the front door's.
            await self._ext_proc.stop(grace=self.service.config.shutdown_timeout_s)
        await self._runner.cleanup()
        await self.collectors.stop()
        await self.supervisor.stop()
        if self.leader is not None:
            await self.leader.release()  # no-op after drain's; the Lease is not ours to keep
            await self.leader.close()
        if self.pool_writer is not None:
            await self.pool_writer.stop()
        await self._session.close()


async def start_sidecar(config: SidecarConfig, *, seed: int = 0) -> RunningSidecar:
    service = RoutingService(config, seed=seed)
    supervisor = Supervisor(service.metrics.loop_errors, service.metrics.loop_restarts)
    # Pooled connections shorter-lived than the pods' own keep-alive (config.py says why).
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=config.upstream_keepalive_s)
    t = config.upstream_timeouts  # the legs set their own; this bounds every other pod call
    timeout = aiohttp.ClientTimeout(total=t.total_s, sock_connect=t.connect_s)
    session = aiohttp.ClientSession(connector=connector, timeout=timeout)
    collectors = Collectors(service, session, supervisor)
    collectors.start()
    book_bus = None
    if config.shared_books is not None:  # other replicas' books (sidecar.book_bus)
        book_bus = BookBus(
            config.shared_books, service.state, service.metrics.registry, service.clock
        )
        supervisor.task("book_bus", book_bus.run)
    leader = None
    if config.leader_election is not None:  # active/passive: stand by until the Lease is ours
        leader = LeaderElector(config.leader_election, service, session=session)
        supervisor.periodic("leader_election", leader.step, leader.timings.retry_period_s)
    if config.static_members:
        await collectors.scrape_once()  # know the pods' health before the first request
    counter = PromptCounter(
        config.tokenizer, service.state, config.model, session, service.upstream_headers
    )

    runner = web.AppRunner(
        FrontDoor(service, session, counter, supervisor).app(),
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=config.shutdown_timeout_s,
    )
    await runner.setup()
    host, port = _split(config.http_listen)
    site = web.TCPSite(runner, host, port, reuse_address=True)
    await site.start()
    http_port = int(runner.addresses[0][1])
    if not config.auth.api_keys_file and not is_loopback(host):
        log.warning(
            "the front door on %s takes requests without an API key (auth.api_keys_file): "
            "anything that reaches the port can use the pool",
            config.http_listen,
        )

    grpc_server = _grpc_server(config, service)
    health_servicer = add_router(grpc_server, service, counter)
    ghost, gport = _split(config.grpc_listen)
    address = f"{ghost}:{gport}" if ":" not in ghost else f"[{ghost}]:{gport}"
    if config.grpc.tls is not None:
        grpc_port = grpc_server.add_secure_port(address, server_credentials(config.grpc.tls))
    else:
        grpc_port = grpc_server.add_insecure_port(address)
    await grpc_server.start()

    supervisor.periodic(
        "grpc_health", lambda: _publish_health(health_servicer, service), config.scrape_interval_s
    )
    pool_writer = _pool_writer(config, service, session)
    if pool_writer is not None:
        supervisor.periodic("pool_writer", pool_writer.step, pool_writer.period_s)
    ext_proc, ext_proc_port, ext_proc_health = None, 0, None
    if config.ext_proc_listen:
        ext_proc, ext_proc_port, ext_proc_health = await _start_ext_proc(config, service, counter)
        epp_health = ext_proc_health
        supervisor.periodic(
            "ext_proc_health",
            lambda: _publish_epp_health(epp_health, service, supervisor),
            config.scrape_interval_s,
        )
    log.info(
        "sidecar up on %s: policy %s, HTTP front door on http://%s, gRPC on %s%s",
        type(asyncio.get_running_loop()).__module__.split(".")[0],  # asyncio or uvloop
        config.policy,
        _joined(host, http_port),
        _joined(ghost, grpc_port),
        f", ext_proc on {_joined(_split(config.ext_proc_listen)[0], ext_proc_port)}"
        if ext_proc
        else "",
    )
    return RunningSidecar(
        service,
        collectors,
        supervisor,
        http_port,
        grpc_port,
        runner,
        grpc_server,
        session,
        health_servicer,
        pool_writer,
        ext_proc_port,
        ext_proc,
        ext_proc_health,
        book_bus,
        leader,
    )


async def _start_ext_proc(
    config: SidecarConfig, service: RoutingService, counter: PromptCounter
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """The endpoint picker's own gRPC server: ext_proc and health, with the gRPC port's
    credentials (a token checked on every Process stream, TLS)."""
    interceptors: list[grpc.aio.ServerInterceptor] = []
    if config.grpc.token_file:
        tokens = KeyFile(config.grpc.token_file)
        refused = service.metrics.auth_failures.labels("ext_proc").inc
        interceptors.append(TokenInterceptor(tokens, f"/{EXT_PROC_SERVICE}/", refused))
    server = grpc.aio.server(interceptors=interceptors)
    ext_proc_grpc.add_ExternalProcessorServicer_to_server(ExtProcServicer(service, counter), server)
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    host, port = _split(config.ext_proc_listen)
    address = f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"
    if config.grpc.tls is not None:
        bound = server.add_secure_port(address, server_credentials(config.grpc.tls))
    else:
        bound = server.add_insecure_port(address)
    await server.start()
    return server, bound, servicer


def _grpc_server(config: SidecarConfig, service: RoutingService) -> grpc.aio.Server:
    """The gRPC server, checking `grpc.token_file` on every router call when it is set."""
    interceptors: list[grpc.aio.ServerInterceptor] = []
    if config.grpc.token_file:
        tokens = KeyFile(config.grpc.token_file)
        refused = service.metrics.auth_failures.labels("grpc").inc
        interceptors.append(TokenInterceptor(tokens, f"/{SERVICE_NAME}/", refused))
    return grpc.aio.server(interceptors=interceptors)


async def _publish_health(servicer: health.aio.HealthServicer, service: RoutingService) -> None:
    """The gRPC health of the server and of the router service, from `health_status`."""
    status = health_status(service)
    for name in ("", "disaggpool.router.v1.Router"):
        await servicer.set(name, status)


async def _publish_epp_health(
    servicer: health.aio.HealthServicer, service: RoutingService, supervisor: Supervisor
) -> None:
    """The picker's health as gateways and kubelets probe it: ``liveness`` the process and its
    loops, ``readiness`` and the ext_proc service the pool usable and not draining."""
    codes = health_pb2.HealthCheckResponse
    alive = codes.SERVING if supervisor.alive else codes.NOT_SERVING
    ready = health_status(service)
    await servicer.set("liveness", alive)
    for name in ("", "readiness", EXT_PROC_SERVICE):
        await servicer.set(name, ready)


def _pool_writer(
    config: SidecarConfig, service: RoutingService, session: aiohttp.ClientSession
) -> PoolWriter | None:
    """What the router tells the operator on its pool: the decode (and, with
    ``autoscaling.prefill``, prefill) recommendation and the pods' drift errors, as configured;
    None when neither is."""
    sources: list[AnnotationSource] = []
    period, namespace, name = 15.0, "", ""
    if config.autoscaling is not None:
        a = config.autoscaling
        sources.append(DecodeRecommender(a, service))
        if a.prefill is not None:
            sources.append(PrefillRecommender(a, service))
        period, namespace, name = a.period_s, a.pool_namespace, a.pool_name
    if config.drift is not None:
        d = config.drift
        sources.append(DriftReport(service))
        period = min(period, d.period_s) if config.autoscaling else d.period_s
        namespace, name = namespace or d.pool_namespace, name or d.pool_name
    if not sources:
        return None
    return PoolWriter(
        service, sources, namespace=namespace, name=name, period_s=period, session=session
    )


def run_forever(config: SidecarConfig) -> None:
    """Serve until SIGINT/SIGTERM."""

    async def main() -> None:
        running = await start_sidecar(config)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await running.drain()

    # On uvloop where it is installed (a dependency everywhere but Windows): the gRPC router
    # serves about 9% more routes per core on it than on asyncio's loop, with a lower p50 at
    # 1,000 routes/s (BENCHMARKS.md, "uvloop and orjson"); the front door is level on either.
    try:
        import uvloop
    except ImportError:
        asyncio.run(main())
    else:
        uvloop.run(main())
