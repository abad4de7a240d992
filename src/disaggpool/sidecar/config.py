"""The sidecar's configuration file (`disaggpool sidecar --config FILE`), parsed and checked once.

Every field is documented in `sidecar/CONFIG.md`. Parsing names the file and the field on any
error (``sidecar.yaml: pool.static.decode[2].url: must be a non-empty string``); nothing
downstream re-validates. Read by `sidecar.app` (the process) and by `demo` (which writes one).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlparse

from disaggpool.core.autoscaling import MAX_HEADROOM
from disaggpool.core.contracts import Role, SLOClass
from disaggpool.core.demand import BURST_WINDOW_DEFAULT_S, BURST_WINDOW_MIN_S
from disaggpool.core.lease import LeaseTimings
from disaggpool.core.policies.registry import (
    CALIBRATED_FAMILY,
    DECODE_BINDINGS,
    DEFAULT_DECODE_BINDING,
    NEEDS_PREFIX_INDEX,
    ROUTER_POLICIES,
    DecodeBinding,
    PolicyOptions,
    default_options,
)
from disaggpool.core.predictor import make_predictor
from disaggpool.errors import InputError
from disaggpool.formats.fields import FieldReader, nats_url_problem, read_slo_classes
from disaggpool.formats.profiles import load_yaml
from disaggpool.kubeclient import parse_selector
from disaggpool.pdwire import POD_CONNECTION_REUSE_S
from disaggpool.sidecar.config_access import (
    DEFAULT_GRPC_LISTEN,
    AuthConfig,
    GatewayConfig,
    GrpcConfig,
    GrpcTLS,
    check_exposure,
    is_loopback,
    parse_auth,
    parse_gateway,
    parse_grpc,
)

__all__ = [
    "AuthConfig",
    "GatewayConfig",
    "GrpcConfig",
    "GrpcTLS",
    "KubernetesSource",
    "LeaderElectionConfig",
    "LeaderEndpoints",
    "Member",
    "ReplicaBounds",
    "SharedBooksConfig",
    "SidecarConfig",
    "TokenizerConfig",
    "is_loopback",
    "load_config",
    "parse_config",
    "parse_members",
]


@dataclasses.dataclass(frozen=True, slots=True)
class Member:
    """One vLLM pod of the pool: its name, role, base URL, and where it publishes its KV events
    (a ZMQ endpoint such as ``tcp://198.18.0.5:5557``; "" when the router does not listen)."""

    name: str
    role: Role
    url: str
    kv_events: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class KVEventsSource:
    """Subscribing to the prefill pods' vLLM KV events (CONFIG.md, "The prefix index").

    `port`: with Kubernetes membership, each pod's events are at ``tcp://<pod IP>:<port>``
    (static and file members name their own `kv_events` endpoint). `topic`: the subscription
    prefix. `stale_after_s`: a pod sent prompt blocks it did not hold that announces nothing for
    this long is read from the approximate index until it publishes again."""

    port: int = 5557
    topic: str = ""
    stale_after_s: float = 10.0


@dataclasses.dataclass(frozen=True, slots=True)
class ReplicaBounds:
    """One role's autoscaling bounds (``autoscaling.prefill``)."""

    min_replicas: int
    max_replicas: int


#: How often the autoscalers recommend: every 5 s, as in the simulator, since the decode
#: scaler's occupancy trend needs a few points within its 30 s span to see a pool filling
#: (core.autoscaling.OCCUPANCY_SPAN_S).
AUTOSCALING_PERIOD_S = 5.0


@dataclasses.dataclass(frozen=True, slots=True)
class AutoscalingConfig:
    """The router's autoscalers (`sidecar.autoscale`): decode's bounds (`min_replicas`,
    `max_replicas`), prefill's when `prefill` is set (None: no prefill recommendation), the
    timing both share, the floor `min_headroom` both keep over the offered load, and the
    DisaggPool they write their recommendations on (none: metrics only)."""

    min_replicas: int
    max_replicas: int
    startup_s: float = 120.0
    stabilization_s: float = 300.0
    burst_window_s: float = BURST_WINDOW_DEFAULT_S
    target_goodput: float = 0.9
    period_s: float = AUTOSCALING_PERIOD_S
    pool_namespace: str = ""
    pool_name: str = ""
    min_headroom: float = 0.0
    prefill: ReplicaBounds | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class DriftConfig:
    """Per-pod prediction error (`core.drift`) and the DisaggPool it is written on, where the
    operator re-probes pods above `calibration.maxPredictionError` (none: metrics only).
    `max_error` (> 0; 0 is off): a pod whose error exceeds it is scored as a pod without a trusted
    profile until a new profile is installed (`sidecar.profile_trust`)."""

    window: int = 64
    min_samples: int = 16
    period_s: float = 15.0
    pool_namespace: str = ""
    pool_name: str = ""
    max_error: float = 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class KubernetesSource:
    """Objects of one namespace chosen by labels (pods for membership, ConfigMaps for profiles).

    `owner` (profiles only): the DisaggPool whose profiles count; a ConfigMap without an owner
    reference to it is ignored, so a stray ConfigMap with the right labels cannot steer routing."""

    namespace: str
    selector: str
    port: int = 8000
    owner: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class UpstreamTimeouts:
    """Per-leg limits (CONFIG.md, "The front door"): connecting, the answer's first byte (the
    prefill leg's whole answer; a streamed decode leg's headers), the longest gap between two
    chunks of a stream, and the whole leg."""

    connect_s: float = 5.0
    first_byte_s: float = 300.0
    idle_s: float = 60.0
    total_s: float = 600.0


@dataclasses.dataclass(frozen=True, slots=True)
class TokenizerConfig:
    """How prompt lengths are made exact.

    ``engine``: POST the prompt to a prefill pod's `/tokenize` (always exact, one round trip);
    ``emulator``: the emulator's deterministic tokenizer in process (exact for emulated pools);
    ``huggingface``: a `tokenizer.json` loaded with the `tokenizers` library (exact for real
    models, no round trip).
    """

    kind: Literal["engine", "emulator", "huggingface"] = "engine"
    path: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class SharedBooksConfig:
    """Router replicas sharing their books over NATS (`sidecar.book_bus`, CONFIG.md)."""

    nats_url: str
    subject: str
    replica_id: str = ""  # "": the pod's name ($HOSTNAME, else the host name)
    lease_s: float = 30.0
    token_file: str = ""  # a NATS token, read at each (re)connect
    credentials_file: str = ""  # a NATS .creds file (user JWT + NKey seed)
    max_pending: int = 10_000  # events held while the bus is down; beyond: dropped, counted


@dataclasses.dataclass(frozen=True, slots=True)
class LeaderElectionConfig:
    """Active/passive replicas: the one holding Lease `namespace/name` routes, the others stand
    by (`sidecar.leader`, CONFIG.md "Leader election")."""

    namespace: str
    name: str
    identity: str = ""  # "": the pod's name ($HOSTNAME, else the host name), "_", 8 hex digits
    timings: LeaseTimings = dataclasses.field(default_factory=LeaseTimings)
    endpoints: LeaderEndpoints | None = None  # the Service's endpoints the leader writes


@dataclasses.dataclass(frozen=True, slots=True)
class LeaderEndpoints:
    """``leader_election.endpoints``: the core/v1 Endpoints of a Service without a selector
    (same namespace as the Lease), which the leader points at itself, so every healthy replica
    can be Ready while only the leader gets traffic (CONFIG.md "Leader election")."""

    name: str
    ports: tuple[tuple[str, int], ...]  # (the Service's port name, this replica's port)
    address: str = ""  # "": $POD_IP


@dataclasses.dataclass(frozen=True, slots=True)
class SidecarConfig:
    policy: str
    model: str
    slo_classes: tuple[SLOClass, ...]  # the default class first
    grpc_listen: str = DEFAULT_GRPC_LISTEN
    http_listen: str = "0.0.0.0:8000"
    ext_proc_listen: str = ""  # the endpoint picker behind Envoy (sidecar.epp); "": none
    predictor: str = "online"
    scrape_interval_s: float = 1.0
    scrape_timeout_s: float = 0.0  # 0: max(2 s, 4 x interval), at most 10 s
    max_inflight: int = 512
    prefill_attempts: int = 2
    decode_attempts: int = 2
    inflight_ttl_s: float = 600.0
    upstream_timeouts: UpstreamTimeouts = UpstreamTimeouts()
    max_body_bytes: int = 4 * 1024 * 1024
    max_model_len: int = 0  # 0: each pod's own, read from its /v1/models
    forward_client_priority: bool = False
    debug_errors: bool = False
    served_by_headers: bool = False  # answers name the pods that served them (pod names only)
    auth: AuthConfig = dataclasses.field(default_factory=AuthConfig)
    grpc: GrpcConfig = dataclasses.field(default_factory=GrpcConfig)
    gateway: GatewayConfig = dataclasses.field(default_factory=GatewayConfig)
    # An idle pooled connection to a pod is reused only this long: keep it below the pods'
    # keep-alive (`pdwire.POD_CONNECTION_REUSE_S` says why).
    upstream_keepalive_s: float = POD_CONNECTION_REUSE_S
    shutdown_delay_s: float = 0.0  # after SIGTERM: serve on, failing health (sidecar.app)
    shutdown_timeout_s: float = 50.0  # then: the longest wait for requests in flight
    heterogeneity_window: int = 512
    tokenizer: TokenizerConfig = TokenizerConfig()
    static_members: tuple[Member, ...] = ()
    members_file: str = ""
    members_kubernetes: KubernetesSource | None = None
    profiles_dir: str = ""
    profiles_kubernetes: KubernetesSource | None = None
    decode_binding: DecodeBinding = DEFAULT_DECODE_BINDING
    prefix_index: bool = False
    kv_events: KVEventsSource | None = None
    autoscaling: AutoscalingConfig | None = None
    drift: DriftConfig | None = None
    shared_books: SharedBooksConfig | None = None
    leader_election: LeaderElectionConfig | None = None
    options: PolicyOptions = dataclasses.field(default_factory=PolicyOptions)

    @property
    def scrape_timeout(self) -> float:
        if self.scrape_timeout_s:
            return self.scrape_timeout_s
        return max(2.0, min(10.0, 4 * self.scrape_interval_s))

    @property
    def default_slo(self) -> SLOClass:
        return self.slo_classes[0]

    def slo(self, name: str) -> SLOClass | None:
        """The class called `name` ('' = the default), or None."""
        if not name:
            return self.slo_classes[0]
        return next((c for c in self.slo_classes if c.name == name), None)


_TOP = {
    "policy",
    "model",
    "listen",
    "slo_classes",
    "default_slo_class",
    "predictor",
    "scrape_interval_s",
    "scrape_timeout_s",
    "max_inflight",
    "prefill_attempts",
    "decode_attempts",
    "inflight_ttl_s",
    "upstream_timeout_s",
    "upstream_timeouts",
    "max_body_bytes",
    "max_model_len",
    "forward_client_priority",
    "debug_errors",
    "served_by_headers",
    "auth",
    "grpc",
    "gateway",
    "upstream_keepalive_s",
    "shutdown_delay_s",
    "shutdown_timeout_s",
    "heterogeneity_window",
    "tokenizer",
    "pool",
    "profiles",
    "decode_binding",
    "prefix_index",
    "kv_events",
    "pd_decider",
    "local_prefill_below",
    "priority_scheduling",
    "autoscaling",
    "drift",
    "shared_books",
    "leader_election",
}


def load_config(path: str | Path) -> SidecarConfig:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise InputError(str(path), "<file>", f"cannot read: {exc.strerror or exc}") from None
    return parse_config(load_yaml(text), str(path), base=Path(path).parent)


def parse_config(doc: Any, source: str = "<config>", base: Path | None = None) -> SidecarConfig:
    rd = FieldReader(source)
    top = rd.mapping(doc, "<document>")
    rd.known(top, "", _TOP)
    policy = rd.string(top.get("policy", "calibrated"), "policy")
    if policy not in ROUTER_POLICIES:
        raise rd.fail("policy", f"unknown policy {policy!r}; valid: {', '.join(ROUTER_POLICIES)}")
    classes = read_slo_classes(rd, top.get("slo_classes"))
    default = top.get("default_slo_class")
    if default is not None:
        match = [c for c in classes if c.name == default]
        if not match:
            raise rd.fail("default_slo_class", f"no SLO class named {default!r}")
        classes = (match[0], *[c for c in classes if c is not match[0]])
    predictor = rd.string(top.get("predictor", "online"), "predictor")
    try:
        make_predictor(predictor)
    except (InputError, ValueError) as exc:
        raise rd.fail("predictor", str(exc)) from None
    if predictor.strip().lower() != "online":  # oracles need the true output: simulator only
        raise rd.fail("predictor", f"{predictor!r} needs the true output; use online")
    listen = rd.mapping(top.get("listen", {}), "listen")
    rd.known(listen, "listen", {"grpc", "http", "ext_proc"})
    kwargs: dict[str, Any] = {}
    for key in ("grpc", "http", "ext_proc"):
        if key in listen:
            kwargs[f"{key}_listen"] = _address(rd, listen[key], f"listen.{key}")
    positive = (
        "scrape_interval_s",
        "scrape_timeout_s",
        "inflight_ttl_s",
        "upstream_keepalive_s",
    )
    for key in (*positive, "shutdown_timeout_s"):
        if key in top:
            kwargs[key] = rd.number(top[key], key, positive=True)
    if "shutdown_delay_s" in top:
        kwargs["shutdown_delay_s"] = rd.number(top["shutdown_delay_s"], "shutdown_delay_s")
    for key in ("max_inflight", "prefill_attempts", "decode_attempts", "heterogeneity_window"):
        if key in top:
            least = 2 if key == "heterogeneity_window" else 1
            kwargs[key] = rd.integer(top[key], key, minimum=least)
    if "max_body_bytes" in top:
        kwargs["max_body_bytes"] = rd.integer(top["max_body_bytes"], "max_body_bytes", minimum=1024)
    if "max_model_len" in top:
        kwargs["max_model_len"] = rd.integer(top["max_model_len"], "max_model_len", minimum=0)
    for key in ("forward_client_priority", "debug_errors", "served_by_headers"):
        if key in top:
            kwargs[key] = rd.boolean(top[key], key)
    kwargs["upstream_timeouts"] = _timeouts(rd, top)
    if "auth" in top:
        kwargs["auth"] = parse_auth(rd, top["auth"], base)
    if "grpc" in top:
        kwargs["grpc"] = parse_grpc(rd, top["grpc"], base)
    if "gateway" in top:
        kwargs["gateway"] = parse_gateway(rd, top["gateway"])
    check_exposure(rd, kwargs)
    if "tokenizer" in top:
        kwargs["tokenizer"] = _tokenizer(rd, top["tokenizer"], base)
    kwargs.update(_pool(rd, top.get("pool"), base))
    kwargs.update(_profiles(rd, top.get("profiles", {}), base))
    binding = top.get("decode_binding", DEFAULT_DECODE_BINDING)
    if binding not in DECODE_BINDINGS:
        raise rd.fail("decode_binding", f"must be arrival or late, got {binding!r}")
    kwargs["decode_binding"] = binding
    kwargs["prefix_index"] = rd.boolean(top.get("prefix_index", False), "prefix_index")
    if policy in NEEDS_PREFIX_INDEX and not kwargs["prefix_index"]:
        raise rd.fail("policy", f"{policy!r} routes by prefix cache: needs prefix_index: true")
    if "kv_events" in top:
        if not kwargs["prefix_index"]:
            raise rd.fail("kv_events", "feeds the prefix index: needs prefix_index: true")
        kwargs["kv_events"] = _kv_events(rd, top["kv_events"])
    if "autoscaling" in top:
        kwargs["autoscaling"] = _autoscaling(rd, top["autoscaling"])
    if "drift" in top:
        kwargs["drift"] = _drift(rd, top["drift"])
    if "shared_books" in top:
        kwargs["shared_books"] = _shared_books(rd, top["shared_books"], base, top.get("model"))
    if "leader_election" in top:
        kwargs["leader_election"] = _leader_election(rd, top["leader_election"])
    a, d = kwargs.get("autoscaling"), kwargs.get("drift")
    refs = {(c.pool_namespace, c.pool_name) for c in (a, d) if c is not None and c.pool_name}
    if len(refs) > 1:  # one router, one pool
        raise rd.fail("drift.pool", "must name the pool autoscaling.pool names")
    default = default_options(policy)
    pd_decider = rd.boolean(top.get("pd_decider", default.pd_decider), "pd_decider")
    if pd_decider and policy not in CALIBRATED_FAMILY:
        raise rd.fail("pd_decider", f"prices in seconds: needs a calibrated policy, not {policy!r}")
    priority = rd.boolean(top.get("priority_scheduling", False), "priority_scheduling")
    if priority and policy not in CALIBRATED_FAMILY:
        raise rd.fail(
            "priority_scheduling", f"needs a predicted TTFT: a calibrated policy, not {policy!r}"
        )
    below = top.get("local_prefill_below", 0)
    kwargs["options"] = PolicyOptions(
        pd_decider=pd_decider,
        local_prefill_below=rd.integer(below, "local_prefill_below", minimum=0) if below else 0,
        priority_scheduling=priority,
    )
    return SidecarConfig(
        policy=policy,
        model=rd.string(top.get("model"), "model"),
        slo_classes=classes,
        predictor=predictor,
        **kwargs,
    )


def _autoscaling(rd: FieldReader, raw: Any) -> AutoscalingConfig:
    a = rd.mapping(raw, "autoscaling")
    keys = {"min_replicas", "max_replicas", "startup_s", "stabilization_s", "burst_window_s"}
    rd.known(
        a, "autoscaling", keys | {"target_goodput", "period_s", "pool", "min_headroom", "prefill"}
    )
    lo, hi = _replica_bounds(rd, a, "autoscaling")
    target = rd.number(a.get("target_goodput", 0.9), "autoscaling.target_goodput", positive=True)
    if not 0.5 <= target < 1:
        raise rd.fail("autoscaling.target_goodput", f"must be in [0.5, 1), got {target}")
    burst = rd.number(a.get("burst_window_s", BURST_WINDOW_DEFAULT_S), "autoscaling.burst_window_s")
    if burst < BURST_WINDOW_MIN_S:
        raise rd.fail(
            "autoscaling.burst_window_s", f"must be at least {BURST_WINDOW_MIN_S:g} s, got {burst}"
        )
    out = AutoscalingConfig(
        lo,
        hi,
        startup_s=rd.number(a.get("startup_s", 120.0), "autoscaling.startup_s"),
        stabilization_s=rd.number(a.get("stabilization_s", 300.0), "autoscaling.stabilization_s"),
        burst_window_s=burst,
        target_goodput=target,
        period_s=rd.number(
            a.get("period_s", AUTOSCALING_PERIOD_S), "autoscaling.period_s", positive=True
        ),
    )
    headroom = rd.number(a.get("min_headroom", 0.0), "autoscaling.min_headroom")
    if headroom > MAX_HEADROOM:  # the scalers' own limit (core.autoscaling)
        raise rd.fail(
            "autoscaling.min_headroom", f"must be at most {MAX_HEADROOM:g}, got {headroom}"
        )
    out = dataclasses.replace(out, min_headroom=headroom)
    if "prefill" in a:
        p = rd.mapping(a["prefill"], "autoscaling.prefill")
        rd.known(p, "autoscaling.prefill", {"min_replicas", "max_replicas"})
        out = dataclasses.replace(
            out, prefill=ReplicaBounds(*_replica_bounds(rd, p, "autoscaling.prefill"))
        )
    if "pool" in a:
        ns, name = _pool_ref(rd, a["pool"], "autoscaling.pool")
        out = dataclasses.replace(out, pool_namespace=ns, pool_name=name)
    return out


def _replica_bounds(rd: FieldReader, raw: Mapping[str, Any], path: str) -> tuple[int, int]:
    """``min_replicas`` and ``max_replicas`` of `raw` (both required; 1 <= max >= min)."""
    for key in ("min_replicas", "max_replicas"):
        if key not in raw:
            raise rd.fail(f"{path}.{key}", "required")
    lo = rd.integer(raw["min_replicas"], f"{path}.min_replicas", minimum=0)
    hi = rd.integer(raw["max_replicas"], f"{path}.max_replicas", minimum=max(1, lo))
    return lo, hi


def _drift(rd: FieldReader, raw: Any) -> DriftConfig:
    d = rd.mapping(raw or {}, "drift")
    rd.known(d, "drift", {"window", "min_samples", "period_s", "pool", "max_error"})
    window = rd.integer(d.get("window", 64), "drift.window", minimum=1)
    least = rd.integer(d.get("min_samples", 16), "drift.min_samples", minimum=1)
    if least > window:
        raise rd.fail("drift.min_samples", f"must be <= drift.window ({window}), got {least}")
    period = rd.number(d.get("period_s", 15.0), "drift.period_s", positive=True)
    ns, name = _pool_ref(rd, d["pool"], "drift.pool") if "pool" in d else ("", "")
    max_error = rd.number(d.get("max_error", 0.0), "drift.max_error")
    if not max_error < float("inf"):  # NaN would never be exceeded, infinity never either
        raise rd.fail("drift.max_error", f"must be a finite number >= 0, got {max_error!r}")
    return DriftConfig(window, least, period, ns, name, max_error)


def _shared_books(rd: FieldReader, raw: Any, base: Path | None, model: Any) -> SharedBooksConfig:
    """``shared_books``: every port authenticated or loopback-only, so a NATS server beyond
    this machine needs a token or credentials file (never a secret in the URL itself)."""
    s = rd.mapping(raw, "shared_books")
    keys = {"nats_url", "subject", "replica_id", "lease_s", "token_file", "credentials_file"}
    rd.known(s, "shared_books", keys | {"max_pending"})
    url = rd.string(s.get("nats_url"), "shared_books.nats_url")
    problem = nats_url_problem(url)
    if problem is not None:
        raise rd.fail("shared_books.nats_url", problem)
    host = urlparse(url).hostname or ""
    files = {
        key: rd.path(s[key], f"shared_books.{key}", base)
        for key in ("token_file", "credentials_file")
        if key in s
    }
    if len(files) > 1:
        raise rd.fail(
            "shared_books.credentials_file", "set token_file or credentials_file, not both"
        )
    if not files and not is_loopback(host):
        raise rd.fail(
            "shared_books.nats_url",
            f"{host} is beyond this machine: set shared_books.token_file or "
            "shared_books.credentials_file",
        )
    default_subject = "disaggpool.books." + _subject_token(model if isinstance(model, str) else "")
    subject = rd.string(s.get("subject", default_subject), "shared_books.subject")
    if any(c in subject for c in " \t*>") or subject.startswith(".") or subject.endswith("."):
        raise rd.fail("shared_books.subject", f"not a NATS subject without wildcards: {subject!r}")
    replica = (
        rd.string(s.get("replica_id", ""), "shared_books.replica_id", default="")
        if "replica_id" in s
        else ""
    )
    return SharedBooksConfig(
        nats_url=url,
        subject=subject,
        replica_id=replica,
        lease_s=rd.number(s.get("lease_s", 30.0), "shared_books.lease_s", positive=True),
        max_pending=rd.integer(s.get("max_pending", 10_000), "shared_books.max_pending", minimum=1),
        **files,
    )


def _leader_election(rd: FieldReader, raw: Any) -> LeaderElectionConfig:
    """``leader_election``: the Lease (namespace and name, both required) and its timings,
    which must leave no moment where two replicas could both lead (`core.lease`)."""
    le = rd.mapping(raw, "leader_election")
    timing_keys = ("lease_duration_s", "renew_deadline_s", "retry_period_s")
    rd.known(le, "leader_election", {"namespace", "name", "identity", "endpoints", *timing_keys})
    name = _object_name(rd, le.get("name"), "leader_election.name")
    default = LeaseTimings()
    timings = LeaseTimings(
        *(
            rd.number(le.get(key, getattr(default, key)), f"leader_election.{key}", positive=True)
            for key in timing_keys
        )
    )
    problems = timings.problems()
    if problems:
        key, why = problems[0]
        raise rd.fail(f"leader_election.{key}", f"{why}, got {getattr(timings, key)}")
    identity = ""
    if "identity" in le:
        identity = rd.string(le["identity"], "leader_election.identity")
    return LeaderElectionConfig(
        namespace=rd.string(le.get("namespace"), "leader_election.namespace"),
        name=name,
        identity=identity,
        timings=timings,
        endpoints=_leader_endpoints(rd, le["endpoints"]) if "endpoints" in le else None,
    )


def _object_name(rd: FieldReader, raw: Any, path: str) -> str:
    name = rd.string(raw, path)
    if len(name) > 253 or not all(c.isalnum() or c in "-." for c in name) or name != name.lower():
        raise rd.fail(path, f"not a Kubernetes object name: {name!r}")
    return name


def _leader_endpoints(rd: FieldReader, raw: Any) -> LeaderEndpoints:
    """``leader_election.endpoints``: the Endpoints' name, its ports by the Service's port
    names (at least one), and this replica's address (default ``$POD_IP``, read at start)."""
    at = "leader_election.endpoints"
    ep = rd.mapping(raw, at)
    rd.known(ep, at, {"name", "ports", "address"})
    ports = rd.mapping(ep.get("ports"), f"{at}.ports")
    if not ports:
        raise rd.fail(f"{at}.ports", "name at least one port: {service port name: number}")
    pairs = []
    for port_name, number in ports.items():
        rd.string(port_name, f"{at}.ports")
        pairs.append((str(port_name), rd.integer(number, f"{at}.ports.{port_name}")))
        if pairs[-1][1] > 65535:
            raise rd.fail(f"{at}.ports.{port_name}", f"not a port: {number}")
    address = rd.string(ep["address"], f"{at}.address") if "address" in ep else ""
    return LeaderEndpoints(_object_name(rd, ep.get("name"), f"{at}.name"), tuple(pairs), address)


def _subject_token(name: str) -> str:
    """`name` as one NATS subject token (a model name has dots and slashes)."""
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name) or "default"


def _pool_ref(rd: FieldReader, raw: Any, path: str) -> tuple[str, str]:
    """A DisaggPool the router writes on: (namespace, name)."""
    pool = rd.mapping(raw, path)
    rd.known(pool, path, {"namespace", "name"})
    return rd.string(pool.get("namespace"), f"{path}.namespace"), rd.string(
        pool.get("name"), f"{path}.name"
    )


def _kv_events(rd: FieldReader, raw: Any) -> KVEventsSource:
    k = rd.mapping(raw or {}, "kv_events")
    rd.known(k, "kv_events", {"port", "topic", "stale_after_s"})
    port = rd.integer(k.get("port", 5557), "kv_events.port", minimum=1)
    if port > 65535:
        raise rd.fail("kv_events.port", f"not a port: {port}")
    topic = k.get("topic", "")
    if not isinstance(topic, str):
        raise rd.fail("kv_events.topic", "must be a string")
    stale = rd.number(k.get("stale_after_s", 10.0), "kv_events.stale_after_s", positive=True)
    return KVEventsSource(port, topic, stale)


def _address(rd: FieldReader, value: Any, path: str) -> str:
    text = rd.string(value, path)
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise rd.fail(path, f"must be HOST:PORT, got {text!r}")
    return text


def _timeouts(rd: FieldReader, top: Mapping[str, Any]) -> UpstreamTimeouts:
    """`upstream_timeouts`, with `upstream_timeout_s` as the older name of its `total_s`."""
    t = rd.mapping(top.get("upstream_timeouts", {}), "upstream_timeouts")
    keys = ("connect_s", "first_byte_s", "idle_s", "total_s")
    rd.known(t, "upstream_timeouts", set(keys))
    if "upstream_timeout_s" in top and "total_s" in t:
        raise rd.fail("upstream_timeout_s", "give upstream_timeouts.total_s alone")
    values = {k: rd.number(t[k], f"upstream_timeouts.{k}", positive=True) for k in keys if k in t}
    if "upstream_timeout_s" in top:
        values["total_s"] = rd.number(
            top["upstream_timeout_s"], "upstream_timeout_s", positive=True
        )
    out = UpstreamTimeouts(**values)
    for key in ("first_byte_s", "idle_s"):
        if getattr(out, key) > out.total_s:
            raise rd.fail(f"upstream_timeouts.{key}", f"must be at most total_s ({out.total_s})")
    return out


def _tokenizer(rd: FieldReader, raw: Any, base: Path | None) -> TokenizerConfig:
    t = rd.mapping(raw, "tokenizer")
    rd.known(t, "tokenizer", {"kind", "path"})
    kind = t.get("kind", "engine")
    if kind not in ("engine", "emulator", "huggingface"):
        raise rd.fail("tokenizer.kind", f"must be engine, emulator or huggingface, got {kind!r}")
    path = ""
    if kind == "huggingface":
        path = rd.path(t.get("path"), "tokenizer.path", base)
    return TokenizerConfig(kind=kind, path=path)


def _kubernetes(rd: FieldReader, raw: Any, path: str, *, port: bool) -> KubernetesSource:
    k = rd.mapping(raw, path)
    rd.known(
        k, path, {"namespace", "selector", "port"} if port else {"namespace", "selector", "owner"}
    )
    selector = rd.string(k.get("selector"), f"{path}.selector")
    try:
        parse_selector(selector)
    except ValueError as exc:
        raise rd.fail(f"{path}.selector", str(exc)) from None
    return KubernetesSource(
        namespace=rd.string(k.get("namespace"), f"{path}.namespace"),
        selector=selector,
        port=rd.integer(k.get("port", 8000), f"{path}.port") if port else 8000,
        owner=rd.string(k["owner"], f"{path}.owner") if "owner" in k else "",
    )


def _pool(rd: FieldReader, raw: Any, base: Path | None) -> dict[str, Any]:
    pool = rd.mapping(raw, "pool")
    rd.known(pool, "pool", {"static", "file", "kubernetes"})
    if len(pool) != 1:
        raise rd.fail("pool", "give exactly one of static, file, kubernetes")
    if "static" in pool:
        return {"static_members": parse_members(pool["static"], rd, "pool.static")}
    if "file" in pool:
        return {"members_file": rd.path(pool["file"], "pool.file", base)}
    return {"members_kubernetes": _kubernetes(rd, pool["kubernetes"], "pool.kubernetes", port=True)}


def _profiles(rd: FieldReader, raw: Any, base: Path | None) -> dict[str, Any]:
    prof = rd.mapping(raw, "profiles")
    rd.known(prof, "profiles", {"dir", "kubernetes"})
    out: dict[str, Any] = {}
    if "dir" in prof:
        out["profiles_dir"] = rd.path(prof["dir"], "profiles.dir", base)
    if "kubernetes" in prof:
        out["profiles_kubernetes"] = _kubernetes(
            rd, prof["kubernetes"], "profiles.kubernetes", port=False
        )
    return out


def parse_members(raw: Any, rd: FieldReader, path: str) -> tuple[Member, ...]:
    """``{prefill: [{name, url}], decode: [...]}``: at least one of each, unique names."""
    m = rd.mapping(raw, path)
    rd.known(m, path, {"prefill", "decode"})
    members: list[Member] = []
    for role in ("prefill", "decode"):
        items = rd.nonempty_list(m.get(role), f"{path}.{role}", of="{name, url}")
        for i, item in enumerate(items):
            at = f"{path}.{role}[{i}]"
            entry: Mapping[str, Any] = rd.mapping(item, at)
            rd.known(entry, at, {"name", "url", "kv_events"})
            url = rd.string(entry.get("url"), f"{at}.url").rstrip("/")
            parsed = urlparse(url)
            if parsed.scheme not in ("http", "https") or not parsed.netloc:
                raise rd.fail(f"{at}.url", f"must be an http(s) base URL, got {url!r}")
            events = entry.get("kv_events", "")
            if events:
                events = rd.string(events, f"{at}.kv_events")
                host, _, port = events.removeprefix("tcp://").rpartition(":")
                tcp = events.startswith("tcp://") and host and port.isdigit()
                if not tcp and not (events.startswith("ipc://") and len(events) > 6):
                    raise rd.fail(
                        f"{at}.kv_events", f"must be tcp://HOST:PORT or ipc://PATH, got {events!r}"
                    )
            members.append(Member(rd.string(entry.get("name"), f"{at}.name"), role, url, events))
    names = [x.name for x in members]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise rd.fail(path, f"pod names must be unique, repeated: {', '.join(dup)}")
    return tuple(members)
