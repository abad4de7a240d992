"""Sizes of the paper experiment (`disaggpool sim paper`): the full run and the `--quick` one.

`PaperConfig` is read by every part of the experiment (`sim.paper_traces`, `sim.paper_setup`,
`sim.paper`); it holds sizes and the hardware names only. The principles behind the derived
constants (SLO targets, split, operating points) are in `sim.capacity` and `sim.paper_setup`.
"""

from __future__ import annotations

import dataclasses

__all__ = ["PaperConfig"]


@dataclasses.dataclass(frozen=True)
class PaperConfig:
    """Sizes of the experiment; `quick()` is the under-a-minute variant."""

    window_minutes: float = 12.0  # length of each mixed trace
    seeds: tuple[int, ...] = (1, 2, 3)
    target_goodput: float = 0.85  # the operating point: round-robin attains this
    bisection_steps: int = 8
    gpus: int = 8
    profile: str = "a40-llama3-8b"
    datasheet: str = "a40-llama3-8b-datasheet"
    max_prompt: int = 7168  # lengths are clipped to the 8k context
    max_output: int = 1024
    history: int = 2000  # requests the output-length predictor learns from before a run
    pool_sizes: tuple[int, ...] = (3, 4, 6, 8, 12, 16)
    heterogeneity: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5)
    scarcity_loads: tuple[float, ...] = (0.75, 1.0, 1.25, 1.5, 2.0, 3.0)
    gpu_counts: tuple[int, ...] = (4, 5, 6, 7, 8)
    sweep_requests: int = 4000
    hardware_spread: tuple[float, ...] = (0.05, 0.15, 0.3)

    @classmethod
    def quick(cls) -> PaperConfig:
        return cls(
            window_minutes=3.0,
            seeds=(1,),
            pool_sizes=(3, 6, 12),
            heterogeneity=(0.0, 1.0),
            hardware_spread=(0.05, 0.3),
            scarcity_loads=(1.0, 1.5, 3.0),
            gpu_counts=(5, 6, 7),
            sweep_requests=900,
            bisection_steps=6,
        )
