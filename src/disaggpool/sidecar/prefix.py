"""The sidecar's prefix lookups: what each prefill pod holds of a prompt, and what it now holds.

The router (`core.router`) asks its `PrefixSource` both questions; this is the sidecar's, the
core's approximate index (`core.router.ApproximatePrefix`) extended with the pods' own KV events.

A prompt with token ids is cut into block ids (`blocks`: `core.prefix_index.prompt_blocks`, blocks
of the prefill pods' calibrated block size, 16 before any pod has a profile). For each prefill pod
the lookup reads its precise `EventIndex` while that is live (`PoolState.cached_index`), at the
block size its events announce, and the approximate `PrefixIndex` of what was routed there
otherwise. When a pod's source changes, it is logged: a pod falling silent is never read silently
wrong.

After a decision, `remember` books the prompt's blocks on the chosen pod in the approximate
index (bounded by the KV the pod has: its profile's capacity, else its scraped one), counts the
lookup in `disaggpool_prefix_lookup_tokens_total` / `_hit_tokens_total`, and, when the pod
publishes KV events and was sent blocks it did not hold, starts waiting for it to announce them
(`Instance.awaiting_events_since`). Synchronous, like the routing service that calls it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from disaggpool.core.prefix_index import PrefixIndex, prompt_blocks
from disaggpool.core.router import ApproximatePrefix, Request
from disaggpool.sidecar.config import KVEventsSource
from disaggpool.sidecar.metrics import SidecarMetrics
from disaggpool.sidecar.state import PoolState

__all__ = ["DEFAULT_BLOCK_TOKENS", "PrefixLookup"]

log = logging.getLogger("disaggpool.sidecar")

DEFAULT_BLOCK_TOKENS = 16  # vLLM's block size on GPUs, until a pod's profile says otherwise


class PrefixLookup(ApproximatePrefix):
    """Lookups and bookings against the pool's prefix indexes (module docstring)."""

    def __init__(
        self,
        state: PoolState,
        index: PrefixIndex,
        events: KVEventsSource | None,
        metrics: SidecarMetrics,
    ) -> None:
        super().__init__(index, state)
        self.state = state
        self.events = events
        self.metrics = metrics
        self._events_live: dict[str, bool] = {}  # pod -> read from its events at the last lookup

    def blocks(self, token_ids: Sequence[int] | None) -> tuple[tuple[int, ...], int]:
        """The prompt's block ids and their size (none without token ids)."""
        if not token_ids:
            return (), 0
        block_tokens = next(
            (i.profile.block_size for i in self.state.members("prefill") if i.profile is not None),
            DEFAULT_BLOCK_TOKENS,
        )
        return prompt_blocks(token_ids, block_tokens), block_tokens

    def hits(self, request: Request, now: float) -> Mapping[str, int]:
        """Each prefill pod's cached tokens of the prompt (nothing without token ids)."""
        token_ids = request.token_ids
        if not token_ids:
            return {}
        blocks, block_tokens, prompt_tokens = (
            request.blocks,
            request.block_tokens,
            request.prompt_tokens,
        )
        by_size = {block_tokens: blocks}
        hits: dict[str, int] = {}
        for inst in self.state.members("prefill"):
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
                h = self.index.hit_tokens(inst.name, blocks, prompt_tokens, block_tokens)
            if h:
                hits[inst.name] = h
        return hits

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

    def remember(self, pod: str, request: Request, hit: int, capacity: int, now: float) -> None:
        """`pod` now holds the prompt's blocks, as far as the router can know (docstring)."""
        super().remember(pod, request, hit, capacity, now)
        inst = self.state.instances[pod]
        prompt_tokens, block_tokens = request.prompt_tokens, request.block_tokens
        # It will store blocks it did not hold and should say so (`state.cached_index`).
        new_blocks = hit < (prompt_tokens - 1) // block_tokens * block_tokens
        if inst.member.kv_events and new_blocks and inst.awaiting_events_since is None:
            inst.awaiting_events_since = now
        self.metrics.prefix_lookups.labels(pod).inc(prompt_tokens)
        self.metrics.prefix_hits.labels(pod).inc(hit)
