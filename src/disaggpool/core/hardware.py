"""Built-in hardware profiles: Llama-3-8B (BF16, TP1) on A40 and H100, and Qwen2.5-3B on A40.

Two kinds per GPU and model (`ModelShape`), both derived in `docs/hardware-profiles.md` (§2
measured, §3 datasheet, §6 the Qwen2.5-3B pair of the study's configuration, with its 60k-token
KV budget):

* ``<gpu>-<model>`` ("builtin"): what a calibration probe would measure. Roofline shape with
  the *achieved* efficiencies read off Vidur's public operator profiles (A40: 0.56 TB/s, 100
  TFLOPS; H100: 2.4 TB/s, 640 TFLOPS), a scheduler/launch overhead per iteration, and a per-sequence
  CPU cost per decode step (sampling, detokenisation, scheduler bookkeeping: 0.1 ms on the A40
  host, 0.04 ms on the H100 host; an assumption, stated here). KV transfer: NIXL at 20 GB/s (A40,
  PCIe, no NVLink) and 45 GB/s (H100, 400 Gb/s RDMA), plus 2 / 1 ms of setup.
* ``<gpu>-<model>-datasheet`` ("datasheet"): what a simulator hands you without touching the
  hardware: peak FLOPs and peak memory bandwidth, no overheads, nominal link bandwidth, KV capacity
  from memory arithmetic without activation headroom. The "uncalibrated" policy scores with these.

Pure data and arithmetic; `disaggpool profile list/show` prints them in the file format.
"""

from __future__ import annotations

import dataclasses

from disaggpool.core.profile import CalibrationProfile, DecodeModel, KVTransferModel, PrefillModel

__all__ = ["BUILTIN_PROFILES", "LLAMA3_8B", "QWEN25_3B", "ModelShape", "builtin_profile"]

GIB = 1024**3


@dataclasses.dataclass(frozen=True, slots=True)
class ModelShape:
    """What a roofline needs to know of a model (BF16, one GPU)."""

    name: str  # the hub id
    short: str  # the profile name's model part
    weight_bytes: float  # every decode step streams all weights once
    flops_per_token: float  # 2 x non-embedding parameters
    attn_flops_per_token_sq: float  # causal attention: 2 * d_model * layers
    kv_bytes_per_token: int  # layers x KV heads x head size x 2 (K, V) x 2 bytes


LLAMA3_8B = ModelShape(
    "meta-llama/Meta-Llama-3-8B", "llama3-8b", 16.06e9, 13.95e9, 2.6e5, 32 * 8 * 128 * 2 * 2
)
# Qwen2.5-3B: d_model 2048, 36 layers, 16 query / 2 KV heads of 128, MLP 11008, vocabulary
# 151,936 with tied embeddings: 3.09e9 parameters (2.77e9 outside the embedding).
QWEN25_3B = ModelShape(
    "Qwen/Qwen2.5-3B", "qwen2.5-3b", 6.17e9, 5.55e9, 1.47e5, 36 * 2 * 128 * 2 * 2
)


def _measured(
    gpu: str,
    model: ModelShape,
    *,
    bw: float,
    flops: float,
    attn_flops: float,
    overhead: float,
    per_seq: float,
    link: float,
    link_setup: float,
    kv_capacity: int,
    max_num_seqs: int,
    max_batched: int,
    notes: str = "",
) -> CalibrationProfile:
    kv = model.kv_bytes_per_token
    return CalibrationProfile(
        name=f"{gpu}-{model.short}",
        gpu=gpu,
        model=model.name,
        prefill=PrefillModel(
            overhead, model.flops_per_token / flops, model.attn_flops_per_token_sq / attn_flops
        ),
        decode=DecodeModel(overhead + model.weight_bytes / bw, per_seq, kv / bw),
        kv_transfer=KVTransferModel(link_setup, kv, link),
        kv_capacity_tokens=kv_capacity,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_batched,
        source="builtin",
        quality="good",
        notes=notes
        or (
            "roofline, achieved efficiencies from Vidur operator profiles"
            " (docs/hardware-profiles.md §2.3)"
        ),
    )


def _datasheet(
    gpu: str,
    model: ModelShape,
    *,
    bw: float,
    flops: float,
    link: float,
    memory_gib: float,
    max_num_seqs: int,
    max_batched: int,
    kv_capacity: int | None = None,
) -> CalibrationProfile:
    kv = model.kv_bytes_per_token
    usable = memory_gib * GIB * 0.92 - model.weight_bytes  # vLLM 0.33 gpu_memory_utilization
    return CalibrationProfile(
        name=f"{gpu}-{model.short}-datasheet",
        gpu=gpu,
        model=model.name,
        prefill=PrefillModel(
            0.0, model.flops_per_token / flops, model.attn_flops_per_token_sq / flops
        ),
        decode=DecodeModel(model.weight_bytes / bw, 0.0, kv / bw),
        kv_transfer=KVTransferModel(0.0, kv, link),
        kv_capacity_tokens=kv_capacity if kv_capacity is not None else int(usable // kv),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_batched,
        source="datasheet",
        quality="fair",
        notes="peak FLOPs and bandwidth from the datasheet; no measured overheads",
    )


def _a40(model: ModelShape, kv_capacity: int, notes: str = "") -> CalibrationProfile:
    """The A40's achieved rates and overheads (docs/hardware-profiles.md §2.3-2.4)."""
    return _measured(
        "a40",
        model,
        bw=0.56e12,
        flops=100e12,
        attn_flops=70e12,
        overhead=0.003,
        per_seq=1.0e-4,
        link=20e9,
        link_setup=0.002,
        kv_capacity=kv_capacity,
        max_num_seqs=256,
        max_batched=2048,
        notes=notes,
    )


def _a40_datasheet(model: ModelShape, kv_capacity: int | None = None) -> CalibrationProfile:
    """The A40's spec sheet (docs/hardware-profiles.md §3)."""
    return _datasheet(
        "a40",
        model,
        bw=696e9,
        flops=149.7e12,
        link=32e9,
        memory_gib=45.0,
        max_num_seqs=256,
        max_batched=2048,
        kv_capacity=kv_capacity,
    )


#: The study's KV budget per engine (a deployment setting, not the GPU's memory).
STUDY_KV_TOKENS = 60_000

# vLLM 0.33 batch defaults (docs/vllm-protocol.md §1.4): A40-class 256 seqs / 2048 tokens,
# H100-class 1024 / 8192.
BUILTIN_PROFILES: dict[str, CalibrationProfile] = {
    p.name: p
    for p in (
        _a40(LLAMA3_8B, 190_000),
        _measured(
            "h100",
            LLAMA3_8B,
            bw=2.4e12,
            flops=640e12,
            attn_flops=450e12,
            overhead=0.0015,
            per_seq=4.0e-5,
            link=45e9,
            link_setup=0.001,
            kv_capacity=450_000,
            max_num_seqs=1024,
            max_batched=8192,
        ),
        _a40(
            QWEN25_3B,
            STUDY_KV_TOKENS,
            (
                "the study's hardware: roofline with the A40's achieved efficiencies, 60k-token"
                " KV budget (docs/hardware-profiles.md §6)"
            ),
        ),
        _a40_datasheet(LLAMA3_8B),
        _datasheet(
            "h100",
            LLAMA3_8B,
            bw=3.35e12,
            flops=989e12,
            link=50e9,
            memory_gib=79.6,
            max_num_seqs=1024,
            max_batched=8192,
        ),
        _a40_datasheet(QWEN25_3B, STUDY_KV_TOKENS),
    )
}


def builtin_profile(name: str) -> CalibrationProfile:
    """A built-in profile by name; KeyError lists the valid names."""
    try:
        return BUILTIN_PROFILES[name]
    except KeyError:
        raise KeyError(
            f"unknown built-in profile {name!r}; valid: {', '.join(BUILTIN_PROFILES)}"
        ) from None
