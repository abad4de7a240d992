"""vLLM's response bodies: completion and chat, whole and streamed, keys in vLLM's order.

A completion and a chat answer are the same answer dressed differently: the `object` names, where
the text sits (a string, a chat `message`, a chunk's `delta`), and which null fields each body
carries. Those differences are data (`Shape`, one per endpoint: `SHAPES`); `response`, `chunk`,
`role_chunk` and `usage_chunk` build every body from it. A field vLLM leaves unset is null, and
each list of keys is in vLLM's order (checked against the recording of real vLLM in
`tests/realvllm/fixtures/vllm_0.32.0_wire.json`; `docs/vllm-protocol.md` §2.2 and §5 for
`kv_transfer_params`).

Also `dumps` (JSON as vLLM's server writes it), the usage block, `/v1/models` and the version.
Pure functions; `server` calls them.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "CHAT",
    "COMPLETION",
    "SHAPES",
    "VLLM_VERSION",
    "Shape",
    "chunk",
    "dumps",
    "models_response",
    "response",
    "role_chunk",
    "usage",
    "usage_chunk",
]

VLLM_VERSION = "0.33.0"


def dumps(obj: Any) -> str:
    """Compact JSON, as Starlette's JSONResponse and pydantic's model_dump_json write it."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


@dataclasses.dataclass(frozen=True, slots=True)
class Shape:
    """What tells one endpoint's bodies from the other's; every key list is in vLLM's order."""

    id_prefix: str  # the response id is "<prefix>-<request id>"
    object: str  # `object` of a whole response
    chunk_object: str  # `object` of a stream chunk (and of the final usage chunk)
    text_key: str  # the choice key that holds the text in a whole response
    chunk_text_key: str  # ... and in a chunk
    # Keys of the object the text sits in (chat: the message; a chunk's delta then holds only
    # `content`), or () when the text is a bare string.
    message: tuple[str, ...]
    body: tuple[str, ...]  # a whole response
    choice: tuple[str, ...]  # its choice
    chunk_choice: tuple[str, ...]  # a chunk's choice
    unfinished_chunk_omits: frozenset[str]  # choice keys a chunk without a finish reason lacks
    role_chunk: bool  # a stream opens with a chunk announcing the assistant role
    role_chunk_omits: frozenset[str]  # choice keys the role chunk lacks
    role_chunk_adds: tuple[str, ...]  # top-level keys only the role chunk has


COMPLETION = Shape(
    id_prefix="cmpl",
    object="text_completion",
    chunk_object="text_completion",
    text_key="text",
    chunk_text_key="text",
    message=(),
    body=(
        "id", "object", "created", "model", "choices", "service_tier", "system_fingerprint",
        "usage", "kv_transfer_params", "ec_transfer_params", "metrics",
    ),
    choice=(
        "index", "text", "logprobs", "finish_reason", "stop_reason", "token_ids",
        "prompt_logprobs", "prompt_token_ids", "routed_experts",
    ),
    chunk_choice=(
        "index", "text", "logprobs", "finish_reason", "stop_reason", "prompt_token_ids",
        "token_ids",
    ),
    unfinished_chunk_omits=frozenset(),
    role_chunk=False,
    role_chunk_omits=frozenset(),
    role_chunk_adds=(),
)  # fmt: skip

CHAT = Shape(
    id_prefix="chatcmpl",
    object="chat.completion",
    chunk_object="chat.completion.chunk",
    text_key="message",
    chunk_text_key="delta",
    message=(
        "role", "content", "refusal", "annotations", "audio", "function_call", "reasoning",
    ),
    body=(
        "id", "object", "created", "model", "choices", "service_tier", "system_fingerprint",
        "usage", "prompt_logprobs", "prompt_token_ids", "prompt_text", "kv_transfer_params",
        "ec_transfer_params", "metrics",
    ),
    choice=(
        "index", "message", "logprobs", "finish_reason", "stop_reason", "token_ids",
        "routed_experts",
    ),
    chunk_choice=("index", "delta", "logprobs", "finish_reason", "stop_reason", "token_ids"),
    unfinished_chunk_omits=frozenset({"stop_reason"}),
    role_chunk=True,
    role_chunk_omits=frozenset({"token_ids"}),
    role_chunk_adds=("prompt_token_ids", "prompt_text"),
)  # fmt: skip

SHAPES: Mapping[str, Shape] = {"completions": COMPLETION, "chat": CHAT}


def _fill(keys: Sequence[str], values: Mapping[str, Any]) -> dict[str, Any]:
    """`keys` in order, each with its value from `values` or null (a field vLLM leaves unset)."""
    return {key: values.get(key) for key in keys}


def _head(obj: str, rid: str, created: int, model: str) -> dict[str, Any]:
    return {"id": rid, "object": obj, "created": created, "model": model}


def usage(prompt_tokens: int, completion_tokens: int, *, details: bool = True) -> dict[str, Any]:
    """The usage block; streamed usage chunks carry no `*_details` keys."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }
    if details:
        out["prompt_tokens_details"] = None
        out["completion_tokens_details"] = None
    return out


def response(
    shape: Shape,
    rid: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str,
    use: dict[str, Any],
    kv_transfer_params: Mapping[str, Any] | None,
    fingerprint: str,
) -> dict[str, Any]:
    """A whole (non-streamed) response with one choice."""
    content: Any = (
        _fill(shape.message, {"role": "assistant", "content": text}) if shape.message else text
    )
    choice = _fill(
        shape.choice, {"index": 0, shape.text_key: content, "finish_reason": finish_reason}
    )
    return _fill(
        shape.body,
        {
            **_head(shape.object, rid, created, model),
            "choices": [choice],
            "system_fingerprint": fingerprint,
            "usage": use,
            "kv_transfer_params": dict(kv_transfer_params) if kv_transfer_params else None,
        },
    )


def _chunk(
    shape: Shape,
    rid: str,
    created: int,
    model: str,
    content: Any,
    finish_reason: str | None,
    use: dict[str, Any] | None,
    kv_transfer_params: Mapping[str, Any] | None,
    *,
    first: bool,
) -> dict[str, Any]:
    omit = shape.unfinished_chunk_omits if finish_reason is None else frozenset()
    if first:
        omit = omit | shape.role_chunk_omits
    keys = [key for key in shape.chunk_choice if key not in omit]
    choice = _fill(
        keys, {"index": 0, shape.chunk_text_key: content, "finish_reason": finish_reason}
    )
    out = _head(shape.chunk_object, rid, created, model)
    out["choices"] = [choice]
    if first:
        out.update(_fill(shape.role_chunk_adds, {}))
    if use is not None:
        out["usage"] = use
    if kv_transfer_params:
        out["kv_transfer_params"] = dict(kv_transfer_params)
    return out


def chunk(
    shape: Shape,
    rid: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str | None = None,
    use: dict[str, Any] | None = None,
    kv_transfer_params: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """One chunk of a stream carrying `text`; the last one also the finish reason (and, for a
    prefill leg, `kv_transfer_params`). `use` is the continuous usage block, when asked for."""
    content: Any = {"content": text} if shape.message else text
    return _chunk(
        shape, rid, created, model, content, finish_reason, use, kv_transfer_params, first=False
    )


def role_chunk(
    shape: Shape, rid: str, created: int, model: str, use: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The chunk that opens a stream when `shape.role_chunk` (chat): the assistant's role."""
    content = {"role": "assistant", "content": ""}
    return _chunk(shape, rid, created, model, content, None, use, None, first=True)


def usage_chunk(
    shape: Shape, rid: str, created: int, model: str, use: dict[str, Any], fingerprint: str
) -> dict[str, Any]:
    """The final `include_usage` chunk: no choices, the usage and the fingerprint."""
    out = _head(shape.chunk_object, rid, created, model)
    out["choices"] = []
    out["usage"] = use
    out["system_fingerprint"] = fingerprint
    return out


def models_response(
    served: Sequence[str], root: str, max_model_len: int, created: int, perm_id: str
) -> dict[str, Any]:
    """`GET /v1/models`: one entry per served name, all the same model."""
    return {
        "object": "list",
        "data": [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": root,
                "parent": None,
                "max_model_len": max_model_len,
                "permission": [
                    {
                        "id": f"modelperm-{perm_id}",
                        "object": "model_permission",
                        "created": created,
                        "allow_create_engine": False,
                        "allow_sampling": True,
                        "allow_logprobs": True,
                        "allow_search_indices": False,
                        "allow_view": True,
                        "allow_fine_tuning": False,
                        "organization": "*",
                        "group": None,
                        "is_blocking": False,
                    }
                ],
            }
            for name in served
        ],
    }
