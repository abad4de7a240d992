"""The sidecar's prefix lookups: what each prefill pod holds of a prompt, and what it now holds.

A prompt with token ids is cut into block ids (`core.prefix_index.prompt_blocks`, blocks of the
prefill pods' calibrated block size, 16 before any pod has a profile). For each prefill pod the
lookup reads its precise `EventIndex` while that is live (`PoolState.cached_index`), at the block
size its events announce, and the approximate `PrefixIndex` of what was routed there otherwise.
When a pod's source changes, it is logged: a pod falling silent is never read silently wrong.

After a decision, `remember` books the prompt's blocks on the chosen pod in the approximate
index (bounded by the KV the pod has: its profile's capacity, else its scraped one), counts the
lookup in `disaggpool_prefix_lookup_tokens_total` / `_hit_tokens_total`, and, when the pod
publishes KV events and was sent blocks it did not hold, starts waiting for it to announce them
(`Instance.awaiting_events_since`). Synchronous, like the routing service that calls it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

from disaggpool.core.prefix_index import prompt_blocks
from disaggpool.sidecar.config import KVEventsSource
from disaggpool.sidecar.metrics import SidecarMetrics
from disaggpool.sidecar.state import PoolState

__all__ = ["DEFAULT_BLOCK_TOKENS", "PrefixLookup"]

log = logging.getLogger("disaggpool.sidecar")

DEFAULT_BLOCK_TOKENS = 16  # vLLM's block size on GPUs, until a pod's profile says otherwise


class PrefixLookup:
    """Lookups and bookings against the pool's prefix indexes (module docstring)."""

    def __init__(
        self,
        state: PoolState,
        events: KVEventsSource | None,
        metrics: SidecarMetrics,
        clock: Callable[[], float],
    ) -> None:
        self.state = state
        self.events = events
        self.metrics = metrics
        self.clock = clock
        self._events_live: dict[str, bool] = {}  # pod -> read from its events at the last lookup

    def lookup(
        self, prompt_tokens: int, token_ids: Sequence[int] | None
    ) -> tuple[tuple[int, ...], int, Mapping[str, int]]:
        """The prompt's block ids, their size, and each prefill pod's cached tokens of it
        (nothing without an index or token ids)."""
        index = self.state.prefix
        if index is None or not token_ids:
            return (), 0, {}
        pods = self.state.members("prefill")
        block_tokens = next(
            (i.profile.block_size for i in pods if i.profile is not None), DEFAULT_BLOCK_TOKENS
        )
        blocks = prompt_blocks(token_ids, block_tokens)
        by_size = {block_tokens: blocks}
        now = self.clock()
        hits: dict[str, int] = {}
        for inst in pods:
            live = None
            if self.events is not None and inst.member.kv_events:
                live = self.state.cached_index(inst.name, now, self.events.stale_after_s)
                self._note_source(inst.name, live is not None, inst.events_at >= 0)
            if live is not None:
                size = live.block_tokens
                if size not in by_size:
                    by_size[size] = prompt_blocks(token_ids, size)
                h = live.hit_tokens(by_size[size], prompt_tokens)
            else:
                h = index.hit_tokens(inst.name, blocks, prompt_tokens, block_tokens)
            if h:
                hits[inst.name] = h
        return blocks, block_tokens, hits

    def _note_source(self, pod: str, live: bool, heard: bool) -> None:
        """Say when a pod's index switches between its events and the approximate one."""
        was = self._events_live.get(pod)
        self._events_live[pod] = live
        if was is None or was == live:
            return
        if live:
            log.info("pod %s: KV events heard again, reading its prefix index from them", pod)
        elif heard:
            log.warning(
                "pod %s: no KV events since it was sent new prompt blocks: falling back to "
                "the approximate prefix index",
                pod,
            )

    def remember(
        self, pod: str, blocks: tuple[int, ...], prompt_tokens: int, block_tokens: int, hit: int
    ) -> None:
        """`pod` now holds the prompt's blocks, as far as the router can know (docstring)."""
        assert self.state.prefix is not None
        inst = self.state.instances[pod]
        capacity = inst.profile.kv_capacity_tokens if inst.profile is not None else 0
        if not capacity and inst.gauges is not None:
            capacity = inst.gauges.kv_capacity_tokens
        self.state.prefix.record(
            pod, blocks, prompt_tokens, block_tokens, capacity or prompt_tokens
        )
        # It will store blocks it did not hold and should say so (`state.cached_index`).
        new_blocks = hit < (prompt_tokens - 1) // block_tokens * block_tokens
        if inst.member.kv_events and new_blocks and inst.awaiting_events_since is None:
            inst.awaiting_events_since = self.clock()
        self.metrics.prefix_lookups.labels(pod).inc(prompt_tokens)
        self.metrics.prefix_hits.labels(pod).inc(hit)
