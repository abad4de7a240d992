"""Gateway mode (``router.mode: gateway``) as the operator renders it, without a cluster.

The InferencePool (selector, target port, endpoint picker), the router's ext_proc listener and
Service port, the pd-proxy beside every decode engine, the NetworkPolicies, the spec's rules, and
the schemas: the rendered InferencePool against tests/operator/fixtures/inferencepool-crd.yaml,
the DisaggPool CRD's `router.mode` enum. tests/operator/test_gateway_e2e.py applies the same on a
real kube-apiserver.
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from operator_testkit import CRD_PATH, load_sample
from test_pod_security import restricted_violations

from disaggpool.core.lease import LeaseTimings
from disaggpool.kubeclient.paths import matches
from disaggpool.operator.calibration_plan import render_calibration_job
from disaggpool.operator.names import PoolRef
from disaggpool.operator.observed import PodView
from disaggpool.operator.render import render_pool, render_router_config
from disaggpool.operator.spec import PoolSpec, parse_spec
from disaggpool.operator.status import compute_status
from disaggpool.sidecar.config import parse_config

INFERENCE_POOL_CRD = Path(__file__).parent / "fixtures" / "inferencepool-crd.yaml"
GATEWAY = {"mode": "gateway", "grpc": {"tokenSecret": {"name": "grpc-token"}}}


def _spec(sample: str = "heterogeneous.yaml", **patch: Any) -> tuple[PoolRef, PoolSpec]:
    doc = load_sample(sample)
    for key, value in patch.items():
        doc["spec"].setdefault(key, {}).update(value)
    spec, issues = parse_spec(doc["spec"], "ghcr.io/disaggpool/disaggpool:0.1.0")
    assert spec is not None, issues
    return PoolRef(doc["metadata"]["name"], "serving", "0000-uid", 1), spec


def _by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def _containers(deployment: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in deployment["spec"]["template"]["spec"]["containers"]}


def _pod_labels(pool: PoolRef, spec: PoolSpec, docs: list[dict[str, Any]]) -> dict[str, Any]:
    """Every pod template of the pool (Deployments and a probe Job) by name."""
    labels = {
        name: d["spec"]["template"]["metadata"]["labels"]
        for name, d in _by_kind(docs, "Deployment").items()
    }
    job = render_calibration_job(pool, spec, PodView("p", "decode", "1.1.1.1", True), None, 1)
    labels["probe"] = job["spec"]["template"]["metadata"]["labels"]
    return labels


def _selected(labels: dict[str, Any], match_labels: dict[str, str]) -> set[str]:
    return {n for n, lab in labels.items() if matches({"metadata": {"labels": lab}}, match_labels)}


def test_gateway_mode_renders_an_inference_pool_of_exactly_the_decode_pods() -> None:
    pool, spec = _spec(router=GATEWAY)
    docs = render_pool(pool, spec)
    (ip,) = _by_kind(docs, "InferencePool").values()
    assert ip["apiVersion"] == "inference.networking.k8s.io/v1"
    assert ip["metadata"]["name"] == "hetero"
    assert ip["metadata"]["ownerReferences"][0]["kind"] == "DisaggPool"  # pruned, collected
    assert ip["spec"]["targetPorts"] == [{"number": 8001}]
    assert ip["spec"]["endpointPickerRef"] == {
        "kind": "Service", "name": "hetero-router", "port": {"number": 9002},
        "failureMode": "FailClose",
    }  # fmt: skip
    # Every decode variant and nothing else: not prefill, not the router, not a probe.
    selected = _selected(_pod_labels(pool, spec, docs), ip["spec"]["selector"]["matchLabels"])
    decode = {n for n in _by_kind(docs, "Deployment") if n.startswith("hetero-decode")}
    assert selected == decode and len(decode) == 2
    # The picker it names exists: the router's Service, with that port, speaking gRPC.
    service = _by_kind(docs, "Service")["hetero-router"]
    port = next(p for p in service["spec"]["ports"] if p["port"] == 9002)
    assert port == {
        "name": "grpc-epp",
        "port": 9002,
        "targetPort": "grpc-epp",
        "appProtocol": "grpc",
    }
    router = _containers(_by_kind(docs, "Deployment")["hetero-router"])["router"]
    assert {"name": "grpc-epp", "containerPort": 9002} in router["ports"]
    # Kubernetes 1.20 has no gRPC probes: the router keeps its HTTP ones. The sample runs two
    # router replicas (active/passive): the kubelet leaves out the leadership check.
    assert router["readinessProbe"]["httpGet"] == {
        "path": "/readyz?exclude=leader",
        "port": "http",
    }
    # The InferencePool is valid against the CRD the e2e tests install.
    crd = yaml.safe_load(INFERENCE_POOL_CRD.read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    jsonschema.Draft4Validator(schema).validate(ip)


def test_the_router_listens_for_the_gateway_and_names_the_pd_proxy_port() -> None:
    pool, spec = _spec(router=GATEWAY)
    config = yaml.safe_load(render_router_config(pool, spec))
    assert config["listen"]["ext_proc"] == "0.0.0.0:9002"
    assert config["gateway"] == {"destination_port": 8001}
    # The ext_proc port takes the gRPC port's token, which gateway mode requires.
    assert config["grpc"] == {"token_file": "/var/run/disaggpool/grpc-token/token"}
    assert config["listen"]["grpc"] == "0.0.0.0:50051"
    parsed = parse_config(config, "sidecar.yaml")  # the sidecar reads what the operator writes
    assert (parsed.ext_proc_listen, parsed.gateway.destination_port) == ("0.0.0.0:9002", 8001)


@pytest.mark.parametrize("api_key", [None, {"name": "pool-key", "key": "k"}])
def test_every_decode_engine_gets_a_restricted_pd_proxy(api_key: dict[str, str] | None) -> None:
    patch: dict[str, Any] = {"router": GATEWAY}
    if api_key:
        patch["auth"] = {"apiKeySecret": api_key}
    pool, spec = _spec(**patch)
    deployments = _by_kind(render_pool(pool, spec), "Deployment")
    for name, dep in deployments.items():
        containers = _containers(dep)
        if not name.startswith("hetero-decode"):
            assert "pd-proxy" not in containers, name
            continue
        proxy = containers["pd-proxy"]
        assert proxy["image"] == spec.router.image  # our image, not vLLM's
        assert proxy["command"] == ["disaggpool"]
        args = proxy["args"]
        assert args[:5] == [
            "pd-proxy", "--listen", "0.0.0.0:8001", "--model-server", "http://127.0.0.1:8000",
        ]  # fmt: skip
        assert proxy["ports"] == [{"name": "pd-proxy", "containerPort": 8001, "protocol": "TCP"}]
        assert proxy["readinessProbe"]["httpGet"] == {"path": "/health", "port": "pd-proxy"}
        assert proxy["livenessProbe"]["tcpSocket"] == {"port": "pd-proxy"}  # not vLLM's health
        pod = dep["spec"]["template"]["spec"]
        # Restricted by itself, whatever the engine pod's level (baseline here).
        alone = {"securityContext": pod["securityContext"], "containers": [proxy], "volumes": []}
        assert restricted_violations(alone) == [], name
        assert "runAsNonRoot" not in json.dumps(containers["vllm"])  # the engine is untouched
        key_file = "/var/run/disaggpool/api-key/api-key"
        if api_key is None:
            assert args[5:] == ["--allow-unauthenticated"]
            assert "volumeMounts" not in proxy
        else:
            assert args[5:] == ["--api-keys-file", key_file, "--upstream-api-key-file", key_file]
            assert proxy["volumeMounts"] == [
                {"name": "api-key", "mountPath": "/var/run/disaggpool/api-key", "readOnly": True}
            ]
            volume = next(v for v in pod["volumes"] if v["name"] == "api-key")
            assert volume["secret"] == {
                "secretName": "pool-key", "items": [{"key": "k", "path": "api-key"}],
            }  # fmt: skip


def test_frontdoor_mode_renders_none_of_it() -> None:
    for patch in ({}, {"router": {"mode": "frontdoor"}}):
        pool, spec = _spec(**patch)
        assert spec.router.mode == "frontdoor"
        docs = render_pool(pool, spec)
        text = json.dumps(docs)
        assert "InferencePool" not in text and "pd-proxy" not in text and "9002" not in text
        config = yaml.safe_load(render_router_config(pool, spec))
        assert "ext_proc" not in config["listen"] and "gateway" not in config


def _assert_refused(router: dict[str, Any], field: str, words: str) -> None:
    """The small sample with `router` merged in is refused, naming `field`, with `words`."""
    doc = load_sample("small.yaml")["spec"]
    doc["router"].update(router)
    spec, issues = parse_spec(doc, "img")
    assert spec is None
    (issue,) = [i for i in issues if i.field == field]
    assert words in issue.message and str(issue).startswith(f"spec.{field}:")


@pytest.mark.parametrize(
    ("router", "field", "words"),
    [
        ({"mode": "gatewy"}, "router.mode", "frontdoor or gateway"),
        ({"mode": "gateway"}, "router.grpc.tokenSecret", "gateway mode"),
        # Open without a token, but with no NetworkPolicy to fence the ports.
        (
            {"mode": "gateway", "grpc": {"allowUnauthenticated": True}},
            "router.grpc.allowUnauthenticated",
            "networkPolicy.enabled",
        ),
    ],
)
def test_a_bad_mode_or_an_unauthenticated_gateway_is_refused(
    router: dict[str, Any], field: str, words: str
) -> None:
    _assert_refused(router, field, words)


def test_the_operators_default_mode_applies_to_pools_that_name_none() -> None:
    doc = load_sample("small.yaml")["spec"]
    doc["router"]["grpc"] = {"tokenSecret": {"name": "t"}}
    spec, _ = parse_spec(doc, "img", "gateway")
    assert spec is not None and spec.router.gateway
    doc["router"]["mode"] = "frontdoor"  # the pool's own word wins
    spec, _ = parse_spec(doc, "img", "gateway")
    assert spec is not None and not spec.router.gateway
    del doc["router"]["mode"]
    spec, issues = parse_spec(doc, "img", "bogus")  # a bad operator setting names the field
    assert spec is None and [i.field for i in issues] == ["router.mode"]


def test_the_crd_refuses_a_bad_mode_naming_the_field() -> None:
    crd = yaml.safe_load(CRD_PATH.read_text())
    validator = jsonschema.Draft4Validator(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
    doc = load_sample("small.yaml")
    doc["spec"]["router"].update(GATEWAY)
    assert not list(validator.iter_errors(doc))
    doc["spec"]["router"]["mode"] = "ingress"
    paths = {".".join(map(str, e.absolute_path)) for e in validator.iter_errors(doc)}
    assert paths == {"spec.router.mode"}


def test_network_policies_let_the_gateway_reach_the_picker_and_the_pd_proxies() -> None:
    clients = [{"namespaceSelector": {"matchLabels": {"gateway": "true"}}}]
    pool, spec = _spec(router=GATEWAY, networkPolicy={"enabled": True, "clients": clients})
    docs = render_pool(pool, spec)
    policies = _by_kind(docs, "NetworkPolicy")
    assert sorted(policies) == ["hetero-engines", "hetero-gateway", "hetero-probe", "hetero-router"]
    labels = _pod_labels(pool, spec, docs)
    (router_rule,) = policies["hetero-router"]["spec"]["ingress"]
    assert router_rule["from"] == clients
    assert {"protocol": "TCP", "port": 9002} in router_rule["ports"]
    gateway = policies["hetero-gateway"]["spec"]
    decode = {n for n in labels if n.startswith("hetero-decode")}
    assert _selected(labels, gateway["podSelector"]["matchLabels"]) == decode
    assert gateway["ingress"] == [{"from": clients, "ports": [{"protocol": "TCP", "port": 8001}]}]
    # A pd-proxy runs the prefill leg from its decode pod: the engines' peer rule (any port,
    # from every engine pod of the pool) lets decode pods reach the prefill pods' vLLM.
    engines = policies["hetero-engines"]["spec"]
    peer = engines["ingress"][-1]
    prefill = {n for n in labels if n.startswith("hetero-prefill")}
    assert prefill <= _selected(labels, engines["podSelector"]["matchLabels"])
    assert decode <= _selected(labels, peer["from"][0]["podSelector"]["matchLabels"])
    assert "ports" not in peer
    # Frontdoor mode: no gateway policy, no 9002.
    pool, spec = _spec(networkPolicy={"enabled": True, "clients": clients})
    policies = _by_kind(render_pool(pool, spec), "NetworkPolicy")
    assert "hetero-gateway" not in policies and "9002" not in json.dumps(policies)


def test_a_pool_invalid_from_its_first_version_reports_no_policy() -> None:
    """Its status names the field (Degraded) and leaves `policy` out: an empty string there was
    null on Kubernetes 1.20, and the whole status write was refused (test_gateway_e2e.py)."""
    doc = load_sample("small.yaml")["spec"]
    doc["router"]["mode"] = "gateway"
    spec, issues = parse_spec(doc, "img")
    assert spec is None
    pool = PoolRef("open", "serving", "0000-uid", 1)
    now = dt.datetime(2026, 1, 2, tzinfo=dt.UTC)
    status = compute_status(pool, None, issues, None, [], None, 0, {}, now)
    assert "policy" not in status
    (cond,) = [c for c in status["conditions"] if c["type"] == "Degraded"]
    assert cond["status"] == "True" and "spec.router.grpc.tokenSecret" in cond["message"]
    # Once a policy was reported, an invalid edit keeps it.
    again = compute_status(pool, None, issues, None, [], None, 0, {"policy": "p2c"}, now)
    assert again["policy"] == "p2c"


def test_a_gateway_without_a_token_is_open_only_behind_the_network_policy() -> None:
    """For gateways that cannot send a token: the ports open on every address, the sidecar's
    config says so in its own words (and parses), and the NetworkPolicy admits the clients."""
    pool, spec = _spec(
        router={"mode": "gateway", "grpc": {"allowUnauthenticated": True}},
        networkPolicy={"enabled": True},
    )
    assert spec.router.grpc_exposed and spec.router.grpc_token is None
    config = yaml.safe_load(render_router_config(pool, spec))
    assert config["grpc"] == {"allow_unauthenticated": True}
    assert config["listen"]["grpc"] == "0.0.0.0:50051"
    parsed = parse_config(config, "sidecar.yaml")
    assert parsed.ext_proc_listen == "0.0.0.0:9002" and parsed.grpc.allow_unauthenticated
    docs = render_pool(pool, spec)
    service = _by_kind(docs, "Service")["hetero-router"]
    assert {p["port"] for p in service["spec"]["ports"]} == {8000, 50051, 9002}
    router_policy = _by_kind(docs, "NetworkPolicy")["hetero-router"]
    ports = {p["port"] for rule in router_policy["spec"]["ingress"] for p in rule["ports"]}
    assert {50051, 9002} <= ports


@pytest.mark.parametrize(
    ("replicas", "books", "elects"),
    [(2, None, True), (1, None, False), (3, {"natsUrl": "nats://nats:4222"}, False)],
)
def test_replicated_gateway_routers_elect_a_leader_on_a_lease_of_their_own(
    replicas: int, books: dict[str, Any] | None, elects: bool
) -> None:
    """Gateway mode with several router replicas and no shared books: active/passive. The
    sidecar's config names the pool's Lease, and the router's Role may read and renew that Lease
    by name and create Leases (create cannot be narrowed by name); nothing else on leases."""
    router: dict[str, Any] = {**GATEWAY, "replicas": replicas}
    if books is not None:
        books = {**books, "tokenSecret": {"name": "nats-auth"}}
        router["sharedBooks"] = books
    pool, spec = _spec(router=router)
    config = yaml.safe_load(render_router_config(pool, spec))
    role = _by_kind(render_pool(pool, spec), "Role")[f"{pool.name}-router"]
    lease_rules = [r for r in role["rules"] if r["apiGroups"] == ["coordination.k8s.io"]]
    docs = render_pool(pool, spec)
    service = _by_kind(docs, "Service")[f"{pool.name}-router"]
    router = _containers(_by_kind(docs, "Deployment")[f"{pool.name}-router"])["router"]
    endpoint_rules = [r for r in role["rules"] if r["resources"] == ["endpoints"]]
    if not elects:  # one replica, or every replica routing on shared books
        assert "leader_election" not in config and lease_rules == [] and endpoint_rules == []
        assert "selector" in service["spec"] and "Endpoints" not in {d["kind"] for d in docs}
        assert router["readinessProbe"]["httpGet"]["path"] == "/readyz"
        return
    lease = f"{pool.name}-router-leader"
    # The leader points the Service's Endpoints at itself, port by the Service's port names.
    ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    assert ports == {"grpc": 50051, "http": 8000, "grpc-epp": 9002}
    assert config["leader_election"] == {
        "namespace": "serving",
        "name": lease,
        "endpoints": {"name": f"{pool.name}-router", "ports": ports},
    }
    parsed = parse_config(config, "sidecar.yaml").leader_election
    assert parsed is not None and parsed.identity == ""  # each replica: its pod's name
    assert parsed.endpoints is not None and dict(parsed.endpoints.ports) == ports
    assert lease_rules == [
        {
            "apiGroups": ["coordination.k8s.io"],
            "resources": ["leases"],
            "resourceNames": [lease],
            "verbs": ["get", "update"],
        },
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
    ]
    assert endpoint_rules == [
        {
            "apiGroups": [""],
            "resources": ["endpoints"],
            "resourceNames": [f"{pool.name}-router"],
            "verbs": ["patch"],
        }
    ]
    # So the Service has no selector, and the operator creates its Endpoints empty: the leader
    # fills them in. Every healthy replica is Ready (a rollout needs Ready pods); the kubelet's
    # probe leaves out the leadership check, and the pod knows its address.
    assert "selector" not in service["spec"]
    (endpoints,) = [d for d in docs if d["kind"] == "Endpoints"]
    assert endpoints["metadata"]["name"] == f"{pool.name}-router" and "subsets" not in endpoints
    assert endpoints["metadata"]["ownerReferences"][0]["kind"] == "DisaggPool"
    assert router["readinessProbe"]["httpGet"]["path"] == "/readyz?exclude=leader"
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in router[
        "env"
    ]
    # The frontdoor mode's replicas all route (a Service spreads requests): no election.
    pool, spec = _spec(router={"replicas": replicas})
    assert "leader_election" not in yaml.safe_load(render_router_config(pool, spec))


def test_the_pools_lease_timings_reach_each_replicas_elector() -> None:
    """`router.leaderElection` sets the Lease's timings in every replica's config; a field left
    out keeps the sidecar's default."""
    timings = {"leaseDurationSeconds": 20, "retryPeriodSeconds": 0.5}
    pool, spec = _spec(router={**GATEWAY, "replicas": 2, "leaderElection": timings})
    config = yaml.safe_load(render_router_config(pool, spec))
    parsed = parse_config(config, "sidecar.yaml").leader_election
    assert parsed is not None
    assert parsed.timings == LeaseTimings(20, LeaseTimings().renew_deadline_s, 0.5)


@pytest.mark.parametrize(
    ("router", "field", "words"),
    [
        # Two replicas could both lead: the holder would step down after the Lease ran out.
        (
            {**GATEWAY, "replicas": 2, "leaderElection": {"leaseDurationSeconds": 8}},
            "router.leaderElection.renewDeadlineSeconds",
            "shorter than leaseDurationSeconds",
        ),
        (
            {**GATEWAY, "leaderElection": {"renewDeadlineSeconds": 3, "retryPeriodSeconds": 3}},
            "router.leaderElection.retryPeriodSeconds",
            "shorter than renewDeadlineSeconds",
        ),
        (
            {**GATEWAY, "leaderElection": {"leaseDurationSeconds": 7.5}},
            "router.leaderElection.leaseDurationSeconds",
            "integer",
        ),
        # Replicas that never elect: every front-door replica routes; so do shared-books ones.
        ({"replicas": 2, "leaderElection": {}}, "router.leaderElection", "gateway-mode"),
        (
            {
                **GATEWAY,
                "replicas": 2,
                "sharedBooks": {"natsUrl": "nats://nats:4222", "tokenSecret": {"name": "t"}},
                "leaderElection": {"leaseDurationSeconds": 6},
            },
            "router.leaderElection",
            "without sharedBooks",
        ),
    ],
)
def test_lease_timings_that_could_not_work_or_would_do_nothing_are_refused(
    router: dict[str, Any], field: str, words: str
) -> None:
    _assert_refused(router, field, words)
