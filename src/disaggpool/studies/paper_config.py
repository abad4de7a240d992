"""Sizes of the paper experiment (`disaggpool sim paper`): the full run and the `--quick` one.

`PaperConfig` is read by every part of the experiment (`studies.paper_traces`,
`studies.paper_setup`, `studies.paper_study`, `studies.paper`); it holds sizes and hardware names
only. Its top-level fields size the ``llama8b`` setup and what both setups share (seeds, target
goodput, bisection steps, what the router knows); `StudyConfig` (``PaperConfig.study``) sizes the
``paper`` setup, the study's own configuration. The principles behind the derived constants (SLO
targets, split, operating points) are in `sim.capacity`, `studies.paper_setup` and
`studies.paper_study`.

What ``--quick`` skips (`PaperConfig.quick`): 2-minute trace windows instead of 12 (llama8b)
and 6 (paper), one seed instead of three, 5 bisection steps instead of 8, llama8b's placement
search only over the splits within one prefill instance of the analytic best (instead of every
split), sweeps of at most 400 requests on a subset of their points, GPU counts 5-7 only, and the
paper setup's ablation and both setups' constant-error experiment on trace 0 only.
"""

from __future__ import annotations

import dataclasses

__all__ = ["SETUPS", "PaperConfig", "StudyConfig"]

SETUPS = ("llama8b", "paper")
"""The two setups, in the order of the output document."""


@dataclasses.dataclass(frozen=True)
class StudyConfig:
    """Sizes of the ``paper`` setup (see `studies.paper_study` for why each is what it is)."""

    profile: str = "a40-qwen2.5-3b"
    datasheet: str = "a40-qwen2.5-3b-datasheet"
    split: tuple[int, int] = (2, 4)  # prefill, decode instances
    tight_ttft_s: float = 0.175
    tight_tpot_s: float = 0.0397
    loose_factor: float = 3.0  # the loose SLO level: the tight targets times this
    window_minutes: float = 6.0
    trace_cvs: tuple[float, ...] = (1.0, 1.5, 2.0)
    max_prompt: int = 2048
    max_output: int = 1024
    history: int = 2000
    gpu_counts: tuple[int, ...] = (3, 4, 5, 6, 7, 8)
    ablation_traces: int = 3  # the ablation runs on the first this many traces

    @classmethod
    def quick(cls) -> StudyConfig:
        return cls(window_minutes=2.0, gpu_counts=(5, 6, 7), ablation_traces=1)


@dataclasses.dataclass(frozen=True)
class PaperConfig:
    """Sizes of the experiment; `quick()` is the under-a-minute variant."""

    setups: tuple[str, ...] = SETUPS  # which setups to run
    seeds: tuple[int, ...] = (1, 2, 3)
    target_goodput: float = 0.85  # the operating point: round-robin attains this
    bisection_steps: int = 8
    scrape_interval_s: float = 1.0  # what the router knows: the sidecar's default scrape period
    # --- the llama8b setup
    window_minutes: float = 12.0  # length of each mixed trace
    trace_cvs: tuple[float, ...] = (2.0, 3.0, 4.0)
    gpus: int = 8
    profile: str = "a40-llama3-8b"
    datasheet: str = "a40-llama3-8b-datasheet"
    max_prompt: int = 7168  # lengths are clipped to the 8k context
    max_output: int = 1024
    history: int = 2000  # requests the output-length predictor learns from before a run
    split_window: int | None = None  # None: search every split; k: those within k of analytic
    pool_sizes: tuple[int, ...] = (3, 4, 6, 8, 12, 16)
    heterogeneity: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5)
    scarcity_loads: tuple[float, ...] = (0.75, 1.0, 1.25, 1.5, 2.0, 3.0)
    gpu_counts: tuple[int, ...] = (4, 5, 6, 7, 8)
    sweep_requests: int = 4000
    hardware_spread: tuple[float, ...] = (0.05, 0.15, 0.3)
    error_traces: int = 3  # constant_error (both setups) runs on the first this many traces
    # --- the paper setup
    study: StudyConfig = dataclasses.field(default_factory=StudyConfig)

    def __post_init__(self) -> None:
        unknown = set(self.setups) - set(SETUPS)
        if unknown or not self.setups:
            raise ValueError(f"setups must be a non-empty subset of {SETUPS}, got {self.setups}")

    @classmethod
    def quick(cls) -> PaperConfig:
        return cls(
            window_minutes=2.0,
            seeds=(1,),
            split_window=1,
            pool_sizes=(3, 6, 12),
            heterogeneity=(0.0, 1.0),
            hardware_spread=(0.05, 0.3),
            scarcity_loads=(1.0, 1.5, 3.0),
            gpu_counts=(5, 6, 7),
            sweep_requests=400,
            error_traces=1,
            bisection_steps=5,
            study=StudyConfig.quick(),
        )
