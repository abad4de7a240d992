"""One reconcile pass of a pool: read the CR and the cluster, render, apply the difference.

Level-triggered and idempotent: a pass compares hashes of the rendered objects with what the
cluster holds and writes only what differs, so running it twice in a row writes nothing (the tests
count requests to prove it). Every write leaves an Event on the pool. A spec that fails validation
is reported as the `Degraded` condition plus a Warning event and is otherwise ignored: the objects
rendered from the last valid spec (remembered in an annotation on the pool) keep running and keep
being calibrated. Calls the pure modules (`render`, `observed`, `calibration_plan`, `status`)
and `disaggpool.kubeclient` (I/O); `handlers` decides when to call it.

The pool's status is the operator's except ``status.router``, the router's report (its decode
recommendation and drift errors, written through the status subresource): a pass reads it and
never writes or removes it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import json
import logging
from collections.abc import Mapping
from typing import Any

from disaggpool.kubeclient import ApiError, Kube, matches, path_for, pod_ready
from disaggpool.labels import (
    API_VERSION,
    APPLIED_SPEC_ANNOTATION,
    COMPONENT_LABEL,
    COMPONENT_ROUTER,
    KIND,
    MANAGED_BY,
    MANAGED_BY_LABEL,
    POD_LABEL,
    POOL_LABEL,
    PROBE_JOB_LABELS,
    PROFILE_LABEL,
    PROFILE_LABELS,
    ROUTER_STATUS_KEY,
    SPEC_HASH_ANNOTATION,
    of_pool,
)
from disaggpool.operator.calibration_plan import CalibrationPlan, plan_calibration
from disaggpool.operator.names import PoolRef, service_account_name
from disaggpool.operator.observed import (
    PodView,
    job_view,
    observed_errors,
    owned_by,
    pod_view,
    profile_view,
    router_report,
)
from disaggpool.operator.render import render_pool
from disaggpool.operator.scaling import PoolScale, pool_scale, previous_role_status
from disaggpool.operator.spec import PoolSpec, SpecIssue, check_pool_name, parse_spec
from disaggpool.operator.status import compute_status

__all__ = ["ReconcileResult", "pool_path", "reconcile"]

log = logging.getLogger("disaggpool.operator")

_MANAGED = {MANAGED_BY_LABEL: MANAGED_BY}
# Kinds a pool consists of, for pruning what a spec change no longer renders.
_PRUNABLE = (
    ("apps/v1", "Deployment"),
    ("v1", "Service"),
    ("v1", "Endpoints"),
    ("v1", "ConfigMap"),
    ("v1", "ServiceAccount"),
    ("rbac.authorization.k8s.io/v1", "Role"),
    ("rbac.authorization.k8s.io/v1", "RoleBinding"),
    ("networking.k8s.io/v1", "NetworkPolicy"),
    ("inference.networking.k8s.io/v1", "InferencePool"),
)
# Kinds of another project's CRD (GIE's InferencePool, gateway mode): a cluster without the CRD
# answers 404 for the kind; it then holds none to prune, and a gateway-mode pool is told why.
_FOREIGN = frozenset({"InferencePool"})
# Merge patches never remove keys; these optional pod-template fields must be cleared explicitly
# when the spec drops them (lists such as containers or env are replaced wholesale anyway).
_CLEARABLE_POD_FIELDS = ("nodeSelector", "tolerations", "affinity")
_WAVES = {"RoleBinding": 1, "Deployment": 2}


def pool_path(namespace: str | None, name: str | None = None) -> str:
    """The REST path of a DisaggPool (no `namespace`: of all pools in the cluster)."""
    return path_for(API_VERSION, KIND, namespace, name)


@dataclasses.dataclass(slots=True)
class ReconcileResult:
    """What a pass did (the tests and the benchmark read it)."""

    created: list[str] = dataclasses.field(default_factory=list)
    updated: list[str] = dataclasses.field(default_factory=list)
    deleted: list[str] = dataclasses.field(default_factory=list)
    jobs_created: list[str] = dataclasses.field(default_factory=list)
    status_written: bool = False
    issues: list[SpecIssue] = dataclasses.field(default_factory=list)

    @property
    def changed(self) -> bool:
        return bool(
            self.created or self.updated or self.deleted or self.jobs_created or self.status_written
        )


def _ident(obj: Mapping[str, Any]) -> str:
    return f"{obj['kind']} {obj['metadata']['name']}"


def _update_patch(desired: Mapping[str, Any], current: Mapping[str, Any]) -> dict[str, Any]:
    patch: dict[str, Any] = json.loads(json.dumps(desired))
    if desired.get("kind") == "Service" and "selector" not in patch["spec"]:
        # An active/passive router's Service has none (its leader writes the Endpoints): a merge
        # patch must remove the one it had.
        patch["spec"]["selector"] = None
    if desired.get("kind") == "Deployment":
        cur = ((current.get("spec") or {}).get("template") or {}).get("spec") or {}
        new = patch["spec"]["template"]["spec"]
        for key in _CLEARABLE_POD_FIELDS:
            if key in cur and key not in new:
                new[key] = None
    return patch


async def _apply(kube: Kube, obj: Mapping[str, Any]) -> str:
    """Create, patch or leave one object; returns "created", "updated", "" or, for a kind whose
    CRD the cluster lacks (`_FOREIGN`), "missing"."""
    md = obj["metadata"]
    path = path_for(obj["apiVersion"], obj["kind"], md["namespace"], md["name"])
    current = await kube.get(path)
    if current is None:
        try:
            await kube.create(path_for(obj["apiVersion"], obj["kind"], md["namespace"]), obj)
        except ApiError as exc:
            if exc.status == 404 and obj["kind"] in _FOREIGN:
                return "missing"
            if exc.status != 409:  # created concurrently: the next pass compares hashes
                raise
            return ""
        return "created"
    have = ((current.get("metadata") or {}).get("annotations") or {}).get(SPEC_HASH_ANNOTATION)
    if have == md["annotations"][SPEC_HASH_ANNOTATION]:
        return ""
    await kube.merge_patch(path, _update_patch(obj, current))
    return "updated"


# Status keys a pass never writes or removes: the router's report, and Kopf's own bookkeeping.
_NOT_OURS = frozenset({ROUTER_STATUS_KEY, "kopf"})


def _status_patch(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    patch = {k: v for k, v in new.items() if old.get(k) != v and k not in _NOT_OURS}
    for key, value in patch.items():
        was = old.get(key)
        if isinstance(value, Mapping) and isinstance(was, Mapping):
            # A merge patch merges objects: a key the new one lacks (status.autoscaling's
            # `prefill` once prefill is no longer scaled, an `error` fixed) must be nulled.
            patch[key] = {**value, **{k: None for k in was if k not in value}}
    for key in old:
        if key not in new and key not in _NOT_OURS:
            patch[key] = None
    return patch


def _engine_pod_names(pods: list[PodView]) -> list[str]:
    """The engine pods a probe may run against: whose profile ConfigMap the probe may patch."""
    return [p.name for p in pods if not p.deleting]


async def reconcile(
    kube: Kube,
    namespace: str,
    name: str,
    *,
    default_image: str,
    default_mode: str = "frontdoor",
    now: dt.datetime | None = None,
) -> ReconcileResult:
    """Bring pool `namespace/name` to its spec; a no-op when it is gone or already there.
    `default_image`, `default_mode`: the operator's defaults (`spec.parse_spec`)."""
    result = ReconcileResult()
    scale: PoolScale | None = None
    cr = await kube.get(pool_path(namespace, name))
    if cr is None or (cr.get("metadata") or {}).get("deletionTimestamp"):
        return result  # deletion is the garbage collector's job (owner references)
    now = now or dt.datetime.now(dt.UTC)
    md = cr["metadata"]
    pool = PoolRef(name, namespace, str(md.get("uid", "")), int(md.get("generation") or 1))
    annotations = md.get("annotations") or {}
    previous: Mapping[str, Any] = cr.get("status") or {}

    issues = check_pool_name(name)
    spec, spec_issues = parse_spec(cr.get("spec"), default_image, default_mode)
    issues += spec_issues
    result.issues = issues
    effective: PoolSpec | None = None if issues else spec
    applied_raw = annotations.get(APPLIED_SPEC_ANNOTATION)
    if issues and applied_raw:
        try:
            effective, _ = parse_spec(json.loads(applied_raw), default_image, default_mode)
        except json.JSONDecodeError:
            effective = None

    async def note(reason: str, message: str, warning: bool = False) -> None:
        try:
            await kube.event(cr, reason, message, warning=warning)
        except ApiError as exc:  # an event is a courtesy; never fail a reconcile over one
            log.warning("event %s on %s/%s not recorded: %s", reason, namespace, name, exc)

    applied_generation = previous.get("appliedGeneration")
    report = router_report(cr)  # what the router wrote on the status: recommendation, drift
    pods_raw, cms_raw, jobs_raw = await asyncio.gather(
        kube.list(path_for("v1", "Pod", namespace), {POOL_LABEL: name}),
        kube.list(path_for("v1", "ConfigMap", namespace), {POOL_LABEL: name}),
        kube.list(path_for("batch/v1", "Job", namespace), of_pool(name, PROBE_JOB_LABELS)),
    )
    pods = [v for v in map(pod_view, pods_raw) if v is not None]
    engine_pods = _engine_pod_names(pods)
    if issues:
        message = "; ".join(str(i) for i in issues)
        conds: list[Mapping[str, Any]] = list(previous.get("conditions") or [])
        old: Mapping[str, Any] = next((c for c in conds if c.get("type") == "Degraded"), {})
        if old.get("reason") != "InvalidSpec" or not str(old.get("message", "")).startswith(
            message
        ):
            await note("InvalidSpec", message, warning=True)
        if effective is not None and effective.calibration.enabled:
            # The last applied spec keeps being calibrated: its probe's Role follows the pods.
            probe_role = f"Role {service_account_name(pool, 'probe')}"
            for obj in render_pool(pool, effective, engine_pods):
                if _ident(obj) == probe_role and await _apply(kube, obj) == "updated":
                    result.updated.append(_ident(obj))
    elif spec is not None:
        scale = pool_scale(spec, report, previous.get("autoscaling"))
        await _note_scale(scale, previous, note)
        desired = render_pool(pool, scale.apply(spec), engine_pods)
        outcomes = {}
        # In waves: a RoleBinding is refused (404) until its Role exists, and pods should not
        # start before their ServiceAccount and config exist. Within a wave, in parallel.
        for wave in (0, 1, 2):
            batch = [o for o in desired if _WAVES.get(o["kind"], 0) == wave]
            done = await asyncio.gather(*(_apply(kube, o) for o in batch))
            outcomes.update({_ident(o): r for o, r in zip(batch, done, strict=True)})
        for obj in desired:
            outcome = outcomes[_ident(obj)]
            if outcome == "created":
                result.created.append(_ident(obj))
            elif outcome == "updated":
                result.updated.append(_ident(obj))
            elif outcome == "missing":
                await note(
                    "CRDMissing",
                    f"cannot create {_ident(obj)}: the cluster does not serve "
                    f"{obj['apiVersion']} {obj['kind']} (install the Gateway API Inference "
                    "Extension's CRDs for router.mode gateway)",
                    warning=True,
                )
        result.deleted += await _prune(kube, pool, {_ident(o) for o in desired})
        for verb, idents in (
            ("Created", result.created),
            ("Updated", result.updated),
            ("Deleted", result.deleted),
        ):
            if idents:
                await note(verb, f"{verb.lower()} {', '.join(sorted(idents))}")
        raw = json.dumps(cr.get("spec"), sort_keys=True, separators=(",", ":"))
        if applied_raw != raw:
            await kube.merge_patch(
                pool_path(namespace, name),
                {"metadata": {"annotations": {APPLIED_SPEC_ANNOTATION: raw}}},
            )
        applied_generation = pool.generation

    router_ready = sum(
        1
        for p in pods_raw
        if ((p.get("metadata") or {}).get("labels") or {}).get(COMPONENT_LABEL) == COMPONENT_ROUTER
        and pod_ready(p)
    )
    plan = None
    errors = observed_errors(report)  # the router's, per pod (calibration.maxPredictionError)
    profiles = [c for c in cms_raw if matches(c, of_pool(name, PROFILE_LABELS))]
    placeholders = [
        (str(c["metadata"]["name"]), str(c["metadata"]["labels"][POD_LABEL]))
        for c in cms_raw
        if POD_LABEL in ((c.get("metadata") or {}).get("labels") or {})
        and PROFILE_LABEL not in c["metadata"]["labels"]
        and owned_by(c, pool.uid)
    ]
    if effective is not None:
        plan = plan_calibration(
            pool,
            effective,
            pods,
            [profile_view(c, pool.uid, errors) for c in profiles],
            [j for j in map(job_view, jobs_raw) if j is not None],
            now,
            placeholders,
        )
        await _execute(kube, pool, plan, result, note, previous)

    if effective is not None and scale is None:  # an invalid spec: the last one applied runs
        scale = pool_scale(effective, report, previous.get("autoscaling"))
    in_force = scale.apply(effective) if effective and scale else None
    status = compute_status(
        pool, in_force, issues, applied_generation, pods, plan, router_ready, previous, now
    )
    if scale is not None and effective is not None and effective.autoscaling.enabled:
        status["autoscaling"] = scale.status()
    patch = _status_patch(previous, status)
    if patch:
        await kube.merge_patch(pool_path(namespace, name) + "/status", {"status": patch})
        result.status_written = True
    return result


async def _note_scale(scale: PoolScale, previous: Mapping[str, Any], note: Any) -> None:
    """Per role, an Event (DecodeScaled, PrefillScaled) when the count this pass renders
    differs from the last one reported (the first pass reports the initial count), or a
    recommendation fails to parse."""
    for rs in scale.roles:
        last = previous_role_status(previous.get("autoscaling"), rs.role)
        before = last.get("replicas")
        if rs.error and last.get("error") != rs.error:
            await note("InvalidRecommendation", rs.error, warning=True)
        if rs.source == "autoscaler" and before is not None and before != rs.replicas:
            reason = f"{rs.role.capitalize()}Scaled"
            await note(reason, f"{rs.role} {before} -> {rs.replicas}: {rs.reason}")


async def _prune(kube: Kube, pool: PoolRef, keep: set[str]) -> list[str]:
    """Delete objects of this pool that the current spec no longer renders."""
    selector = {POOL_LABEL: pool.name, **_MANAGED}

    async def listed(version: str, kind: str) -> list[dict[str, Any]]:
        try:
            return await kube.list(path_for(version, kind, pool.namespace), selector)
        except ApiError as exc:
            if exc.status == 404 and kind in _FOREIGN:  # not served here: nothing to prune
                return []
            raise

    found = await asyncio.gather(*(listed(v, k) for v, k in _PRUNABLE))
    gone = []
    for (version, kind), items in zip(_PRUNABLE, found, strict=True):
        for item in items:
            md = item.get("metadata") or {}
            owners = {o.get("uid") for o in md.get("ownerReferences") or []}
            ident = f"{kind} {md.get('name')}"
            if pool.uid in owners and ident not in keep:
                await kube.delete(path_for(version, kind, pool.namespace, str(md.get("name"))))
                gone.append(ident)
    return gone


async def _create_placeholder(
    kube: Kube, pool: PoolRef, cm: Mapping[str, Any], result: ReconcileResult, note: Any
) -> None:
    """Create the ConfigMap a probe writes into. One of that name that is not this pool's (no
    owner reference to it: left by an older version, or written by someone else) is taken over:
    owned by the pool, its data and profile label removed, so that the probe's write is what
    counts."""
    md = cm["metadata"]
    try:
        await kube.create(path_for("v1", "ConfigMap", pool.namespace), cm)
        result.created.append(f"ConfigMap {md['name']}")
        return
    except ApiError as exc:
        if exc.status != 409:
            raise
    path = path_for("v1", "ConfigMap", pool.namespace, md["name"])
    current = await kube.get(path)
    if current is None or owned_by(current, pool.uid):
        return
    await kube.merge_patch(
        path,
        {
            "metadata": {
                "ownerReferences": md["ownerReferences"],
                "labels": {**md["labels"], PROFILE_LABEL: None},
            },
            "data": None,
            "binaryData": None,
        },
    )
    result.updated.append(f"ConfigMap {md['name']}")
    await note(
        "ProfileIgnored",
        f"ConfigMap {md['name']} was not owned by this pool; taken over for a new probe",
        warning=True,
    )


async def _execute(
    kube: Kube,
    pool: PoolRef,
    plan: CalibrationPlan,
    result: ReconcileResult,
    note: Any,
    previous: Mapping[str, Any],
) -> None:
    ns = pool.namespace
    for cm in plan.create_configmaps:
        await _create_placeholder(kube, pool, cm, result, note)
    for job in plan.create_jobs:
        try:
            await kube.create(path_for("batch/v1", "Job", ns), job)
        except ApiError as exc:
            if exc.status != 409:
                raise
            # The plan saw no such Job among the pool's probe Jobs, yet one holds the name: a Job
            # this operator cannot find by its labels. Said aloud, because the probe it stands
            # for is never watched (a label drift once hid every probe Job this way).
            name = job["metadata"]["name"]
            await note(
                "CalibrationBlocked",
                f"Job {name} exists without the labels of a probe Job; delete it to probe",
                warning=True,
            )
            continue
        result.jobs_created.append(job["metadata"]["name"])
        pod = job["metadata"]["labels"][POD_LABEL]
        await note("CalibrationStarted", f"probing pod {pod} with Job {job['metadata']['name']}")
    for name in plan.delete_jobs:
        if await kube.delete(path_for("batch/v1", "Job", ns, name)):
            result.deleted.append(f"Job {name}")
    for name in plan.delete_configmaps:
        if await kube.delete(path_for("v1", "ConfigMap", ns, name)):
            result.deleted.append(f"ConfigMap {name}")
            await note("ProfileDeleted", f"deleted profile {name}: its pod is gone")
    before = {
        p.get("name"): p.get("calibration") for p in previous.get("pods") or [] if p.get("name")
    }
    reasons = {p.get("name"): str(p.get("reason", "")) for p in previous.get("pods") or []}
    for c in plan.pods:
        view = c.profile
        # A profile that does not parse or fails validation (core.profile names the field): the
        # router scores the pod as unprofiled and the pod is probed again. Said once per distinct
        # error (the status keeps it in the pod's reason).
        rejected = view is not None and view.profile is None and bool(view.error)
        if view is not None and rejected and view.error not in reasons.get(c.pod.name, ""):
            await note(
                "ProfileRejected",
                f"pod {c.pod.name}: ConfigMap {view.configmap}: {view.error}",
                warning=True,
            )
    for c in plan.pods:
        if c.state in ("calibrated", "failed", "poor") and before.get(c.pod.name) != c.state:
            p = c.profile.profile if c.profile else None
            detail = f"quality {p.quality}, fitted {p.fitted_at}" if p else c.reason
            await note(
                "Calibrated" if c.state == "calibrated" else "CalibrationFailed",
                f"pod {c.pod.name}: {detail}",
                warning=c.state != "calibrated",
            )
