"""Install paths without a cluster: the CRD single source, samples vs its schema, the Helm chart.

Helm and kubectl-free checks always run; the ones that need the `helm` binary (scripts/k8s_env.sh)
skip when it is absent, or fail under DISAGGPOOL_REQUIRE_K8S=1 (k8s_cluster.require_k8s).
Rendered manifests are validated against the Kubernetes OpenAPI schemas by
`kubernetes-validate --strict` (schemas for 1.25+; 1.20 is checked live in test_operator_e2e.py).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from k8s_cluster import CACHE_BIN, require_k8s
from operator_testkit import CHART, CRD_PATH, MANIFESTS

from disaggpool.operator.spec import parse_spec

HELM = CACHE_BIN / "helm"
VALUES_FILES = [
    None,
    CHART / "ci" / "all-features-values.yaml",
    CHART / "ci" / "minimal-values.yaml",
]


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _crd_schema() -> dict[str, Any]:
    schema: dict[str, Any] = _docs(CRD_PATH)[0]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


def test_chart_crd_is_a_byte_identical_copy_of_the_manifest() -> None:
    copies = list((CHART / "crds").glob("*.yaml"))
    assert len(copies) == 1
    assert copies[0].read_bytes() == CRD_PATH.read_bytes(), (
        "helm/disaggpool/crds/ drifted from manifests/00-crd.yaml: cp manifests/00-crd.yaml "
        f"{copies[0].relative_to(CHART.parents[1])}"
    )


@pytest.mark.parametrize("sample", sorted(p.name for p in (MANIFESTS / "samples").glob("*.yaml")))
def test_samples_satisfy_the_crd_schema_and_the_operator(sample: str) -> None:
    doc = _docs(MANIFESTS / "samples" / sample)[0]
    # OpenAPI 3.0 schemas are closest to JSON Schema draft 4 (boolean exclusiveMinimum).
    jsonschema.Draft4Validator(_crd_schema()).validate(doc)
    spec, issues = parse_spec(doc["spec"], "img")
    assert spec is not None and not issues, issues


def test_the_crd_schema_catches_what_it_claims_to() -> None:
    validator = jsonschema.Draft4Validator(_crd_schema())
    doc = _docs(MANIFESTS / "samples" / "small.yaml")[0]
    bad: dict[str, Any] = yaml.safe_load(yaml.safe_dump(doc))
    bad["spec"]["prefill"]["gpus"] = -1  # 0 is a CPU engine
    bad["spec"]["router"]["sloClasses"][0]["ttftSeconds"] = 0
    del bad["spec"]["model"]["name"]
    bad["spec"]["router"]["leaderElection"] = {"leaseDurationSeconds": 0, "retryPeriodSeconds": 0}
    errors = {".".join(map(str, e.absolute_path)) for e in validator.iter_errors(bad)}
    assert errors == {
        "spec.prefill.gpus",
        "spec.router.sloClasses.0.ttftSeconds",
        "spec.model",
        "spec.router.leaderElection.leaseDurationSeconds",
        "spec.router.leaderElection.retryPeriodSeconds",
    }


def _chart_rules(name: str) -> list[dict[str, Any]]:
    """The rules a `define` of the chart's _helpers.tpl holds (plain YAML inside)."""
    text = (CHART / "templates" / "_helpers.tpl").read_text()
    body = text.split(f'{{{{- define "{name}" -}}}}', 1)[1].split("{{- end -}}", 1)[0]
    rules: list[dict[str, Any]] = yaml.safe_load(body)
    return rules


def test_chart_rbac_rules_equal_the_manifests() -> None:
    """One set of rules, two install paths: the ClusterRole of manifests/02-rbac.yaml is the
    chart's cluster-only rules plus its namespaced ones (what a Role per watched namespace holds
    with operator.watchNamespaces)."""
    manifest_role = next(d for d in _docs(MANIFESTS / "02-rbac.yaml") if d["kind"] == "ClusterRole")
    cluster = _chart_rules("disaggpool.clusterRules")
    namespaced = _chart_rules("disaggpool.namespacedRules")
    assert cluster + namespaced == manifest_role["rules"]
    cluster_only = {g for r in cluster for g in r["resources"]}
    assert cluster_only == {"customresourcedefinitions", "namespaces"}


def test_every_manifest_rbac_rule_says_why() -> None:
    lines = (MANIFESTS / "02-rbac.yaml").read_text().splitlines()
    for i, line in enumerate(lines):
        if line.strip().startswith("- apiGroups:"):
            assert lines[i - 1].strip().startswith("#"), f"rule at line {i + 1} has no comment"


def test_operator_deployment_is_locked_down() -> None:
    dep = _docs(MANIFESTS / "03-operator.yaml")[0]
    pod = dep["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (c,) = pod["containers"]
    assert c["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    # Kopf's health endpoint: up once started (startup), failing when its loops die (liveness);
    # the operator serves no traffic, so readiness asks the same endpoint.
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": "health"}, probe
    assert "--liveness" in c["args"]


def test_every_chart_value_is_documented_and_typed() -> None:
    """Each key in values.yaml has a comment above it and an entry in values.schema.json."""
    import json

    schema = json.loads((CHART / "values.schema.json").read_text())
    lines = (CHART / "values.yaml").read_text().splitlines()
    stack: list[tuple[int, str]] = []
    for i, line in enumerate(lines):
        m = re.match(r"^(\s*)([A-Za-z][\w]*):", line)
        if not m:
            continue
        indent, key = len(m.group(1)), m.group(2)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = [k for _, k in stack] + [key]
        node = schema
        for k in path:
            if "properties" not in node:  # inside a free-form map (resources, labels)
                break
            node = node["properties"][k]  # KeyError: a value missing from the schema
        else:
            node = None
        if node is not None:
            stack.append((indent, key))
            continue
        is_leaf = not line.rstrip().endswith(":")
        if is_leaf:
            assert lines[i - 1].strip().startswith("# --"), (
                f"values.yaml: {'.'.join(path)} undocumented"
            )
        stack.append((indent, key))
    jsonschema.Draft7Validator(schema).validate(yaml.safe_load((CHART / "values.yaml").read_text()))


@pytest.fixture
def helm() -> Path:
    """The helm binary; skips (or fails under DISAGGPOOL_REQUIRE_K8S=1) when it is missing."""
    require_k8s(("helm",))
    return HELM


def _helm(*args: str) -> str:
    proc = subprocess.run([str(HELM), *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.usefixtures("helm")
@pytest.mark.parametrize("values", VALUES_FILES, ids=lambda v: v.name if v else "defaults")
def test_helm_lint_and_template_validate(values: Path | None, tmp_path: Path) -> None:
    extra = ["-f", str(values)] if values else []
    _helm("lint", "--strict", str(CHART), *extra)
    rendered = _helm("template", "dp", str(CHART), "--include-crds", *extra)
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    kinds = sorted(d["kind"] for d in docs)
    assert "CustomResourceDefinition" in kinds and "Deployment" in kinds
    if values and values.name == "all-features-values.yaml":
        assert "ServiceMonitor" in kinds
        dash = next(d for d in docs if d["kind"] == "ConfigMap")
        import json

        assert json.loads(dash["data"]["disaggpool.json"])["panels"]
    if values and values.name == "minimal-values.yaml":
        assert "ClusterRole" not in kinds and "ServiceAccount" not in kinds
    # kubernetes-validate knows built-in kinds only (ServiceMonitor is a CRD kind: skipped).
    builtin = [d for d in docs if d["kind"] != "ServiceMonitor"]
    out = tmp_path / "rendered.yaml"
    out.write_text(yaml.safe_dump_all(builtin))
    _kubernetes_validate(out)


@pytest.mark.usefixtures("helm")
def test_helm_router_mode_sets_the_operators_default_and_grants_inference_pools() -> None:
    """`router.mode`: frontdoor by default; gateway reaches the operator (DISAGGPOOL_ROUTER_MODE,
    the mode of pools that name none), as in manifests/03-operator.yaml; the operator may manage
    InferencePools in either case (a pool may name gateway itself), in a ClusterRole or in each
    watched namespace's Role; a mode the chart does not know is refused naming the value."""

    def render(*args: str) -> list[dict[str, Any]]:
        out = _helm("template", "dp", str(CHART), *args)
        return [d for d in yaml.safe_load_all(out) if d]

    def mode_env(docs: list[dict[str, Any]]) -> str:
        (dep,) = [d for d in docs if d["kind"] == "Deployment"]
        env = dep["spec"]["template"]["spec"]["containers"][0]["env"]
        return str(next(e["value"] for e in env if e["name"] == "DISAGGPOOL_ROUTER_MODE"))

    manifest = _docs(MANIFESTS / "03-operator.yaml")[0]
    env = manifest["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "DISAGGPOOL_ROUTER_MODE", "value": "frontdoor"} in env
    assert mode_env(render()) == "frontdoor"
    rule = {
        "apiGroups": ["inference.networking.k8s.io"],
        "resources": ["inferencepools"],
        "verbs": ["get", "list", "create", "patch", "delete"],
    }
    for extra in ([], ["--set", "operator.watchNamespaces={serving}"]):
        docs = render("--set", "router.mode=gateway", *extra)
        assert mode_env(docs) == "gateway"
        (role,) = [d for d in docs if d["kind"] in ("ClusterRole", "Role")]
        assert rule in role["rules"], role["kind"]
    proc = subprocess.run(
        [str(HELM), "template", "dp", str(CHART), "--set", "router.mode=ingress"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode != 0 and "router.mode" in proc.stderr, proc.stderr


def test_plain_manifests_validate_strictly(tmp_path: Path) -> None:
    docs = [d for p in sorted(MANIFESTS.glob("*.yaml")) for d in _docs(p)]
    out = tmp_path / "manifests.yaml"
    out.write_text(yaml.safe_dump_all(docs))
    _kubernetes_validate(out)


def test_rendered_pool_objects_validate_strictly(tmp_path: Path) -> None:
    from disaggpool.operator.calibration_plan import render_calibration_job
    from disaggpool.operator.names import PoolRef
    from disaggpool.operator.observed import PodView
    from disaggpool.operator.render import render_pool

    docs: list[dict[str, Any]] = []
    for sample in ("small.yaml", "heterogeneous.yaml"):
        doc = _docs(MANIFESTS / "samples" / sample)[0]
        spec, _ = parse_spec(doc["spec"], "img:1")
        assert spec is not None
        pool = PoolRef(doc["metadata"]["name"], "default", "0000-uid", 1)
        docs += render_pool(pool, spec)
        docs.append(
            render_calibration_job(
                pool, spec, PodView("p-0", "decode", "198.18.0.1", True), "198.18.0.2", 1
            )
        )
    # Every optional object and field (NetworkPolicies, Secret volumes, restricted engines).
    from test_pod_security import rendered_pool

    full = rendered_pool("full")
    assert {"NetworkPolicy", "Role", "Job"} <= {d["kind"] for d in full}
    docs += full
    # Gateway mode's pd-proxy containers and router ports (kubernetes-validate has no schema
    # for the InferencePool: test_gateway_render.py checks it against its CRD).
    docs += [d for d in rendered_pool("gateway") if d["kind"] != "InferencePool"]
    out = tmp_path / "pool.yaml"
    out.write_text(yaml.safe_dump_all(docs))
    _kubernetes_validate(out)


def _kubernetes_validate(path: Path) -> None:
    exe = shutil.which("kubernetes-validate") or str(
        Path(__file__).resolve().parents[2] / ".venv" / "bin" / "kubernetes-validate"
    )
    proc = subprocess.run(
        [exe, "-k", "1.30.0", "--strict", str(path)], capture_output=True, text=True, timeout=120
    )
    bad = [
        line
        for line in (proc.stdout + proc.stderr).splitlines()
        if line.startswith("ERROR") or ("ERROR" in line and "Couldn't find schema" not in line)
    ]
    assert proc.returncode == 0 or (not bad and "CustomResourceDefinition" not in proc.stdout), (
        proc.stdout + proc.stderr
    )
    assert not bad, "\n".join(bad)


def test_crd_schema_uses_only_schema_keywords() -> None:
    """A comma in an unquoted flow-style description silently becomes a bogus key; catch it."""
    allowed = {
        "type", "description", "properties", "required", "items", "enum", "minimum", "maximum",
        "minLength", "maxLength", "pattern", "additionalProperties", "exclusiveMinimum",
        "exclusiveMaximum",
        "format", "x-kubernetes-preserve-unknown-fields",
    }  # fmt: skip
    stray: list[str] = []

    def walk(node: dict[str, Any], path: str) -> None:
        stray.extend(f"{path}: {k!r}" for k in node if k not in allowed)
        for key, child in (node.get("properties") or {}).items():
            walk(child, f"{path}.{key}")
        for key in ("items", "additionalProperties"):
            if isinstance(node.get(key), dict):
                walk(node[key], f"{path}[{key}]")

    walk(_crd_schema(), "")
    assert not stray, stray


def test_require_k8s_skips_or_fails_on_missing_binaries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DISAGGPOOL_REQUIRE_K8S=1 turns the missing-binaries skip into a failure naming them."""
    import k8s_cluster

    monkeypatch.setattr(k8s_cluster, "CACHE_BIN", tmp_path)
    monkeypatch.delenv("DISAGGPOOL_REQUIRE_K8S", raising=False)
    with pytest.raises(pytest.skip.Exception, match="kube-apiserver"):
        k8s_cluster.require_k8s()
    monkeypatch.setenv("DISAGGPOOL_REQUIRE_K8S", "1")
    with pytest.raises(pytest.fail.Exception, match=r"DISAGGPOOL_REQUIRE_K8S=1 but .*helm"):
        k8s_cluster.require_k8s(("helm",))
    (tmp_path / "helm").write_text("")
    k8s_cluster.require_k8s(("helm",))  # present: neither skips nor fails
