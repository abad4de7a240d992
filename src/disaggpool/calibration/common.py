"""The calibration probe's shared vocabulary: its configuration, its error, the pod it discovered,
what its stages measured, and its result.

Plain data, no I/O: `client` and `stages` (which measure) and `assemble` (pure, which fits and
reports) all speak it; `probe` re-exports `ProbeConfig`, `ProbeError` and `ProbeResult` for
`disaggpool calibrate`, the tests and `bench/probe_accuracy.py`.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Sequence
from typing import Any

from disaggpool.calibration import fit
from disaggpool.core.profile import CalibrationProfile

__all__ = [
    "Measured",
    "Pod",
    "ProbeConfig",
    "ProbeError",
    "ProbeResult",
    "Progress",
    "RequestPath",
]

#: Called with (stage, done, total) after every measurement of a stage.
Progress = Callable[[str, int, int], None]


class ProbeError(RuntimeError):
    """The pod could not be probed (unreachable, errors, or too few measurements)."""


@dataclasses.dataclass(frozen=True)
class ProbeConfig:
    endpoint: str
    role: str = "decode"
    peer: str | None = None
    name: str = "probed"
    budget_s: float = 60.0
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    kv_bytes_per_token: int = 128 * 1024
    gpu: str = ""
    request_timeout_s: float = 60.0
    # Prompts are drawn from this seed. A fresh one per run by default: with a fixed seed a
    # re-probe would send the very prompts its predecessor left in the pod's prefix cache and
    # fit the cache, not the hardware. The report records it; pass it back to reproduce a run.
    seed: int = dataclasses.field(default_factory=lambda: random.SystemRandom().randrange(2**32))
    # Poll instead of sleeping while waiting for answers (`precise_loop.BusyPollSelector`):
    # sub-millisecond constants come out right on virtual machines whose idle CPUs wake slowly,
    # at the price of one busy core for the probe's duration. Not in a process it shares.
    busy_poll: bool = False
    # vLLM's --api-key, sent as `Authorization: Bearer` on every request (its /v1 routes need
    # it); `disaggpool calibrate` reads it from $DISAGGPOOL_API_KEY. Kept out of repr and reports.
    api_key: str = dataclasses.field(default="", repr=False)


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    profile: CalibrationProfile
    report: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Pod:
    """What discovery learnt of a pod: `/v1/models` and `vllm:cache_config_info`."""

    url: str
    model: str
    max_model_len: int
    kv_capacity_tokens: int
    block_size: int
    prefix_caching: bool = False  # `enable_prefix_caching` of its cache_config_info


@dataclasses.dataclass(frozen=True)
class RequestPath:
    """The cost of the request path outside the engine, which every measured TTFT includes:
    `base_s + per_token_s * prompt_tokens`."""

    source: str  # how it was measured: "rejected twin requests" or "/tokenize round trip"
    base_s: float
    per_token_s: float
    samples: int  # rejected twins timed (fewer than needed when the source is /tokenize)


@dataclasses.dataclass(frozen=True)
class Measured:
    """Everything the stages measured on one pod (TTFTs as the probe saw them, request path
    included, until `assemble.net_of_request_path`)."""

    prefill: Sequence[fit.PrefillSample]
    transfer: Sequence[fit.TransferSample]
    decode: Sequence[fit.DecodeSample]
    decode_timed_by_server: int  # decode samples read off the server's inter-token histogram
    request_path: RequestPath
    # Prefills of prompts whose leading blocks the pod had cached (none without prefix caching):
    # they check the prefill model's credit for a cache hit, they are not fitted.
    partial_prefill: Sequence[fit.PrefillSample] = ()
