"""What a client of vLLM's prefill/decode protocol sends (`docs/vllm-protocol.md` §2.1).

The prefill leg carries these `kv_transfer_params`, exactly as vLLM's reference proxy and llm-d's
sidecar send them; the decode leg carries the prefill answer's `kv_transfer_params` unchanged.
Used by the front door (`sidecar.frontdoor`), the probe (`calibration.client`) and the benchmarks.
"""

from __future__ import annotations

from typing import Any

__all__ = ["prefill_leg_params"]


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
