"""What a client of vLLM's prefill/decode protocol sends (`docs/vllm-protocol.md` §2.1), how
long it may keep a connection to a pod, the headers in which our front door names the pods
that served a request, and the names a Gateway API Inference Extension gateway and its endpoint
picker speak in (docs/gateway.md): shared by the picker (`sidecar.epp`), the Envoy configuration
it expects (`sidecar.envoy_config`) and the decode-side `pdproxy`.

The prefill leg carries these `kv_transfer_params`, exactly as vLLM's reference proxy and llm-d's
sidecar send them; the decode leg carries the prefill answer's `kv_transfer_params` unchanged.
Used by the front door (`sidecar.frontdoor`), the probe (`calibration.client`) and the benchmarks.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "DECODE_POD_HEADER",
    "DESTINATION_HEADER",
    "EXT_PROC_SERVICE",
    "LB_NAMESPACE",
    "POD_CONNECTION_REUSE_S",
    "PREFILLER_HEADER",
    "PREFILL_POD_HEADER",
    "SUBSET_KEY",
    "SUBSET_NAMESPACE",
    "VLLM_KEEP_ALIVE_S",
    "prefill_leg_params",
]

#: vLLM's HTTP server closes a connection left idle this long (VLLM_HTTP_TIMEOUT_KEEP_ALIVE).
VLLM_KEEP_ALIVE_S = 5

#: How long our clients reuse an idle pooled connection to a pod. Below vLLM's keep-alive: a
#: request sent down a connection the pod is closing at that moment never arrives, and the
#: client sees a failed leg from a healthy pod (seen in CI against real vLLM: a 502).
POD_CONNECTION_REUSE_S = 3.0

#: Response headers naming the pods that served a request, so that a client (`loadgen --json`)
#: can split its results by pod. No prefill pod on the local path (the decode pod prefilled).
PREFILL_POD_HEADER = "X-Disaggpool-Prefill-Pod"
DECODE_POD_HEADER = "X-Disaggpool-Decode-Pod"

#: Under a gateway: the picker's gRPC service, the header (and `envoy.lb` metadata key) naming a
#: request's destination, the header naming its prefill pod (llm-d's; absent: no remote prefill),
#: and where the gateway's subset hint arrives.
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
DESTINATION_HEADER = "x-gateway-destination-endpoint"
PREFILLER_HEADER = "x-prefiller-host-port"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"


def prefill_leg_params() -> dict[str, Any]:
    """A fresh copy of the prefill leg's `kv_transfer_params`."""
    return {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
