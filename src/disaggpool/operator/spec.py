"""The typed `DisaggPool` spec: parse and validate the ``spec`` of a custom resource.

The CRD's OpenAPI schema (manifests/crd.yaml) rejects what Kubernetes 1.20 can express (types,
ranges, enums, required fields) with HTTP 422 before the operator sees anything. Everything else
-- cross-field rules, names that must fit into derived object names, policies and predictors the
router knows, flags the operator owns -- is checked here. `parse_spec` never raises on bad user
input: it returns every problem as a `SpecIssue` naming the field (``decode.minReplicas``), so the
operator can put them into a condition and an event instead of crash-looping.

Defaults live here, not in the CRD, so there is one place that states them (docs/operator.md lists
them) and the kmock tests (no server-side defaulting) see the same behaviour as a real cluster.
Field names follow the CR (camelCase); attributes are snake_case.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from disaggpool.core.policies.registry import POLICY_NAMES
from disaggpool.core.predictor import make_predictor
from disaggpool.errors import InputError

__all__ = [
    "MANAGED_VLLM_FLAGS",
    "ROUTER_POLICIES",
    "AutoscalingSpec",
    "CalibrationSpec",
    "EngineSpec",
    "KVTransferSpec",
    "ModelSpec",
    "PoolSpec",
    "RoleSpec",
    "RouterSpec",
    "SLOClassSpec",
    "SpecIssue",
    "VariantSpec",
    "parse_spec",
]

# The router cannot run `uncalibrated` (it needs datasheet profiles per pod, which a pool lacks).
ROUTER_POLICIES: tuple[str, ...] = tuple(p for p in POLICY_NAMES if p != "uncalibrated")
# Flags the operator sets itself; a user's extraArgs repeating them would silently break P/D.
MANAGED_VLLM_FLAGS = (
    "--port",
    "--kv-transfer-config",
    "--tensor-parallel-size",
    "--served-model-name",
)
# Derived names: "<pool>-decode-<variant>" is a Service/Deployment name and a label value
# (<= 63 characters); pod names add ~17 characters of hashes to it.
MAX_POOL_NAME = 30
MAX_VARIANT_NAME = 12
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E|m)?$")
_RESOURCE_NAME = re.compile(r"^([a-z0-9.-]+/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


@dataclasses.dataclass(frozen=True, slots=True)
class SpecIssue:
    """One problem with a spec: the CR field path and what is wrong with it."""

    field: str
    message: str

    def __str__(self) -> str:
        return f"spec.{self.field}: {self.message}"


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


@dataclasses.dataclass(frozen=True, slots=True)
class SLOClassSpec:
    name: str
    ttft_s: float
    tpot_s: float


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
    resources: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, slots=True)
class CalibrationSpec:
    image: str
    enabled: bool = True
    budget_s: float = 60.0
    max_age_s: int = 7 * 24 * 3600  # 0: a profile never goes stale
    reprobe_on_poor: bool = True
    max_attempts: int = 3
    max_prediction_error: float = 0.0  # 0: do not re-probe on drift
    backoff_limit: int = 1


@dataclasses.dataclass(frozen=True, slots=True)
class AutoscalingSpec:
    """Read by the decode autoscaler (a later issue); the bounds are decode.min/maxReplicas."""

    enabled: bool = False
    target_goodput: float = 0.9
    stabilization_window_s: int = 300


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

    def role(self, name: str) -> RoleSpec:
        return self.prefill if name == "prefill" else self.decode


class _Reader:
    """Typed getters over a mapping that record issues instead of raising."""

    def __init__(self, issues: list[SpecIssue]) -> None:
        self.issues = issues

    def bad(self, field: str, message: str) -> None:
        self.issues.append(SpecIssue(field, message))

    def section(self, data: Mapping[str, Any], key: str, prefix: str) -> Mapping[str, Any]:
        value = data.get(key)
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            self.bad(prefix + key, "must be an object")
            return {}
        return value

    def string(self, data: Mapping[str, Any], key: str, prefix: str, default: str) -> str:
        value = data.get(key, default)
        if not isinstance(value, str):
            self.bad(prefix + key, f"must be a string, got {value!r}")
            return default
        return value

    def integer(
        self, data: Mapping[str, Any], key: str, prefix: str, default: int, minimum: int = 0
    ) -> int:
        value = data.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            self.bad(prefix + key, f"must be an integer, got {value!r}")
            return default
        if value < minimum:
            self.bad(prefix + key, f"must be >= {minimum}, got {value}")
            return default
        return value

    def number(
        self, data: Mapping[str, Any], key: str, prefix: str, default: float, *, positive: bool
    ) -> float:
        value = data.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            self.bad(prefix + key, f"must be a number, got {value!r}")
            return default
        if value < 0 or (positive and value == 0):
            self.bad(prefix + key, f"must be {'> 0' if positive else '>= 0'}, got {value}")
            return default
        return float(value)

    def boolean(self, data: Mapping[str, Any], key: str, prefix: str, default: bool) -> bool:
        value = data.get(key, default)
        if not isinstance(value, bool):
            self.bad(prefix + key, f"must be true or false, got {value!r}")
            return default
        return value

    def strings(self, data: Mapping[str, Any], key: str, prefix: str) -> tuple[str, ...]:
        value = data.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            self.bad(prefix + key, "must be a list of strings")
            return ()
        return tuple(value)

    def objects(
        self, data: Mapping[str, Any], key: str, prefix: str
    ) -> tuple[Mapping[str, Any], ...]:
        value = data.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, Mapping) for v in value):
            self.bad(prefix + key, "must be a list of objects")
            return ()
        return tuple(value)

    def string_map(self, data: Mapping[str, Any], key: str, prefix: str) -> Mapping[str, str]:
        value = data.get(key, {})
        if not isinstance(value, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()
        ):
            self.bad(prefix + key, "must be a map of strings")
            return {}
        return dict(value)


def _check_extra_args(r: _Reader, args: tuple[str, ...], field: str) -> None:
    for arg in args:
        flag = arg.split("=", 1)[0]
        if flag in MANAGED_VLLM_FLAGS:
            r.bad(field, f"{flag} is set by the operator; remove it from extraArgs")


def _role(r: _Reader, data: Mapping[str, Any], role: str) -> RoleSpec:
    p = f"{role}."
    sec = r.section(data, role, "")
    base = VariantSpec(
        name="",
        replicas=r.integer(sec, "replicas", p, 1),
        gpus=r.integer(sec, "gpus", p, 1, minimum=1),
        gpu_resource=r.string(sec, "gpuResource", p, "nvidia.com/gpu"),
        gpu_type=r.string(sec, "gpuType", p, ""),
        node_selector=r.string_map(sec, "nodeSelector", p),
        tolerations=r.objects(sec, "tolerations", p),
        affinity=r.section(sec, "affinity", p),
        extra_args=r.strings(sec, "extraArgs", p),
    )
    if not _RESOURCE_NAME.match(base.gpu_resource):
        r.bad(p + "gpuResource", f"not a resource name: {base.gpu_resource!r}")
    _check_extra_args(r, base.extra_args, p + "extraArgs")
    variants: list[VariantSpec] = []
    seen: set[str] = set()
    for i, raw in enumerate(r.objects(sec, "variants", p)):
        vp = f"{p}variants[{i}]."
        name = r.string(raw, "name", vp, "")
        if not _DNS_LABEL.match(name) or len(name) > MAX_VARIANT_NAME:
            r.bad(vp + "name", f"must be a DNS label of at most {MAX_VARIANT_NAME} characters")
        elif name in seen:
            r.bad(vp + "name", f"duplicate variant {name!r}")
        seen.add(name)
        variant = VariantSpec(
            name=name,
            replicas=r.integer(raw, "replicas", vp, 1),
            gpus=r.integer(raw, "gpus", vp, base.gpus, minimum=1),
            gpu_resource=r.string(raw, "gpuResource", vp, base.gpu_resource),
            gpu_type=r.string(raw, "gpuType", vp, base.gpu_type),
            node_selector=r.string_map(raw, "nodeSelector", vp) or base.node_selector,
            tolerations=r.objects(raw, "tolerations", vp) or base.tolerations,
            affinity=r.section(raw, "affinity", vp) or base.affinity,
            extra_args=base.extra_args + r.strings(raw, "extraArgs", vp),
        )
        _check_extra_args(r, r.strings(raw, "extraArgs", vp), vp + "extraArgs")
        variants.append(variant)
    if variants and "replicas" in sec:
        r.bad(p + "replicas", "give replicas per variant when variants are listed")
    spec = RoleSpec(role=role, variants=tuple(variants) or (base,))
    if role == "decode":
        lo = r.integer(sec, "minReplicas", p, spec.replicas)
        hi = r.integer(sec, "maxReplicas", p, max(spec.replicas, lo))
        if lo > hi:
            r.bad(p + "minReplicas", f"minReplicas {lo} > maxReplicas {hi}")
        elif not lo <= spec.replicas <= hi:
            r.bad(
                p + "replicas", f"{spec.replicas} is outside [minReplicas {lo}, maxReplicas {hi}]"
            )
        spec = dataclasses.replace(spec, min_replicas=lo, max_replicas=hi)
    elif "minReplicas" in sec or "maxReplicas" in sec:
        r.bad(p + "minReplicas", "only decode is autoscaled; prefill takes replicas")
    return spec


def _slo_classes(r: _Reader, sec: Mapping[str, Any]) -> tuple[SLOClassSpec, ...]:
    raw = r.objects(sec, "sloClasses", "router.")
    if not raw:
        return DEFAULT_SLO_CLASSES
    out: list[SLOClassSpec] = []
    for i, c in enumerate(raw):
        cp = f"router.sloClasses[{i}]."
        name = r.string(c, "name", cp, "")
        if not name:
            r.bad(cp + "name", "required")
        elif name in {o.name for o in out}:
            r.bad(cp + "name", f"duplicate SLO class {name!r}")
        for key in ("ttftSeconds", "tpotSeconds"):
            if key not in c:
                r.bad(cp + key, "required")
        out.append(
            SLOClassSpec(
                name,
                r.number(c, "ttftSeconds", cp, 1.0, positive=True),
                r.number(c, "tpotSeconds", cp, 0.05, positive=True),
            )
        )
    return tuple(out)


def parse_spec(data: Any, default_image: str) -> tuple[PoolSpec | None, list[SpecIssue]]:
    """Validate a CR ``spec``; returns (spec, []) or (None, issues). Never raises on user input.

    `default_image` is the operator's own image: the router and the probe run it unless the spec
    names another one.
    """
    issues: list[SpecIssue] = []
    r = _Reader(issues)
    if not isinstance(data, Mapping):
        return None, [SpecIssue("<root>", "spec must be an object")]

    m = r.section(data, "model", "")
    source = r.section(m, "source", "model.")
    pvc = r.section(source, "pvc", "model.source.")
    secret = r.section(source, "hubTokenSecret", "model.source.")
    model_name = r.string(m, "name", "model.", "")
    if not model_name:
        r.bad("model.name", "required (a hub id such as meta-llama/Llama-3.1-8B, or a path)")
    max_len = m.get("maxModelLen")
    if max_len is not None:
        max_len = r.integer(m, "maxModelLen", "model.", 0, minimum=1) or None
    model = ModelSpec(
        name=model_name,
        served_model_name=r.string(m, "servedModelName", "model.", "") or model_name,
        max_model_len=max_len,
        pvc_claim=r.string(pvc, "claimName", "model.source.pvc.", "") or None,
        pvc_sub_path=r.string(pvc, "subPath", "model.source.pvc.", ""),
        mount_path=r.string(pvc, "mountPath", "model.source.pvc.", "/models"),
        hub_token_secret=r.string(secret, "name", "model.source.hubTokenSecret.", "") or None,
        hub_token_key=r.string(secret, "key", "model.source.hubTokenSecret.", "token"),
    )
    if pvc and not model.pvc_claim:
        r.bad("model.source.pvc.claimName", "required when model.source.pvc is given")
    if secret and not model.hub_token_secret:
        r.bad("model.source.hubTokenSecret.name", "required when hubTokenSecret is given")

    e = r.section(data, "engine", "")
    engine = EngineSpec(
        image=r.string(e, "image", "engine.", ""),
        image_pull_policy=r.string(e, "imagePullPolicy", "engine.", "IfNotPresent"),
        extra_args=r.strings(e, "extraArgs", "engine."),
        env=r.objects(e, "env", "engine."),
        resources=r.section(e, "resources", "engine."),
        shared_memory=r.string(e, "sharedMemory", "engine.", "16Gi"),
        startup_timeout_s=r.integer(e, "startupTimeoutSeconds", "engine.", 1800, minimum=60),
        port=8000,
    )
    if not engine.image:
        r.bad("engine.image", "required (a vLLM image with NIXL, e.g. vllm/vllm-openai:v0.11.0)")
    if engine.image_pull_policy not in ("Always", "IfNotPresent", "Never"):
        r.bad("engine.imagePullPolicy", "must be Always, IfNotPresent or Never")
    if not _QUANTITY.match(engine.shared_memory):
        r.bad("engine.sharedMemory", f"not a quantity: {engine.shared_memory!r}")
    _check_extra_args(r, engine.extra_args, "engine.extraArgs")

    kv = r.section(data, "kvTransfer", "")
    kv_spec = KVTransferSpec(
        connector=r.string(kv, "connector", "kvTransfer.", "NixlConnector"),
        backends=r.strings(kv, "backends", "kvTransfer.") or ("UCX",),
        side_channel_port=r.integer(kv, "sideChannelPort", "kvTransfer.", 5600, minimum=1),
        load_failure_policy=r.string(kv, "loadFailurePolicy", "kvTransfer.", "fail"),
    )
    if kv_spec.side_channel_port in (engine.port,) or kv_spec.side_channel_port > 65535:
        r.bad("kvTransfer.sideChannelPort", "must be a free port (not 8000) below 65536")
    if kv_spec.load_failure_policy not in ("fail", "recompute"):
        r.bad("kvTransfer.loadFailurePolicy", "must be fail or recompute")

    prefill = _role(r, data, "prefill")
    decode = _role(r, data, "decode")

    rt = r.section(data, "router", "")
    slo = _slo_classes(r, rt)
    router = RouterSpec(
        image=r.string(rt, "image", "router.", "") or default_image,
        policy=r.string(rt, "policy", "router.", "calibrated"),
        replicas=r.integer(rt, "replicas", "router.", 1),
        slo_classes=slo,
        default_slo_class=r.string(rt, "defaultSloClass", "router.", slo[0].name if slo else ""),
        predictor=r.string(rt, "predictor", "router.", "online"),
        scrape_interval_s=r.number(rt, "scrapeIntervalSeconds", "router.", 1.0, positive=True),
        max_inflight=r.integer(rt, "maxInflight", "router.", 512, minimum=1),
        resources=r.section(rt, "resources", "router."),
    )
    if router.policy not in ROUTER_POLICIES:
        r.bad(
            "router.policy",
            f"unknown policy {router.policy!r}; valid: {', '.join(ROUTER_POLICIES)}",
        )
    if router.default_slo_class not in {c.name for c in slo}:
        r.bad("router.defaultSloClass", f"{router.default_slo_class!r} is not in router.sloClasses")
    try:
        make_predictor(router.predictor)
    except InputError as exc:
        r.bad("router.predictor", exc.message)

    c = r.section(data, "calibration", "")
    calibration = CalibrationSpec(
        image=r.string(c, "image", "calibration.", "") or default_image,
        enabled=r.boolean(c, "enabled", "calibration.", True),
        budget_s=r.number(c, "budgetSeconds", "calibration.", 60.0, positive=True),
        max_age_s=r.integer(c, "maxAgeSeconds", "calibration.", 7 * 24 * 3600),
        reprobe_on_poor=r.boolean(c, "reprobeOnPoor", "calibration.", True),
        max_attempts=r.integer(c, "maxAttempts", "calibration.", 3, minimum=1),
        max_prediction_error=r.number(c, "maxPredictionError", "calibration.", 0.0, positive=False),
        backoff_limit=r.integer(c, "backoffLimit", "calibration.", 1),
    )

    a = r.section(data, "autoscaling", "")
    autoscaling = AutoscalingSpec(
        enabled=r.boolean(a, "enabled", "autoscaling.", False),
        target_goodput=r.number(a, "targetGoodput", "autoscaling.", 0.9, positive=True),
        stabilization_window_s=r.integer(a, "stabilizationWindowSeconds", "autoscaling.", 300),
    )
    if autoscaling.target_goodput > 1:
        r.bad("autoscaling.targetGoodput", "a fraction of requests: must be <= 1")

    if issues:
        return None, issues
    return (
        PoolSpec(model, engine, kv_spec, prefill, decode, router, calibration, autoscaling),
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
