"""Synthetic traffic whose prompts share prefixes: tenants' system prompts, shared documents and
multi-turn sessions whose prompt grows with every turn.

Real traffic reuses prompt prefixes: every request of a tenant starts with its system prompt, a
retrieval-augmented request carries one of a few popular documents, and each turn of a
conversation resends the whole conversation so far. `prefix_sessions` builds such a trace, with
the prompt of every request described by the ids of its blocks (`TraceRequest.blocks`, the
Mooncake convention of `formats.mooncake`: equal ids, equal content up to the end of that block).

A request is turn k of a session of one tenant: its prompt is

    system prompt (the tenant's) + document (optional, one per session) +
    message 1 + reply 1 + ... + reply k-1 + message k

and its output is reply k. Tenants and documents are drawn by Zipf popularity (`*_skew`; 0 is
uniform). A session has a geometric number of turns with mean `turns_mean`; its first turn
arrives at the session's start time (`session_starts`, from any arrival process), and each next
turn a mean `think_s` (exponential) after the previous one, the user's reading and typing time
counted from the previous arrival. Message and reply lengths come from the caller (log-normal in
scenarios).

Block ids are interned from (id of the previous block, the pieces of content the block holds), so
two prompts get the same id for a block exactly when they agree on everything up to its end, as
vLLM's chained block hashes do. A last, partial block is shared only by identical prompts.

Pure: the caller passes the random generator; no clock, no I/O.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import random
from collections.abc import Sequence

from disaggpool.formats.traces import TraceRequest

__all__ = ["PrefixShape", "prefix_sessions"]

_Piece = tuple[str, int, int, int, int]  # (kind, owner, index, start, end) of one segment
_Segment = tuple[str, int, int, int]  # (kind, owner, index, tokens)


@dataclasses.dataclass(frozen=True, slots=True)
class PrefixShape:
    """How much prefix requests share (module docstring)."""

    tenants: int = 8
    system_tokens: int = 1024
    tenant_skew: float = 1.0
    documents: int = 0
    document_tokens: int = 2048
    document_skew: float = 1.0
    turns_mean: float = 3.0
    think_s: float = 10.0
    block_tokens: int = 512

    def __post_init__(self) -> None:
        for name in ("tenants", "block_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("system_tokens", "documents", "document_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.documents and self.document_tokens < 1:
            raise ValueError("document_tokens must be >= 1 when there are documents")
        if self.turns_mean < 1.0:
            raise ValueError(f"turns_mean must be >= 1, got {self.turns_mean}")
        for name in ("tenant_skew", "document_skew", "think_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


def prefix_sessions(
    session_starts: Sequence[float],
    messages: Sequence[TraceRequest],
    shape: PrefixShape,
    rng: random.Random,
) -> list[TraceRequest]:
    """Requests of sessions starting at `session_starts`, sorted by arrival, at most
    len(`messages`) of them: request j's new message has ``messages[j].prompt_tokens`` tokens,
    its reply ``messages[j].output_tokens``, and its class ``messages[j].slo_class``.

    Sessions are generated in start order until the messages run out; a session's turns take
    consecutive messages."""
    tenant_cdf = _zipf_cdf(shape.tenants, shape.tenant_skew)
    doc_cdf = _zipf_cdf(shape.documents, shape.document_skew) if shape.documents else []
    intern: dict[tuple[int, tuple[_Piece, ...]], int] = {}
    out: list[TraceRequest] = []
    used = 0
    for session, start in enumerate(session_starts):
        if used >= len(messages):
            break
        tenant = bisect.bisect_left(tenant_cdf, rng.random())
        content: list[_Segment] = []
        if shape.system_tokens:
            content.append(("system", tenant, 0, shape.system_tokens))
        if doc_cdf:
            doc = bisect.bisect_left(doc_cdf, rng.random())
            content.append(("document", doc, 0, shape.document_tokens))
        arrival = start
        for turn in itertools.count():
            msg = messages[used]
            used += 1
            content.append(("message", session, turn, msg.prompt_tokens))
            prompt = sum(seg[3] for seg in content)
            out.append(
                TraceRequest(
                    arrival,
                    prompt,
                    msg.output_tokens,
                    msg.slo_class,
                    _block_ids(content, shape.block_tokens, intern),
                    shape.block_tokens,
                )
            )
            content.append(("reply", session, turn, msg.output_tokens))
            # Geometric number of turns with mean turns_mean: go on with 1 - 1/mean.
            if used >= len(messages) or rng.random() < 1.0 / shape.turns_mean:
                break
            arrival += rng.expovariate(1.0 / shape.think_s) if shape.think_s > 0 else 0.0
    out.sort(key=lambda r: r.arrival_s)
    return out


def _zipf_cdf(n: int, skew: float) -> list[float]:
    """Cumulative Zipf(skew) probabilities of ranks 1..n (skew 0: uniform)."""
    weights = [1.0 / (rank**skew) for rank in range(1, n + 1)]
    total = sum(weights)
    cdf = list(itertools.accumulate(w / total for w in weights))
    cdf[-1] = 1.0  # no float shortfall past the last rank
    return cdf


def _block_ids(
    content: Sequence[_Segment],
    block_tokens: int,
    intern: dict[tuple[int, tuple[_Piece, ...]], int],
) -> tuple[int, ...]:
    """One id per block of `content`, chained through the previous block's id (docstring)."""
    ids: list[int] = []
    parent = -1
    pieces: list[_Piece] = []
    room = block_tokens
    for kind, owner, index, tokens in content:
        offset = 0
        while offset < tokens:
            take = min(room, tokens - offset)
            pieces.append((kind, owner, index, offset, offset + take))
            offset += take
            room -= take
            if room == 0:
                parent = _intern(intern, parent, pieces)
                ids.append(parent)
                pieces, room = [], block_tokens
    if pieces:
        ids.append(_intern(intern, parent, pieces))
    return tuple(ids)


def _intern(
    table: dict[tuple[int, tuple[_Piece, ...]], int], parent: int, pieces: list[_Piece]
) -> int:
    key = (parent, tuple(pieces))
    found = table.get(key)
    if found is None:
        found = table[key] = len(table)
    return found
