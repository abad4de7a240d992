"""One request of a trace: the record every trace format reads into and writes from.

Its own module because two formats build on it: the CSV formats (`formats.traces`, which also
reads any trace file by its name) and the Mooncake JSON-lines format with prefix blocks
(`formats.mooncake`). Everyone else imports it from `formats.traces`, the trace files' front
door.
"""

from __future__ import annotations

import dataclasses

__all__ = ["TraceRequest"]


@dataclasses.dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace: arrival time (s from trace start), token counts, SLO class, and,
    for traces with prefix structure (`formats.mooncake`, `sim.prefix_workload`), the ids of its
    prompt's blocks of `block_tokens` tokens (the last one may be partial): requests whose leading
    ids agree share that much prompt prefix."""

    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    slo_class: str = ""
    blocks: tuple[int, ...] = ()
    block_tokens: int = 0
