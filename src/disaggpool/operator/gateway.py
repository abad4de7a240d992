"""Gateway mode (``router.mode: gateway``): what a pool adds for a Gateway API Inference Extension
gateway (pure; docs/gateway-kubernetes.md).

In gateway mode a gateway (Envoy) routes the clients' requests, asking the pool's router which
decode pod to send each one to over Envoy's ext_proc protocol: the router is the pool's endpoint
picker. This module renders

* the InferencePool (``inference.networking.k8s.io/v1``) that tells the gateway which pods form
  the pool (the decode pods: a request's destination is always a decode pod, its prefill host
  travels in a header), on which port (the pd-proxy's) and whom to ask (the router's Service,
  its ext_proc port);
* the ``pd-proxy`` container beside each decode engine: it runs the prefill leg on the prefill
  pod the router named and then the decode leg against its own pod's vLLM, as the front door does
  (``disaggpool pd-proxy``);
* the router's extra config: its ext_proc listener and the destination port it names.

`render` calls these; `access` opens the ports in the pool's NetworkPolicies. The InferencePool
kind is GIE's; a cluster installs GIE's own CRD (tests install one written for the test API
server: tests/operator/fixtures/inferencepool-crd.yaml).
"""

from __future__ import annotations

from typing import Any

from disaggpool.operator.names import (
    EPP_PORT,
    PD_PROXY_PORT,
    PoolRef,
    decode_selector,
    pool_labels,
    router_name,
)
from disaggpool.operator.spec import PoolSpec

__all__ = [
    "INFERENCE_POOL_API_VERSION",
    "PD_PROXY_CONTAINER",
    "inference_pool",
    "pd_proxy_container",
    "router_gateway_config",
    "router_ports",
]

INFERENCE_POOL_API_VERSION = "inference.networking.k8s.io/v1"
PD_PROXY_CONTAINER = "pd-proxy"
# Port names are IANA service names (at most 15 characters); "grpc" first so that meshes which
# read the protocol from the name (and not appProtocol) treat the port as gRPC.
EPP_PORT_NAME, PD_PROXY_PORT_NAME = "grpc-epp", "pd-proxy"


def inference_pool(pool: PoolRef, spec: PoolSpec) -> dict[str, Any]:
    """The pool's InferencePool: its decode pods, the pd-proxy port, the router as the picker.

    Named after the pool, so that an HTTPRoute's backendRef names the pool the user created.
    FailClose: with the picker unreachable the gateway refuses requests rather than spreading
    them without the router's bookkeeping (and without a prefill host: every one would prefill
    on its decode pod)."""
    return {
        "apiVersion": INFERENCE_POOL_API_VERSION,
        "kind": "InferencePool",
        "metadata": {"name": pool.name, "labels": pool_labels(pool, "inference-pool")},
        "spec": {
            "selector": {"matchLabels": decode_selector(pool)},
            "targetPorts": [{"number": PD_PROXY_PORT}],
            "endpointPickerRef": {
                "kind": "Service",
                "name": router_name(pool),
                "port": {"number": EPP_PORT},
                "failureMode": "FailClose",
            },
        },
    }


def router_gateway_config() -> tuple[dict[str, str], dict[str, Any]]:
    """(extra `listen` entries, the `gateway` section) of the router's config in gateway mode:
    ext_proc on every address (its auth is the gRPC port's: the token, or none behind the
    NetworkPolicy with `grpc.allowUnauthenticated`, one of which gateway mode requires), and
    destinations on the decode pods' pd-proxy port instead of vLLM's."""
    return {"ext_proc": f"0.0.0.0:{EPP_PORT}"}, {"destination_port": PD_PROXY_PORT}


def router_ports() -> tuple[dict[str, Any], dict[str, Any]]:
    """(container port, Service port) of the router's ext_proc listener. appProtocol (GA in
    Kubernetes 1.20) tells the gateway to speak HTTP/2 to it."""
    return (
        {"name": EPP_PORT_NAME, "containerPort": EPP_PORT},
        {
            "name": EPP_PORT_NAME,
            "port": EPP_PORT,
            "targetPort": EPP_PORT_NAME,
            "appProtocol": "grpc",
        },
    )


def pd_proxy_container(
    spec: PoolSpec,
    *,
    key_file: str | None,
    key_mount: dict[str, Any] | None,
    security_context: dict[str, Any],
) -> dict[str, Any]:
    """The pd-proxy beside a decode engine: listens on the InferencePool's target port, prefills
    on the host the router put in ``x-prefiller-host-port`` and decodes on this pod's vLLM.

    With the pool's API key (`key_file`, mounted by `key_mount`) it requires the key of its
    clients and sends it to both legs, as the router does; without one the pool's HTTP API is
    open anyway (vLLM's own port is), and the flag says so explicitly."""
    args = [
        "pd-proxy",
        "--listen",
        f"0.0.0.0:{PD_PROXY_PORT}",
        "--model-server",
        f"http://127.0.0.1:{spec.engine.port}",
    ]
    if key_file is not None:
        args += ["--api-keys-file", key_file, "--upstream-api-key-file", key_file]
    else:
        args.append("--allow-unauthenticated")
    container: dict[str, Any] = {
        "name": PD_PROXY_CONTAINER,
        "image": spec.router.image,
        "command": ["disaggpool"],
        "args": args,
        "ports": [{"name": PD_PROXY_PORT_NAME, "containerPort": PD_PROXY_PORT, "protocol": "TCP"}],
        # /health proxies the local vLLM's: the gateway gets the pod only once both are up.
        "readinessProbe": {
            "httpGet": {"path": "/health", "port": PD_PROXY_PORT_NAME},
            "periodSeconds": 5,
            "timeoutSeconds": 5,
            "failureThreshold": 3,
        },
        # Liveness asks only whether the proxy still accepts connections, never the vLLM behind it
        # (whose own probes restart it): a loading engine must not restart its proxy.
        "livenessProbe": {
            "tcpSocket": {"port": PD_PROXY_PORT_NAME},
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 3,
        },
        # It holds a request body and the prefill leg's answer at a time: small and steady.
        "resources": {
            "requests": {"cpu": "250m", "memory": "128Mi"},
            "limits": {"memory": "512Mi"},
        },
        "securityContext": security_context,
    }
    if key_mount is not None:
        container["volumeMounts"] = [key_mount]
    return container
