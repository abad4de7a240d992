"""`disaggpool sim run --scenario FILE`: one user-described pool, trace, SLOs and policy set.

A scenario file is YAML (or JSON); SCENARIOS.md documents every field and `examples/` holds one.
Paths inside it are relative to the file. Any invalid field raises `InputError` naming the file
and the field path (``pool.decode[1].count``), which the CLI turns into exit code 2.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from disaggpool.core.autoscaling_baselines import AUTOSCALERS
from disaggpool.core.contracts import SLOClass
from disaggpool.core.policies.registry import (
    CALIBRATED_FAMILY,
    DECODE_BINDINGS,
    DEFAULT_DECODE_BINDING,
    NEEDS_DATASHEET,
    NEEDS_PREFIX_INDEX,
    POLICY_NAMES,
    PolicyOptions,
)
from disaggpool.core.predictor import make_predictor
from disaggpool.core.profile import CalibrationProfile
from disaggpool.errors import InputError
from disaggpool.formats.embedded import EMBEDDED_TRACES, embedded_trace
from disaggpool.formats.fields import FieldReader, read_slo_classes
from disaggpool.formats.profiles import load_yaml, resolve_profile
from disaggpool.formats.traces import TraceRequest, read_trace
from disaggpool.sim import workload
from disaggpool.sim.cluster import InstanceSpec, RouterOptions
from disaggpool.sim.prefix_workload import PrefixShape, prefix_sessions
from disaggpool.sim.runner import RunSpec

__all__ = ["Scenario", "ScenarioAutoscaling", "load_scenario"]


@dataclasses.dataclass(frozen=True)
class ScenarioAutoscaling:
    """The `autoscaling:` section (`sim autoscale --scenario`): the decode bounds, a new pod's
    cold start, the scale-down window, our target, the autoscalers to compare, and the fewest
    prefill pods (None: the pool's prefill pods run throughout; else they scale down to it)."""

    min_decode: int
    max_decode: int
    startup_s: float = 120.0
    stabilization_s: float = 300.0
    target_goodput: float = 0.9
    autoscalers: tuple[str, ...] = AUTOSCALERS
    min_prefill: int | None = None


@dataclasses.dataclass(frozen=True)
class Scenario:
    instances: tuple[InstanceSpec, ...]
    trace: tuple[TraceRequest, ...]
    slo_classes: tuple[SLOClass, ...]  # the default class first
    policies: tuple[str, ...]
    seeds: tuple[int, ...]
    predictor: str
    datasheet: CalibrationProfile | None
    jitter: float
    name: str
    router: RouterOptions = dataclasses.field(default_factory=RouterOptions)
    options: PolicyOptions = dataclasses.field(default_factory=PolicyOptions)
    prefix_caching: bool = True
    autoscaling: ScenarioAutoscaling | None = None

    def _options(self, policy: str) -> PolicyOptions:
        """The file's switches as they apply to `policy` (`pd_decider` and `priority_scheduling`
        need a cost model: a policy without one sets no priorities, as if the engines ran FCFS)."""
        if policy in CALIBRATED_FAMILY:
            return self.options
        return dataclasses.replace(self.options, pd_decider=False, priority_scheduling=False)

    def specs(self) -> list[RunSpec]:
        return [
            RunSpec(
                experiment="run",
                trace_name=self.name,
                trace=self.trace,
                instances=self.instances,
                slo_classes=self.slo_classes,
                policy=policy,
                seed=seed,
                datasheet=self.datasheet,
                predictor=self.predictor,
                jitter=self.jitter,
                router=self.router,
                options=self._options(policy),
                prefix_caching=self.prefix_caching,
            )
            for seed in self.seeds
            for policy in self.policies
        ]


def load_scenario(path: str | Path) -> Scenario:
    path = Path(path)
    rd = FieldReader(str(path))
    try:
        text = path.read_text(encoding="utf-8")
        raw = json.loads(text) if path.suffix == ".json" else load_yaml(text)
    except OSError as exc:
        raise rd.fail("<file>", f"cannot read: {exc.strerror or exc}") from None
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise rd.fail("<file>", f"not valid YAML/JSON: {exc}") from None
    doc = rd.mapping(raw, "<root>")
    rd.known(
        doc,
        "",
        {
            "name",
            "pool",
            "datasheet",
            "trace",
            "slo_classes",
            "policies",
            "seeds",
            "predictor",
            "jitter",
            "router",
            "autoscaling",
        },
    )
    base = path.parent
    seeds = rd.nonempty_list(doc.get("seeds", [1]), "seeds", of="integers")
    seed_list = tuple(rd.integer(s, f"seeds[{i}]", minimum=0) for i, s in enumerate(seeds))
    instances, prefix_caching = _pool(rd, doc.get("pool"), base, seed_list[0])
    slo = read_slo_classes(rd, doc.get("slo_classes"))
    trace = _trace(rd, doc.get("trace"), base, {c.name for c in slo}, seed_list[0])
    policies = rd.nonempty_list(
        doc.get("policies", ["round_robin", "least_loaded", "length", "calibrated"]), "policies"
    )
    for i, p in enumerate(policies):
        if p not in POLICY_NAMES:
            raise rd.fail(
                f"policies[{i}]", f"unknown policy {p!r}; valid: {', '.join(POLICY_NAMES)}"
            )
    datasheet = None
    if "datasheet" in doc:
        datasheet = _profile(rd, doc["datasheet"], "datasheet", base)
    elif NEEDS_DATASHEET & set(policies):
        raise rd.fail(
            "datasheet", f"required by {', '.join(sorted(NEEDS_DATASHEET & set(policies)))}"
        )
    predictor = doc.get("predictor", "online")
    try:
        make_predictor(str(predictor))
    except InputError as exc:  # its source/field are "predictor"/the spec: keep the message
        raise rd.fail("predictor", f"{predictor!r}: {exc.message}") from None
    except (KeyError, ValueError) as exc:
        raise rd.fail("predictor", str(exc).strip("'\"")) from None
    router, options = _router(rd, doc.get("router", {}))
    needs_index = sorted(NEEDS_PREFIX_INDEX & set(policies))
    if needs_index and not router.prefix_index:
        raise rd.fail(
            "router.prefix_index", f"must be true for {', '.join(needs_index)} (prefix-cache rules)"
        )
    autoscaling = None
    if "autoscaling" in doc:
        n_decode = sum(1 for i in instances if i.role == "decode")
        n_prefill = len(instances) - n_decode
        autoscaling = _autoscaling(rd, doc["autoscaling"], n_decode, n_prefill)
    return Scenario(
        autoscaling=autoscaling,
        router=router,
        options=options,
        prefix_caching=prefix_caching,
        instances=instances,
        trace=tuple(trace),
        slo_classes=slo,
        policies=tuple(policies),
        seeds=seed_list,
        predictor=str(predictor),
        datasheet=datasheet,
        jitter=rd.number(doc.get("jitter", 0.03), "jitter"),
        name=str(doc.get("name", path.stem)),
    )


def _router(rd: FieldReader, raw: Any) -> tuple[RouterOptions, PolicyOptions]:
    """The `router:` block: what the router knows and the switches on its policies (the same
    switches as the sidecar's config; see SCENARIOS.md)."""
    r = rd.mapping(raw, "router")
    rd.known(
        r,
        "router",
        {
            "scrape_interval_s",
            "replicas",
            "decode_binding",
            "pd_decider",
            "local_prefill_below",
            "prefix_index",
            "priority_scheduling",
            "shared_books",
            "bus_delay_s",
        },
    )
    binding = r.get("decode_binding", DEFAULT_DECODE_BINDING)
    if binding not in DECODE_BINDINGS:
        raise rd.fail("router.decode_binding", f"must be arrival or late, got {binding!r}")
    below = r.get("local_prefill_below", 0)
    shared = rd.boolean(r.get("shared_books", False), "router.shared_books")
    delay = rd.number(r.get("bus_delay_s", 0.0), "router.bus_delay_s")
    if not math.isfinite(delay):
        raise rd.fail("router.bus_delay_s", f"must be finite, got {delay!r}")
    if delay and not shared:
        raise rd.fail("router.bus_delay_s", "needs router.shared_books: true")
    return (
        RouterOptions(
            scrape_interval_s=rd.number(
                r.get("scrape_interval_s", 0.0), "router.scrape_interval_s"
            ),
            replicas=rd.integer(r.get("replicas", 1), "router.replicas"),
            late_binding=binding == "late",
            prefix_index=rd.boolean(r.get("prefix_index", False), "router.prefix_index"),
            shared_books=shared,
            bus_delay_s=delay,
        ),
        PolicyOptions(
            pd_decider=rd.boolean(r.get("pd_decider", True), "router.pd_decider"),
            local_prefill_below=(
                rd.integer(below, "router.local_prefill_below", minimum=0) if below else 0
            ),
            priority_scheduling=rd.boolean(
                r.get("priority_scheduling", False), "router.priority_scheduling"
            ),
        ),
    )


def _autoscaling(rd: FieldReader, raw: Any, n_decode: int, n_prefill: int) -> ScenarioAutoscaling:
    a = rd.mapping(raw, "autoscaling")
    rd.known(
        a,
        "autoscaling",
        {"min_decode", "max_decode", "startup_s", "stabilization_s", "target_goodput",
         "autoscalers", "min_prefill"},
    )  # fmt: skip
    lo = rd.integer(a.get("min_decode", 1), "autoscaling.min_decode", minimum=1)
    if "max_decode" not in a:
        raise rd.fail("autoscaling.max_decode", "missing")
    hi = rd.integer(a["max_decode"], "autoscaling.max_decode", minimum=lo)
    if not lo <= n_decode <= hi:
        raise rd.fail(
            "autoscaling.max_decode",
            f"the pool's {n_decode} decode instances (the starting pool) must lie in "
            f"[min_decode {lo}, max_decode {hi}]",
        )
    target = rd.number(a.get("target_goodput", 0.9), "autoscaling.target_goodput", positive=True)
    if not 0.5 <= target < 1:
        raise rd.fail("autoscaling.target_goodput", f"must be in [0.5, 1), got {target}")
    names = rd.nonempty_list(a.get("autoscalers", list(AUTOSCALERS)), "autoscaling.autoscalers")
    for i, n in enumerate(names):
        if n not in AUTOSCALERS:
            raise rd.fail(
                f"autoscaling.autoscalers[{i}]",
                f"unknown autoscaler {n!r}; valid: {', '.join(AUTOSCALERS)}",
            )
    min_prefill = None
    if "min_prefill" in a:
        # The pool's prefill pods are the most: the autoscalers may only remove some.
        min_prefill = rd.integer(a["min_prefill"], "autoscaling.min_prefill", minimum=1)
        if min_prefill > n_prefill:
            raise rd.fail(
                "autoscaling.min_prefill",
                f"must be at most the pool's {n_prefill} prefill instances, got {min_prefill}",
            )
    return ScenarioAutoscaling(
        lo,
        hi,
        rd.number(a.get("startup_s", 120.0), "autoscaling.startup_s"),
        rd.number(a.get("stabilization_s", 300.0), "autoscaling.stabilization_s"),
        target,
        tuple(names),
        min_prefill,
    )


def _profile(rd: FieldReader, ref: Any, field: str, base: Path) -> CalibrationProfile:
    if not isinstance(ref, str):
        raise rd.fail(field, "must be a built-in profile name or a file path")
    try:
        return resolve_profile(ref, base)
    except InputError as exc:
        raise rd.fail(field, str(exc)) from None


def _pool(
    rd: FieldReader, raw: Any, base: Path, seed: int
) -> tuple[tuple[InstanceSpec, ...], bool]:
    """The instances, and whether their engines cache prompt blocks."""
    pool = rd.mapping(raw, "pool")
    rd.known(pool, "pool", {"prefill", "decode", "prefix_caching"})
    specs: list[InstanceSpec] = []
    for role in ("prefill", "decode"):
        groups = rd.nonempty_list(pool.get(role), f"pool.{role}", of="instance groups")
        index = 0
        for g, group_raw in enumerate(groups):
            at = f"pool.{role}[{g}]"
            group = rd.mapping(group_raw, at)
            rd.known(group, at, {"count", "profile", "believed", "speed", "name"})
            if "profile" not in group:
                raise rd.fail(f"{at}.profile", "missing")
            true = _profile(rd, group["profile"], f"{at}.profile", base)
            speed = rd.number(group.get("speed", 1.0), f"{at}.speed", positive=True)
            believed_ref = group.get("believed")
            believed = (
                None
                if believed_ref in (None, "none")
                else _profile(rd, believed_ref, f"{at}.believed", base)
            )
            count = rd.integer(group.get("count", 1), f"{at}.count")
            for _ in range(count):
                name = str(group["name"]) if "name" in group and count == 1 else f"{role}-{index}"
                index += 1
                instance_true = true.scaled(speed, name=name) if speed != 1.0 else true
                # Without an explicit believed profile the router is perfectly calibrated.
                specs.append(InstanceSpec(name, role, instance_true, believed or instance_true))
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise rd.fail("pool", "instance names must be unique")
    del seed
    return tuple(specs), rd.boolean(pool.get("prefix_caching", True), "pool.prefix_caching")


def _trace(
    rd: FieldReader, raw: Any, base: Path, classes: set[str], seed: int
) -> list[TraceRequest]:
    spec = rd.mapping(raw, "trace")
    rd.known(spec, "trace", {"file", "embedded", "generate", "rate", "limit", "default_class"})
    if sum(key in spec for key in ("file", "embedded", "generate")) != 1:
        raise rd.fail("trace", "give exactly one of file, embedded or generate")
    if "file" in spec:
        file = base / str(spec["file"])
        trace = read_trace(file, default_class=str(spec.get("default_class", "")))
    elif "embedded" in spec:
        name = str(spec["embedded"])
        if name not in EMBEDDED_TRACES:
            raise rd.fail(
                "trace.embedded", f"must be one of {', '.join(EMBEDDED_TRACES)}, got {name!r}"
            )
        trace = embedded_trace(name, default_class=str(spec.get("default_class", "")))
    else:
        trace = _generate(rd, rd.mapping(spec["generate"], "trace.generate"), seed)
    if "limit" in spec:
        trace = trace[: rd.integer(spec["limit"], "trace.limit")]
    if "rate" in spec:
        trace = workload.rescale(trace, rd.number(spec["rate"], "trace.rate", positive=True))
    for i, r in enumerate(trace):
        if r.slo_class and r.slo_class not in classes:
            raise rd.fail("trace", f"request {i} has SLO class {r.slo_class!r}, not in slo_classes")
    return trace


def _generate(rd: FieldReader, gen: Mapping[str, Any], seed: int) -> list[TraceRequest]:
    rd.known(
        gen,
        "trace.generate",
        {
            "process",
            "rate",
            "cv",
            "n",
            "prompt_mean",
            "output_mean",
            "sigma",
            "classes",
            "on_s",
            "off_s",
            "burst_factor",
            "prefix",
        },
    )
    rng = random.Random(f"scenario:{seed}")
    n = rd.integer(gen.get("n", 1000), "trace.generate.n")
    rate = rd.number(gen.get("rate", 1.0), "trace.generate.rate", positive=True)
    shape = _prefix_shape(rd, gen["prefix"]) if "prefix" in gen else None
    if shape is not None:  # the process then starts sessions, of turns_mean requests each
        rate /= shape.turns_mean
    process = gen.get("process", "poisson")
    if process == "poisson":
        arrivals = workload.poisson_arrivals(rate, n, rng)
    elif process == "gamma":
        arrivals = workload.gamma_arrivals(
            rate, rd.number(gen.get("cv", 2.0), "trace.generate.cv", positive=True), n, rng
        )
    elif process == "onoff":
        arrivals = workload.onoff_arrivals(
            rate,
            n,
            rng,
            on_s=rd.number(gen.get("on_s", 10.0), "trace.generate.on_s", positive=True),
            off_s=rd.number(gen.get("off_s", 30.0), "trace.generate.off_s", positive=True),
            burst_factor=rd.number(
                gen.get("burst_factor", 8.0), "trace.generate.burst_factor", positive=True
            ),
        )
    else:
        raise rd.fail("trace.generate.process", f"must be poisson, gamma or onoff, got {process!r}")
    classes_raw = gen.get("classes", {"": 1.0})
    weights = rd.mapping(classes_raw, "trace.generate.classes")
    lengths = workload.lognormal_lengths(
        n,
        rng,
        prompt_mean=rd.number(
            gen.get("prompt_mean", 1000), "trace.generate.prompt_mean", positive=True
        ),
        output_mean=rd.number(
            gen.get("output_mean", 200), "trace.generate.output_mean", positive=True
        ),
        sigma=rd.number(gen.get("sigma", 1.0), "trace.generate.sigma"),
        slo_classes=[
            (str(k), rd.number(v, f"trace.generate.classes.{k}", positive=True))
            for k, v in weights.items()
        ],
    )
    if shape is not None:
        return prefix_sessions(arrivals, lengths, shape, rng)
    return workload.with_arrivals(lengths, arrivals)


def _prefix_shape(rd: FieldReader, raw: Any) -> PrefixShape:
    spec = rd.mapping(raw, "trace.generate.prefix")
    fields = {f.name: f for f in dataclasses.fields(PrefixShape)}
    rd.known(spec, "trace.generate.prefix", set(fields))
    values: dict[str, Any] = {}
    for name, value in spec.items():
        where = f"trace.generate.prefix.{name}"
        values[name] = (
            rd.integer(value, where, minimum=0)
            if fields[name].type == "int"
            else rd.number(value, where)
        )
    try:
        return PrefixShape(**values)
    except ValueError as exc:
        raise rd.fail("trace.generate.prefix", str(exc)) from None
