"""The mutable per-request record the engine model and the simulator share.

It holds the truth (the real output length) next to what the router was told (the prediction)
and the timestamps the engines stamp on it. Only `engine` and `sim` touch it; the router sees
`core.contracts.RequestFeatures`.

`queue_for` is the one rule both engines order their waiting requests by: vLLM's
`--scheduling-policy fcfs` (arrival order) or `priority` (lower `priority` first, then arrival).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Literal

__all__ = [
    "SCHEDULING_POLICIES",
    "EngineRequest",
    "SchedulingPolicy",
    "queue_for",
    "requeue_preempted",
]

SchedulingPolicy = Literal["fcfs", "priority"]
SCHEDULING_POLICIES: tuple[SchedulingPolicy, ...] = ("fcfs", "priority")


@dataclasses.dataclass(slots=True, eq=False)
class EngineRequest:
    """One request's life through a prefill and a decode engine (times in seconds)."""

    index: int
    arrival: float
    prompt_tokens: int
    output_tokens: int
    slo_class: str
    predicted_output: float = 0.0
    prefill_instance: str = ""
    decode_instance: str = ""
    prefill_done: float = -1.0
    first_token: float = -1.0
    finish: float = -1.0
    preemptions: int = 0
    # decode-engine bookkeeping
    join_step: int = 0
    finish_step: int = 0
    generated: int = 0  # tokens already produced before a preemption
    recompute: bool = False
    rejected: bool = False  # an engine refused it (prompt longer than it can ever hold)
    shed: bool = False  # the router refused it (a sheddable class that would miss its SLO)
    key: str = ""  # the request id a router knows it by (str(index) unless set)
    blocks: tuple[int, ...] = ()  # prompt block ids, when the trace has them (prefix caching)
    block_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens its prefill instance found in its prefix cache
    decode_cached_tokens: int = 0  # ... its decode instance found in its own, at admission
    priority: int = 0  # vLLM's request priority (lower first; only under priority scheduling)

    def __post_init__(self) -> None:
        if not self.key:
            self.key = str(self.index)

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def tpot(self) -> float:
        """Mean time per output token after the first (0 for one-token outputs)."""
        if self.output_tokens <= 1:
            return 0.0
        return (self.finish - self.first_token) / (self.output_tokens - 1)


def queue_for(
    queue: deque[EngineRequest], req: EngineRequest, policy: SchedulingPolicy, *, start: int = 0
) -> None:
    """Put `req` into a waiting `queue` whose first `start` entries have begun (they keep their
    place): at the back under ``fcfs``; under ``priority`` after every request of equal or lower
    `priority`, as it arrived last."""
    if policy == "fcfs":
        queue.append(req)
        return
    i = len(queue)
    while i > start and queue[i - 1].priority > req.priority:
        i -= 1
    queue.insert(i, req)


def requeue_preempted(
    queue: deque[EngineRequest], req: EngineRequest, policy: SchedulingPolicy
) -> None:
    """Put a preempted sequence back at the head of `queue` (it arrived before those waiting);
    under ``priority`` behind those of a lower `priority`."""
    if policy == "fcfs":
        queue.appendleft(req)
        return
    i = 0
    while i < len(queue) and queue[i].priority < req.priority:
        i += 1
    queue.insert(i, req)
