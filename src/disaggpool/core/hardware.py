"""Built-in hardware profiles for Llama-3-8B (BF16, TP1) on A40 and H100, measured and datasheet.

Two kinds per GPU, both derived in `docs/hardware-profiles.md` (§2 measured, §3 datasheet):

* ``<gpu>-llama3-8b`` ("builtin"): what a calibration probe would measure. Roofline shape with
  the *achieved* efficiencies read off Vidur's public operator profiles (A40: 0.56 TB/s, 100
  TFLOPS; H100: 2.4 TB/s, 640 TFLOPS), a scheduler/launch overhead per iteration, and a per-sequence
  CPU cost per decode step (sampling, detokenisation, scheduler bookkeeping: 0.1 ms on the A40
  host, 0.04 ms on the H100 host; an assumption, stated here). KV transfer: NIXL at 20 GB/s (A40,
  PCIe, no NVLink) and 45 GB/s (H100, 400 Gb/s RDMA), plus 2 / 1 ms of setup.
* ``<gpu>-llama3-8b-datasheet`` ("datasheet"): what a simulator hands you without touching the
  hardware: peak FLOPs and peak memory bandwidth, no overheads, nominal link bandwidth, KV capacity
  from memory arithmetic without activation headroom. The "uncalibrated" policy scores with these.

Pure data and arithmetic; `disaggpool profile list/show` prints them in the file format.
"""

from __future__ import annotations

from disaggpool.core.profile import CalibrationProfile, DecodeModel, KVTransferModel, PrefillModel

__all__ = ["BUILTIN_PROFILES", "builtin_profile"]

GIB = 1024**3
MODEL = "meta-llama/Meta-Llama-3-8B"
WEIGHT_BYTES = 16.06e9
FLOPS_PER_TOKEN = 13.95e9  # 2 x non-embedding parameters
ATTN_FLOPS_PER_TOKEN_SQ = 2.6e5  # causal attention, 2 * d_model * layers
KV_BYTES_PER_TOKEN = 128 * 1024  # 32 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes


def _measured(
    gpu: str,
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
) -> CalibrationProfile:
    return CalibrationProfile(
        name=f"{gpu}-llama3-8b",
        gpu=gpu,
        model=MODEL,
        prefill=PrefillModel(
            overhead, FLOPS_PER_TOKEN / flops, ATTN_FLOPS_PER_TOKEN_SQ / attn_flops
        ),
        decode=DecodeModel(overhead + WEIGHT_BYTES / bw, per_seq, KV_BYTES_PER_TOKEN / bw),
        kv_transfer=KVTransferModel(link_setup, KV_BYTES_PER_TOKEN, link),
        kv_capacity_tokens=kv_capacity,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_batched,
        source="builtin",
        quality="good",
        notes=(
            "roofline, achieved efficiencies from Vidur operator profiles"
            " (docs/hardware-profiles.md §2.3)"
        ),
    )


def _datasheet(
    gpu: str,
    *,
    bw: float,
    flops: float,
    link: float,
    memory_gib: float,
    max_num_seqs: int,
    max_batched: int,
) -> CalibrationProfile:
    usable = memory_gib * GIB * 0.92 - WEIGHT_BYTES  # vLLM 0.33 gpu_memory_utilization default
    return CalibrationProfile(
        name=f"{gpu}-llama3-8b-datasheet",
        gpu=gpu,
        model=MODEL,
        prefill=PrefillModel(0.0, FLOPS_PER_TOKEN / flops, ATTN_FLOPS_PER_TOKEN_SQ / flops),
        decode=DecodeModel(WEIGHT_BYTES / bw, 0.0, KV_BYTES_PER_TOKEN / bw),
        kv_transfer=KVTransferModel(0.0, KV_BYTES_PER_TOKEN, link),
        kv_capacity_tokens=int(usable // KV_BYTES_PER_TOKEN),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_batched,
        source="datasheet",
        quality="fair",
        notes="peak FLOPs and bandwidth from the datasheet; no measured overheads",
    )


# vLLM 0.33 batch defaults (docs/vllm-protocol.md §1.4): A40-class 256 seqs / 2048 tokens,
# H100-class 1024 / 8192.
BUILTIN_PROFILES: dict[str, CalibrationProfile] = {
    p.name: p
    for p in (
        _measured(
            "a40",
            bw=0.56e12,
            flops=100e12,
            attn_flops=70e12,
            overhead=0.003,
            per_seq=1.0e-4,
            link=20e9,
            link_setup=0.002,
            kv_capacity=190_000,
            max_num_seqs=256,
            max_batched=2048,
        ),
        _measured(
            "h100",
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
        _datasheet(
            "a40",
            bw=696e9,
            flops=149.7e12,
            link=32e9,
            memory_gib=45.0,
            max_num_seqs=256,
            max_batched=2048,
        ),
        _datasheet(
            "h100",
            bw=3.35e12,
            flops=989e12,
            link=50e9,
            memory_gib=79.6,
            max_num_seqs=1024,
            max_batched=8192,
        ),
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
