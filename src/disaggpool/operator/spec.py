"""The typed `DisaggPool` spec: parse and validate the ``spec`` of a custom resource.

The CRD's OpenAPI schema (manifests/crd.yaml) rejects what Kubernetes 1.20 can express (types,
ranges, enums, required fields) with HTTP 422 before the operator sees anything. Everything else
-- cross-field rules, names that must fit into derived object names, policies and predictors the
router knows, flags the operator owns -- is checked here. `parse_spec` never raises on bad user
input: it returns every problem as a `SpecIssue` naming the field (``decode.minReplicas``), so the
operator can put them into a condition and an event instead of crash-looping. Fields are read with
`formats.fields.FieldReader`, collecting problems (`CollectProblems`) in Kubernetes wording.

Defaults live here, not in the CRD, so there is one place that states them (docs/operator.md lists
them) and the kmock tests (no server-side defaulting) see the same behaviour as a real cluster.
Field names follow the CR (camelCase); attributes are snake_case.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from disaggpool.core.autoscaling import MAX_HEADROOM
from disaggpool.core.contracts import SLOClass
from disaggpool.core.demand import BURST_WINDOW_DEFAULT_S, BURST_WINDOW_MIN_S
from disaggpool.core.lease import LeaseTimings
from disaggpool.core.policies.registry import (
    CALIBRATED_FAMILY,
    DECODE_BINDINGS,
    DEFAULT_DECODE_BINDING,
    NEEDS_PREFIX_INDEX,
    ROUTER_POLICIES,
    default_options,
)
from disaggpool.core.predictor import make_predictor
from disaggpool.errors import InputError
from disaggpool.formats.fields import (
    KUBERNETES,
    CollectProblems,
    FieldReader,
    Section,
    nats_url_problem,
)

__all__ = [
    "MANAGED_VLLM_FLAGS",
    "POD_SECURITY_LEVELS",
    "ROUTER_MODES",
    "ROUTER_POLICIES",
    "AuthSpec",
    "AutoscalingSpec",
    "CalibrationSpec",
    "EngineSpec",
    "KVTransferSpec",
    "ModelSpec",
    "NetworkPolicySpec",
    "PoolSpec",
    "RoleSpec",
    "RouterSpec",
    "SLOClassSpec",
    "SecretKeyRef",
    "SharedBooksSpec",
    "SpecIssue",
    "VariantSpec",
    "check_pool_name",
    "parse_spec",
]

# Flags the operator sets itself; a user's extraArgs repeating them would silently break P/D.
MANAGED_VLLM_FLAGS = (
    "--port",
    "--kv-transfer-config",
    "--kv-events-config",
    "--scheduling-policy",
    "--tensor-parallel-size",
    "--served-model-name",
)
# Derived names: "<pool>-decode-<variant>" is a Service/Deployment name and a label value
# (<= 63 characters); pod names add ~17 characters of hashes to it.
MAX_POOL_NAME = 30
MAX_VARIANT_NAME = 12
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E|m)?$")
#: `engine.podSecurity`: the Pod Security Standard the vLLM pods are rendered to pass.
POD_SECURITY_LEVELS = ("baseline", "restricted")
#: `router.mode`: the router as the pool's front door (clients call it), or as the endpoint picker
#: of a Gateway API Inference Extension gateway (docs/gateway-kubernetes.md).
ROUTER_MODES = ("frontdoor", "gateway")
_RESOURCE_NAME = re.compile(r"^([a-z0-9.-]+/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_SECRET_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")


@dataclasses.dataclass(frozen=True, slots=True)
class SpecIssue:
    """One problem with a spec: the CR field path and what is wrong with it."""

    field: str
    message: str

    def __str__(self) -> str:
        return f"spec.{self.field}: {self.message}"


@dataclasses.dataclass(frozen=True, slots=True)
class SecretKeyRef:
    """One key of a Secret in the pool's namespace."""

    name: str
    key: str


@dataclasses.dataclass(frozen=True, slots=True)
class SharedBooksSpec:
    """`router.sharedBooks`: the router replicas share their books over a NATS server the user
    runs (docs/shared-books.md); the operator takes its URL and credentials, it runs no bus."""

    nats_url: str
    token: SecretKeyRef | None = None
    credentials: SecretKeyRef | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    served_model_name: str
    max_model_len: int | None = None
    pvc_claim: str | None = None
    pvc_sub_path: str = ""
    mount_path: str = "/models"
    hub_token_secret: str | None = None
    hub_token_key: str = "token"

    @property
    def model_arg(self) -> str:
        """What `vllm serve` loads: a path inside the mounted PVC, else the hub id / path."""
        if self.pvc_claim:
            return f"{self.mount_path.rstrip('/')}/{self.pvc_sub_path}".rstrip("/")
        return self.name


@dataclasses.dataclass(frozen=True, slots=True)
class EngineSpec:
    image: str
    image_pull_policy: str = "IfNotPresent"
    extra_args: tuple[str, ...] = ()
    env: tuple[Mapping[str, Any], ...] = ()
    resources: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    shared_memory: str = "16Gi"
    startup_timeout_s: int = 1800
    port: int = 8000
    pod_security: str = "baseline"  # POD_SECURITY_LEVELS


@dataclasses.dataclass(frozen=True, slots=True)
class KVTransferSpec:
    connector: str = "NixlConnector"
    backends: tuple[str, ...] = ("UCX",)
    side_channel_port: int = 5600
    load_failure_policy: str = "fail"


@dataclasses.dataclass(frozen=True, slots=True)
class VariantSpec:
    """One Deployment of a role: a group of identical pods (a GPU type, a node pool)."""

    name: str  # "" for a role without variants
    replicas: int
    gpus: int
    gpu_resource: str
    gpu_type: str
    node_selector: Mapping[str, str]
    tolerations: tuple[Mapping[str, Any], ...]
    affinity: Mapping[str, Any]
    extra_args: tuple[str, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class RoleSpec:
    role: str  # "prefill" | "decode"
    variants: tuple[VariantSpec, ...]
    min_replicas: int | None = None
    max_replicas: int | None = None

    @property
    def replicas(self) -> int:
        return sum(v.replicas for v in self.variants)


# A CR's SLO class is the router's SLO class: one type, so nothing converts between them.
SLOClassSpec = SLOClass


DEFAULT_SLO_CLASSES = (SLOClassSpec("interactive", 1.0, 0.05),)


@dataclasses.dataclass(frozen=True, slots=True)
class RouterSpec:
    image: str
    policy: str = "calibrated"
    replicas: int = 1
    slo_classes: tuple[SLOClassSpec, ...] = DEFAULT_SLO_CLASSES
    default_slo_class: str = "interactive"
    predictor: str = "online"
    scrape_interval_s: float = 1.0
    max_inflight: int = 512
    decode_binding: str = DEFAULT_DECODE_BINDING
    pd_decider: bool = False
    local_prefill_below: int = 0
    prefix_index: bool = False
    kv_events: bool = False
    priority_scheduling: bool = False
    resources: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # `router.grpc.tokenSecret`: gRPC listens on every address, each call carrying this token;
    # without it gRPC listens on the pod's loopback only and the Service has no gRPC port.
    grpc_token: SecretKeyRef | None = None
    # `router.grpc.allowUnauthenticated`: no token (gateways that cannot send one on ext_proc);
    # only with `networkPolicy.enabled`, which then keeps all but its clients off the ports.
    grpc_open: bool = False
    mode: str = "frontdoor"  # ROUTER_MODES
    shared_books: SharedBooksSpec | None = None
    # `router.leaderElection`: the active/passive replicas' Lease timings; None: the sidecar's.
    lease_timings: LeaseTimings | None = None

    @property
    def grpc_exposed(self) -> bool:
        """Whether gRPC listens beyond the pod's loopback (and the Service exposes it)."""
        return self.grpc_token is not None or self.grpc_open

    @property
    def gateway(self) -> bool:
        """Gateway mode: an InferencePool, the router's ext_proc port, a pd-proxy per decode pod."""
        return self.mode == "gateway"

    @property
    def active_passive(self) -> bool:
        """Gateway mode with several replicas and no shared books: one picker is enough, so the
        replicas elect a leader on a Lease and the others stand by (sidecar.leader). With
        `sharedBooks` every replica routes (active/active); one replica needs no election."""
        return self.gateway and self.replicas > 1 and self.shared_books is None


#: `calibration.maxAttempts` unset: probes of one pod in a row before it is given up on (the demo
#: and bench/engine_fidelity.py probe a poor fit again as many times).
DEFAULT_MAX_PROBE_ATTEMPTS = 3


@dataclasses.dataclass(frozen=True, slots=True)
class CalibrationSpec:
    image: str
    enabled: bool = True
    budget_s: float = 60.0
    max_age_s: int = 7 * 24 * 3600  # 0: a profile never goes stale
    reprobe_on_poor: bool = True
    max_attempts: int = DEFAULT_MAX_PROBE_ATTEMPTS
    max_prediction_error: float = 0.0  # 0: do not re-probe on drift
    backoff_limit: int = 1


@dataclasses.dataclass(frozen=True, slots=True)
class AutoscalingSpec:
    """Autoscaling (docs/operator.md, "Autoscaling"): the router computes the decode replicas
    the traffic needs (`core.autoscaling`), and the prefill replicas when prefill.maxReplicas is
    set (`core.prefill_scaling`), and writes them on the pool; the operator applies each within
    that role's min/maxReplicas. `startup_s`: a new pod's cold start (engine load and
    calibration), how far ahead the autoscalers look. `burst_window_s`: the traffic the router's
    burstiness is measured over; no scale-down before it has seen that much. `min_headroom`: the
    floor both keep over the offered load (pods >= (1 + min_headroom) x busy)."""

    enabled: bool = False
    target_goodput: float = 0.9
    stabilization_window_s: int = 300
    startup_s: int = 120
    burst_window_s: int = BURST_WINDOW_DEFAULT_S
    min_headroom: float = 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class AuthSpec:
    """`auth.apiKeySecret`: the one API key of the pool. vLLM pods require it (VLLM_API_KEY), the
    router requires it of its clients and sends it to the pods, the probe sends it."""

    api_key: SecretKeyRef | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class NetworkPolicySpec:
    """`networkPolicy`: only the pool's router, its probes and its other engines reach an engine
    pod; only `clients` (core/v1 NetworkPolicyPeers; none: any pod of the pool's namespace) reach
    the router."""

    enabled: bool = False
    clients: tuple[Mapping[str, Any], ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class PoolSpec:
    model: ModelSpec
    engine: EngineSpec
    kv_transfer: KVTransferSpec
    prefill: RoleSpec
    decode: RoleSpec
    router: RouterSpec
    calibration: CalibrationSpec
    autoscaling: AutoscalingSpec
    auth: AuthSpec = AuthSpec()
    network_policy: NetworkPolicySpec = NetworkPolicySpec()

    def role(self, name: str) -> RoleSpec:
        return self.prefill if name == "prefill" else self.decode


def _check_extra_args(sec: Section, key: str, args: tuple[str, ...]) -> None:
    for arg in args:
        flag = arg.split("=", 1)[0]
        if flag in MANAGED_VLLM_FLAGS:
            sec.problem(key, f"{flag} is set by the operator; remove it from extraArgs")


def _secret_ref(parent: Section, key: str, default_key: str) -> SecretKeyRef | None:
    """``{name, key}`` of a Secret, or None when the field is absent."""
    if key not in parent:
        return None
    sec = parent.section(key)
    name = sec.string("name")
    if not _DNS_SUBDOMAIN.match(name):
        sec.problem("name", f"a Secret name is required (a DNS subdomain), got {name!r}")
    ref_key = sec.string("key", default_key)
    if not _SECRET_KEY.match(ref_key):
        sec.problem("key", f"not a Secret key: {ref_key!r}")
    return SecretKeyRef(name, ref_key)


def _shared_books(router: Section) -> SharedBooksSpec | None:
    """``router.sharedBooks``: a NATS URL and the Secret that authenticates to it (every port
    authenticated: a server beyond the pod always needs one, and the pod runs none itself)."""
    if "sharedBooks" not in router:
        return None
    sec = router.section("sharedBooks")
    url = sec.string("natsUrl")
    problem = nats_url_problem(url)
    if problem is not None:
        sec.problem("natsUrl", problem)
    token = _secret_ref(sec, "tokenSecret", "token")
    credentials = _secret_ref(sec, "credentialsSecret", "nats.creds")
    if (token is None) == (credentials is None):
        sec.problem("tokenSecret", "set tokenSecret or credentialsSecret (one of them)")
    return SharedBooksSpec(url, token, credentials)


#: `router.leaderElection`'s fields, by the sidecar's `leader_election` keys they set.
_LEASE_FIELDS = {
    "lease_duration_s": "leaseDurationSeconds",
    "renew_deadline_s": "renewDeadlineSeconds",
    "retry_period_s": "retryPeriodSeconds",
}


def _lease_timings(router: Section) -> LeaseTimings | None:
    """``router.leaderElection``: the active/passive replicas' Lease timings, each defaulting to
    the sidecar's, checked by the same rules (`LeaseTimings.problems`) under their CRD names."""
    if "leaderElection" not in router:
        return None
    sec = router.section("leaderElection")
    default = LeaseTimings()
    timings = LeaseTimings(
        # A Lease's leaseDurationSeconds is a whole number of seconds.
        lease_duration_s=sec.integer("leaseDurationSeconds", int(default.lease_duration_s)),
        renew_deadline_s=sec.number(
            "renewDeadlineSeconds", default.renew_deadline_s, positive=True
        ),
        retry_period_s=sec.number("retryPeriodSeconds", default.retry_period_s, positive=True),
    )
    for key, why in timings.problems():
        for snake, camel in _LEASE_FIELDS.items():
            why = why.replace(snake, camel)
        sec.problem(_LEASE_FIELDS[key], f"{why}, got {getattr(timings, key):g}")
    return timings


_PEER_KEYS = {"podSelector", "namespaceSelector", "ipBlock"}


def _network_policy(spec: Section) -> NetworkPolicySpec:
    sec = spec.section("networkPolicy")
    clients = sec.mappings("clients")
    for i, peer in enumerate(clients):
        keys = set(peer)
        if not keys or not keys <= _PEER_KEYS:
            sec.problem(
                f"clients[{i}]",
                "a NetworkPolicyPeer: podSelector, namespaceSelector and/or ipBlock",
            )
        elif "ipBlock" in keys and keys != {"ipBlock"}:
            sec.problem(f"clients[{i}]", "ipBlock cannot be combined with a selector")
    return NetworkPolicySpec(enabled=sec.boolean("enabled", False), clients=clients)


def _role(doc: Section, role: str) -> RoleSpec:
    sec = doc.section(role)
    base = VariantSpec(
        name="",
        replicas=sec.integer("replicas", 1, minimum=0),
        gpus=sec.integer("gpus", 1, minimum=0),  # 0: a CPU engine
        gpu_resource=sec.string("gpuResource", "nvidia.com/gpu"),
        gpu_type=sec.string("gpuType"),
        node_selector=sec.string_map("nodeSelector"),
        tolerations=sec.mappings("tolerations"),
        affinity=sec.section("affinity").data,
        extra_args=sec.strings("extraArgs"),
    )
    if not _RESOURCE_NAME.match(base.gpu_resource):
        sec.problem("gpuResource", f"not a resource name: {base.gpu_resource!r}")
    _check_extra_args(sec, "extraArgs", base.extra_args)
    variants: list[VariantSpec] = []
    seen: set[str] = set()
    for v in sec.sections("variants"):
        name = v.string("name")
        if not _DNS_LABEL.match(name) or len(name) > MAX_VARIANT_NAME:
            v.problem("name", f"must be a DNS label of at most {MAX_VARIANT_NAME} characters")
        elif name in seen:
            v.problem("name", f"duplicate variant {name!r}")
        seen.add(name)
        variant = VariantSpec(
            name=name,
            replicas=v.integer("replicas", 1, minimum=0),
            gpus=v.integer("gpus", base.gpus, minimum=0),
            gpu_resource=v.string("gpuResource", base.gpu_resource),
            gpu_type=v.string("gpuType", base.gpu_type),
            node_selector=v.string_map("nodeSelector") or base.node_selector,
            tolerations=v.mappings("tolerations") or base.tolerations,
            affinity=v.section("affinity").data or base.affinity,
            extra_args=base.extra_args + v.strings("extraArgs"),
        )
        _check_extra_args(v, "extraArgs", variant.extra_args[len(base.extra_args) :])
        variants.append(variant)
    if variants and "replicas" in sec:
        sec.problem("replicas", "give replicas per variant when variants are listed")
    spec = RoleSpec(role=role, variants=tuple(variants) or (base,))
    # Decode always has bounds (its replicas when not given); prefill has them only when
    # `maxReplicas` is given, which is what makes prefill autoscaled (backward compatible:
    # a pool without them keeps prefill.replicas exactly). `parse_spec` checks the rest.
    if role == "decode" or "maxReplicas" in sec:
        lo = sec.integer("minReplicas", spec.replicas, minimum=0)
        hi = sec.integer("maxReplicas", max(spec.replicas, lo), minimum=0)
        if lo > hi:
            sec.problem("minReplicas", f"minReplicas {lo} > maxReplicas {hi}")
        elif not lo <= spec.replicas <= hi:
            sec.problem(
                "replicas", f"{spec.replicas} is outside [minReplicas {lo}, maxReplicas {hi}]"
            )
        spec = dataclasses.replace(spec, min_replicas=lo, max_replicas=hi)
    elif "minReplicas" in sec:
        sec.problem("minReplicas", "prefill is autoscaled only with maxReplicas: give both")
    return spec


def _slo_classes(router: Section) -> tuple[SLOClassSpec, ...]:
    """``router.sloClasses``; not `formats.fields.read_slo_classes`: the CR's list is optional,
    its keys are camelCase and its default class is named by ``router.defaultSloClass``."""
    items = router.sections("sloClasses")
    if not items:
        return DEFAULT_SLO_CLASSES
    out: list[SLOClassSpec] = []
    for c in items:
        name = c.string("name")
        if not name:
            c.problem("name", "required")
        elif name in {o.name for o in out}:
            c.problem("name", f"duplicate SLO class {name!r}")
        for key in ("ttftSeconds", "tpotSeconds"):
            if key not in c:
                c.problem(key, "required")
        out.append(
            SLOClassSpec(
                name,
                c.number("ttftSeconds", 1.0, positive=True),
                c.number("tpotSeconds", 0.05, positive=True),
                c.boolean("sheddable", False),
            )
        )
    return tuple(out)


def parse_spec(
    data: Any, default_image: str, default_mode: str = "frontdoor"
) -> tuple[PoolSpec | None, list[SpecIssue]]:
    """Validate a CR ``spec``; returns (spec, []) or (None, issues). Never raises on user input.

    `default_image` is the operator's own image: the router and the probe run it unless the spec
    names another one. `default_mode`: the `router.mode` of a pool that names none (the operator's
    DISAGGPOOL_ROUTER_MODE, the chart's `router.mode`).
    """
    if not isinstance(data, Mapping):
        return None, [SpecIssue("<root>", "spec must be an object")]
    problems = CollectProblems()
    spec = FieldReader("spec", problems, KUBERNETES).section(data, "")

    m = spec.section("model")
    source = m.section("source")
    pvc = source.section("pvc")
    secret = source.section("hubTokenSecret")
    model_name = m.string("name")
    if not model_name:
        m.problem("name", "required (a hub id such as meta-llama/Llama-3.1-8B, or a path)")
    max_len: int | None = None
    if m.data.get("maxModelLen") is not None:
        max_len = m.integer("maxModelLen", 0, minimum=1) or None
    model = ModelSpec(
        name=model_name,
        served_model_name=m.string("servedModelName") or model_name,
        max_model_len=max_len,
        pvc_claim=pvc.string("claimName") or None,
        pvc_sub_path=pvc.string("subPath"),
        mount_path=pvc.string("mountPath", "/models"),
        hub_token_secret=secret.string("name") or None,
        hub_token_key=secret.string("key", "token"),
    )
    if pvc and not model.pvc_claim:
        pvc.problem("claimName", "required when model.source.pvc is given")
    if secret and not model.hub_token_secret:
        secret.problem("name", "required when hubTokenSecret is given")

    e = spec.section("engine")
    engine = EngineSpec(
        image=e.string("image"),
        image_pull_policy=e.string("imagePullPolicy", "IfNotPresent"),
        extra_args=e.strings("extraArgs"),
        env=e.mappings("env"),
        resources=e.section("resources").data,
        shared_memory=e.string("sharedMemory", "16Gi"),
        startup_timeout_s=e.integer("startupTimeoutSeconds", 1800, minimum=60),
        port=8000,
        pod_security=e.string("podSecurity", "baseline"),
    )
    if engine.pod_security not in POD_SECURITY_LEVELS:
        e.problem("podSecurity", f"must be baseline or restricted, got {engine.pod_security!r}")
    if not engine.image:
        e.problem("image", "required (a vLLM image with NIXL, e.g. vllm/vllm-openai:v0.32.0)")
    if engine.image_pull_policy not in ("Always", "IfNotPresent", "Never"):
        e.problem("imagePullPolicy", "must be Always, IfNotPresent or Never")
    if not _QUANTITY.match(engine.shared_memory):
        e.problem("sharedMemory", f"not a quantity: {engine.shared_memory!r}")
    _check_extra_args(e, "extraArgs", engine.extra_args)

    kv = spec.section("kvTransfer")
    kv_spec = KVTransferSpec(
        connector=kv.string("connector", "NixlConnector"),
        backends=kv.strings("backends") or ("UCX",),
        side_channel_port=kv.integer("sideChannelPort", 5600, minimum=1),
        load_failure_policy=kv.string("loadFailurePolicy", "fail"),
    )
    if kv_spec.side_channel_port in (engine.port,) or kv_spec.side_channel_port > 65535:
        kv.problem("sideChannelPort", "must be a free port (not 8000) below 65536")
    if kv_spec.load_failure_policy not in ("fail", "recompute"):
        kv.problem("loadFailurePolicy", "must be fail or recompute")

    prefill = _role(spec, "prefill")
    decode = _role(spec, "decode")

    rt = spec.section("router")
    slo = _slo_classes(rt)
    policy = rt.string("policy", "calibrated")
    router = RouterSpec(
        image=rt.string("image") or default_image,
        policy=policy,
        replicas=rt.integer("replicas", 1, minimum=0),
        slo_classes=slo,
        default_slo_class=rt.string("defaultSloClass", slo[0].name if slo else ""),
        predictor=rt.string("predictor", "online"),
        scrape_interval_s=rt.number("scrapeIntervalSeconds", 1.0, positive=True),
        max_inflight=rt.integer("maxInflight", 512, minimum=1),
        decode_binding=rt.string("decodeBinding", DEFAULT_DECODE_BINDING),
        pd_decider=rt.boolean("pdDecider", default_options(policy).pd_decider),
        local_prefill_below=rt.integer("localPrefillBelow", 0, minimum=0),
        prefix_index=rt.boolean("prefixIndex", False),
        kv_events=rt.boolean("kvEvents", False),
        priority_scheduling=rt.boolean("priorityScheduling", False),
        resources=rt.section("resources").data,
        grpc_token=_secret_ref(rt.section("grpc"), "tokenSecret", "token"),
        grpc_open=rt.section("grpc").boolean("allowUnauthenticated", False),
        mode=rt.string("mode", default_mode),
        shared_books=_shared_books(rt),
        lease_timings=_lease_timings(rt),
    )
    if router.lease_timings is not None and not (router.gateway and router.shared_books is None):
        # Only gateway-mode replicas without shared books elect a leader (`active_passive`); with
        # one replica the timings wait, unused, for `replicas` to grow.
        rt.problem(
            "leaderElection",
            "only gateway-mode replicas without sharedBooks elect a leader; remove it",
        )
    if router.mode not in ROUTER_MODES:
        rt.problem("mode", f"must be frontdoor or gateway, got {router.mode!r}")
    elif router.gateway and not router.grpc_exposed:
        # The ext_proc port must listen beyond loopback (the gateway is another pod) and takes the
        # gRPC port's auth: a token, or none behind the pool's NetworkPolicy.
        rt.problem(
            "grpc.tokenSecret",
            "required in gateway mode (or grpc.allowUnauthenticated with networkPolicy.enabled): "
            "the endpoint picker's ext_proc port (9002) listens beyond the pod's loopback and "
            "takes the gRPC port's token",
        )
    if router.decode_binding not in DECODE_BINDINGS:
        rt.problem("decodeBinding", f"must be arrival or late, got {router.decode_binding!r}")
    if router.pd_decider and router.policy not in CALIBRATED_FAMILY:
        rt.problem("pdDecider", f"needs a calibrated policy, not {router.policy!r}")
    if router.priority_scheduling and router.policy not in CALIBRATED_FAMILY:
        rt.problem("priorityScheduling", f"needs a calibrated policy, not {router.policy!r}")
    if router.kv_events and not router.prefix_index:
        rt.problem("kvEvents", "feeds the prefix index: needs prefixIndex: true")
    if router.policy in NEEDS_PREFIX_INDEX and not router.prefix_index:
        rt.problem("policy", f"{router.policy!r} routes by prefix cache: needs prefixIndex: true")
    if router.policy not in ROUTER_POLICIES:
        rt.problem(
            "policy", f"unknown policy {router.policy!r}; valid: {', '.join(ROUTER_POLICIES)}"
        )
    if router.default_slo_class not in {c.name for c in slo}:
        rt.problem("defaultSloClass", f"{router.default_slo_class!r} is not in router.sloClasses")
    try:
        make_predictor(router.predictor)
    except InputError as exc:
        rt.problem("predictor", exc.message)

    c = spec.section("calibration")
    calibration = CalibrationSpec(
        image=c.string("image") or default_image,
        enabled=c.boolean("enabled", True),
        budget_s=c.number("budgetSeconds", 60.0, positive=True),
        max_age_s=c.integer("maxAgeSeconds", 7 * 24 * 3600, minimum=0),
        reprobe_on_poor=c.boolean("reprobeOnPoor", True),
        max_attempts=c.integer("maxAttempts", DEFAULT_MAX_PROBE_ATTEMPTS, minimum=1),
        max_prediction_error=c.number("maxPredictionError", 0.0),
        backoff_limit=c.integer("backoffLimit", 1, minimum=0),
    )

    a = spec.section("autoscaling")
    autoscaling = AutoscalingSpec(
        enabled=a.boolean("enabled", False),
        target_goodput=a.number("targetGoodput", 0.9, positive=True),
        stabilization_window_s=a.integer("stabilizationWindowSeconds", 300, minimum=0),
        startup_s=a.integer("startupSeconds", 120, minimum=0),
        burst_window_s=a.integer(
            "burstWindowSeconds", BURST_WINDOW_DEFAULT_S, minimum=BURST_WINDOW_MIN_S
        ),
        min_headroom=a.number("minHeadroom", 0.0),
    )
    if not 0.5 <= autoscaling.target_goodput < 1:
        a.problem("targetGoodput", "a fraction of requests in [0.5, 1)")
    if autoscaling.min_headroom > MAX_HEADROOM:
        a.problem("minHeadroom", f"at most {MAX_HEADROOM:g}, got {autoscaling.min_headroom}")
    if autoscaling.enabled:
        for role in (decode, prefill):
            if role.max_replicas is None:  # prefill without bounds: not autoscaled
                continue
            if len(role.variants) > 1:
                a.problem("enabled", f"{role.role} autoscaling needs a single {role.role} variant")
            if role.max_replicas < 1:
                a.problem("enabled", f"{role.role} autoscaling needs {role.role}.maxReplicas >= 1")
    elif prefill.max_replicas is not None:
        spec.problem("prefill.maxReplicas", "prefill bounds need autoscaling.enabled")

    auth = AuthSpec(api_key=_secret_ref(spec.section("auth"), "apiKeySecret", "api-key"))
    network_policy = _network_policy(spec)
    if router.grpc_open and not network_policy.enabled:
        why = "without a token, the NetworkPolicy keeps all but its clients off gRPC and ext_proc"
        spec.problem("router.grpc.allowUnauthenticated", f"only with networkPolicy.enabled: {why}")

    if problems.problems:
        return None, [SpecIssue(p.field, p.message) for p in problems.problems]
    return (
        PoolSpec(
            model,
            engine,
            kv_spec,
            prefill,
            decode,
            router,
            calibration,
            autoscaling,
            auth,
            network_policy,
        ),
        [],
    )


def check_pool_name(name: str) -> list[SpecIssue]:
    """The pool's own name must leave room for the names derived from it."""
    if len(name) > MAX_POOL_NAME:
        return [
            SpecIssue(
                "<metadata.name>",
                f"pool names are limited to {MAX_POOL_NAME} characters (derived Service and "
                f"label names must fit in 63); {name!r} has {len(name)}",
            )
        ]
    return []
