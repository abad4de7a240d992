"""The simulator's view of the pool as the router sees it: snapshots and in-flight accounting.

It plays the sidecar's part: engine gauges as a fresh scrape would report them (running, waiting,
KV tokens in use) plus the router's own accounting of what it sent where, and hands the resulting
`PoolSnapshot` to the very same policy objects the sidecar uses. Called by `sim.cluster` only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from disaggpool.core.contracts import InstanceSnapshot, PoolSnapshot
from disaggpool.core.profile import CalibrationProfile
from disaggpool.engine.decode import DecodeEngine
from disaggpool.engine.prefill import PrefillEngine
from disaggpool.engine.request import EngineRequest

__all__ = ["RouterState"]


class RouterState:
    """Per-instance counters indexed like `prefill + decode` (prefill first)."""

    def __init__(
        self,
        prefill: Sequence[PrefillEngine],
        decode: Sequence[DecodeEngine],
        believed: Mapping[str, CalibrationProfile | None],
    ) -> None:
        self.prefill = list(prefill)
        self.decode = list(decode)
        n = len(self.prefill) + len(self.decode)
        names = [e.name for e in self.prefill] + [e.name for e in self.decode]
        self.profiles = [believed.get(name) for name in names]
        self.inflight = [0] * n
        self.tokens = [0] * n  # prompt tokens of in-flight requests
        self.sq_tokens = [0.0] * n  # squared prompt tokens (prefill queue)
        self.predicted = [0.0] * n  # predicted output tokens of in-flight requests (decode)
        self.served = [0] * n
        self.targets: list[dict[float, int]] = [
            {} for _ in range(n)
        ]  # decode: TPOT target -> count

    def routed(self, req: EngineRequest, p: int, d: int, tpot_target: float) -> None:
        n = req.prompt_tokens
        self.inflight[p] += 1
        self.tokens[p] += n
        self.sq_tokens[p] += n * n
        self.inflight[d] += 1
        self.tokens[d] += n
        self.predicted[d] += req.predicted_output
        self.targets[d][tpot_target] = self.targets[d].get(tpot_target, 0) + 1

    def prefilled(self, req: EngineRequest, p: int) -> None:
        n = req.prompt_tokens
        self.inflight[p] -= 1
        self.tokens[p] -= n
        self.sq_tokens[p] -= n * n
        self.served[p] += 1

    def dropped(self, req: EngineRequest, p: int | None, d: int, tpot_target: float) -> None:
        """An engine refused the request: forget it (p is None when prefill already finished)."""
        if p is not None:
            self.prefilled(req, p)
            self.served[p] -= 1
        self.finished(req, d, tpot_target)
        self.served[d] -= 1

    def finished(self, req: EngineRequest, d: int, tpot_target: float) -> None:
        self.inflight[d] -= 1
        self.tokens[d] -= req.prompt_tokens
        self.predicted[d] -= req.predicted_output
        self.served[d] += 1
        left = self.targets[d][tpot_target] - 1
        if left:
            self.targets[d][tpot_target] = left
        else:
            del self.targets[d][tpot_target]

    def snapshot(self, now: float) -> PoolSnapshot:
        prefill = [
            InstanceSnapshot(
                name=e.name,
                role="prefill",
                running=e.num_running,
                waiting=e.num_waiting,
                kv_tokens_used=e.kv_used,
                inflight=self.inflight[i],
                queued=self.inflight[i],
                queued_tokens=self.tokens[i],
                queued_sq_tokens=self.sq_tokens[i],
                profile=self.profiles[i],
            )
            for i, e in enumerate(self.prefill)
        ]
        base = len(self.prefill)
        decode = []
        for j, e in enumerate(self.decode):
            i = base + j
            running = e.num_running
            kv_used, generated = e.observe(now)
            decode.append(
                InstanceSnapshot(
                    name=e.name,
                    role="decode",
                    running=running,
                    waiting=e.num_waiting,
                    kv_tokens_used=kv_used,
                    inflight=self.inflight[i],
                    queued=self.inflight[i] - running,
                    queued_tokens=self.tokens[i] - e.running_prompt_tokens,
                    remaining_output_tokens=max(float(running), self.predicted[i] - generated),
                    tpot_targets=tuple(sorted(self.targets[i].items())),
                    profile=self.profiles[i],
                )
            )
        return PoolSnapshot(now=now, prefill=prefill, decode=decode)
