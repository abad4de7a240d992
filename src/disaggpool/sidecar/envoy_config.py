"""A static Envoy configuration that puts the router's endpoint picker in front of a pool.

`envoy_config` returns the document (a dict; `render` gives its YAML): one listener whose HTTP
connection manager runs Envoy's external-processing filter against the picker (`sidecar.epp`),
then the router filter to a cluster that sends each request where the picker said:

* ext_proc: headers and trailers sent both ways, request and response bodies in
  ``FULL_DUPLEX_STREAMED`` mode (what the inference-extension protocol asks for), the
  ``envoy.lb`` and ``envoy.lb.subset_hint`` metadata namespaces forwarded to the picker and
  ``envoy.lb`` taken back from it; `failure_mode_allow` false (a request the picker did not
  decide is refused, never sent anywhere: docs/gateway.md says what the client gets);
* the picker's cluster: HTTP/2 to its `listen.ext_proc` address, each stream carrying
  ``authorization: Bearer <token>`` when a token is given (the sidecar's `grpc.token_file`),
  health-checked with the gRPC health service on the ext_proc service's name. `more_pickers`
  lists further replicas: with active/passive pickers (docs/high-availability.md) only the
  leader answers SERVING, so Envoy opens its streams there, and on the replica that takes over
  within a health-check interval or two of the handover;
* the pool: an ``ORIGINAL_DST`` cluster reading its destination from the request header
  ``x-gateway-destination-endpoint`` the picker sets (it must be an IP and a port);
* an admin port, on loopback.

`subset_hint` (optional) stands in for a gateway that limits the picker to some endpoints: it
sets the ``envoy.lb.subset_hint`` metadata on every request (the tests use it; a conformant
gateway computes it). `examples/envoy-gateway.yaml` is this module's output for the defaults.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import yaml

from disaggpool.pdwire import DESTINATION_HEADER, EXT_PROC_SERVICE, SUBSET_KEY

__all__ = ["envoy_config", "render"]

_T = "type.googleapis.com/envoy.extensions."


def _address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def envoy_config(
    *,
    listen_port: int = 10000,
    listen_host: str = "127.0.0.1",
    epp_host: str = "127.0.0.1",
    epp_port: int = 9002,
    more_pickers: Sequence[tuple[str, int]] = (),
    admin_port: int = 9901,
    token: str = "",
    route_timeout_s: float = 600.0,
    health_check: bool = True,
    health_interval_s: float = 10.0,
    subset_hint: Sequence[str] | None = None,
    body_mode: str = "FULL_DUPLEX_STREAMED",
) -> dict[str, Any]:
    """The Envoy bootstrap (module docstring). `route_timeout_s`: the longest answer, keep it
    at the sidecar's `upstream_timeouts.total_s` (Envoy's own default of 15 s would cut long
    generations). `body_mode`: ``BUFFERED`` also works with the picker (Envoy then holds each
    body whole, a streamed answer included, before passing it on). `health_interval_s`: how
    often Envoy asks each picker's health, so how soon it follows a handover."""
    if body_mode not in ("FULL_DUPLEX_STREAMED", "BUFFERED"):
        raise ValueError(f"body_mode: FULL_DUPLEX_STREAMED or BUFFERED, got {body_mode!r}")
    grpc_service: dict[str, Any] = {
        "envoy_grpc": {"cluster_name": "epp"},
        # A stream that never reached a picker (its connection refused: a picker just gone)
        # is tried once more, on another where there is one: nothing was decided, so nothing
        # is decided twice.
        "retry_policy": {
            "retry_on": "connect-failure,refused-stream",
            "num_retries": 1,
            "retry_back_off": {"base_interval": "0.025s", "max_interval": "0.25s"},  # not 1 s
            "retry_host_predicate": [
                {
                    "name": "envoy.retry_host_predicates.previous_hosts",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.retry.host."
                        "previous_hosts.v3.PreviousHostsPredicate"
                    },
                }
            ],
            "host_selection_retry_max_attempts": 3,
        },
    }
    interval = f"{health_interval_s:g}s"
    if token:
        grpc_service["initial_metadata"] = [{"key": "authorization", "value": f"Bearer {token}"}]
    ext_proc = {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": f"{_T}filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": grpc_service,
            "failure_mode_allow": False,
            "processing_mode": {
                "request_header_mode": "SEND",
                "response_header_mode": "SEND",
                "request_body_mode": body_mode,
                "response_body_mode": body_mode,
                "request_trailer_mode": "SEND",
                "response_trailer_mode": "SEND",
            },
            "metadata_options": {
                "forwarding_namespaces": {"untyped": ["envoy.lb", "envoy.lb.subset_hint"]},
                "receiving_namespaces": {"untyped": ["envoy.lb"]},
            },
        },
    }
    filters: list[dict[str, Any]] = [ext_proc]
    if subset_hint is not None:
        filters.insert(
            0,
            {
                "name": "envoy.filters.http.set_metadata",
                "typed_config": {
                    "@type": f"{_T}filters.http.set_metadata.v3.Config",
                    "metadata": [
                        {
                            "metadata_namespace": "envoy.lb.subset_hint",
                            "value": {SUBSET_KEY: list(subset_hint)},
                        }
                    ],
                },
            },
        )
    filters.append(
        {
            "name": "envoy.filters.http.router",
            "typed_config": {"@type": f"{_T}filters.http.router.v3.Router"},
        }
    )
    timeout = f"{route_timeout_s:g}s"
    route = {"match": {"prefix": "/"}, "route": {"cluster": "pool", "timeout": timeout}}
    manager = {
        "name": "envoy.filters.network.http_connection_manager",
        "typed_config": {
            "@type": f"{_T}filters.network.http_connection_manager.v3.HttpConnectionManager",
            "stat_prefix": "gateway",
            "route_config": {
                "name": "pool",
                "virtual_hosts": [
                    {
                        "name": "pool",
                        "domains": ["*"],
                        "routes": [route],
                    }
                ],
            },
            "http_filters": filters,
        },
    }
    epp: dict[str, Any] = {
        "name": "epp",
        "type": "STATIC",
        "connect_timeout": "1s",
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": f"{_T}upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
        "load_assignment": {
            "cluster_name": "epp",
            "endpoints": [
                {
                    "lb_endpoints": [
                        {"endpoint": {"address": _address(host, port)}}
                        for host, port in ((epp_host, epp_port), *more_pickers)
                    ]
                }
            ],
        },
    }
    if more_pickers:
        # A picker that refused a connection is left out at once, not after the health checks:
        # the retry above then finds another.
        epp["outlier_detection"] = {
            "split_external_local_origin_errors": True,
            "consecutive_local_origin_failure": 1,
            "max_ejection_percent": 100,
        }
    if health_check:
        epp["health_checks"] = [
            {
                "timeout": "2s",
                "interval": interval,
                "no_traffic_interval": interval,  # Envoy's default, 60 s, would hold a handover
                "unhealthy_threshold": 3,
                "healthy_threshold": 1,
                "grpc_health_check": {"service_name": EXT_PROC_SERVICE},
            }
        ]
    pool = {
        "name": "pool",
        "type": "ORIGINAL_DST",
        "lb_policy": "CLUSTER_PROVIDED",
        "connect_timeout": "5s",
        "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION_HEADER},
    }
    return {
        "admin": {"address": _address("127.0.0.1", admin_port)},
        "static_resources": {
            "listeners": [
                {
                    "name": "gateway",
                    "address": _address(listen_host, listen_port),
                    "filter_chains": [{"filters": [manager]}],
                }
            ],
            "clusters": [epp, pool],
        },
    }


def render(config: dict[str, Any]) -> str:
    """The configuration as YAML, keys in the order written."""
    return yaml.safe_dump(config, sort_keys=False, default_flow_style=False)
