"""An OpenAI completions or chat request as the front door reads it: bounded, validated, measured.

`read_body` takes the body within `max_body_bytes` (from Content-Length, or while reading a chunked
one); `parse` validates it as vLLM would (400 naming the field), drops a client's `priority` unless
`forward_client_priority`, takes the SLO class (header ``X-SLO-Class``, else body field
``slo_class``, removed before forwarding, else the default) and measures the prompt exactly
(`tokens`); `check_length` makes vLLM's own length checks against the pods' `max_model_len`, so a
request the pods would refuse runs no prefill leg first. Bodies over `OFF_LOOP_JSON` are parsed in
a worker thread: the loop also serves every stream and gRPC call.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

from disaggpool.sidecar.config import SidecarConfig
from disaggpool.sidecar.service import BadRequest
from disaggpool.sidecar.tokens import Prompt, PromptCounter

__all__ = [
    "COMPLETIONS_DEFAULT_MAX_TOKENS",
    "NotFound",
    "TooLarge",
    "check_length",
    "json_object",
    "model_list",
    "parse",
    "parse_body",
    "read_body",
]

OFF_LOOP_JSON = 256 * 1024  # bodies larger than this are parsed in a worker thread
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # vLLM's, for /v1/completions without max_tokens


class NotFound(BadRequest):
    """The request names a model this router does not serve (404)."""


class TooLarge(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(f"larger than max_body_bytes ({limit} bytes)")


async def json_object(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object, or BadRequest naming ``body``. A large body is parsed in
    a worker thread: on the loop it would hold every other stream and gRPC call."""
    try:
        body = (
            json.loads(raw)
            if len(raw) <= OFF_LOOP_JSON
            else await asyncio.to_thread(json.loads, raw)
        )
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise BadRequest("request body is not valid JSON", "body") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object", "body")
    return body


def model_list(model: str, max_model_len: int) -> dict[str, Any]:
    """``GET /v1/models`` as vLLM answers it, for the one model this router serves
    (`max_model_len` 0: not known yet, left out)."""
    entry: dict[str, Any] = {
        "id": model,
        "object": "model",
        "created": 0,
        "owned_by": "disaggpool",
        "root": model,
        "parent": None,
    }
    if max_model_len:
        entry["max_model_len"] = max_model_len
    return {"object": "list", "data": [entry]}


async def read_body(request: web.Request, limit: int) -> bytes:
    """The body, or `_TooLarge` past `limit` (`max_body_bytes`) (from Content-Length or while
    reading: a chunked body has none)."""
    if request.content_length is not None and request.content_length > limit:
        raise TooLarge(limit)
    chunks, size = [], 0
    async for chunk in request.content.iter_chunked(256 * 1024):
        size += len(chunk)
        if size > limit:
            raise TooLarge(limit)
        chunks.append(chunk)
    return b"".join(chunks)


async def parse(
    endpoint: str, request: web.Request, config: SidecarConfig, counter: PromptCounter
) -> tuple[dict[str, Any], Prompt, str]:
    """(body to forward, the measured prompt, SLO class) or BadRequest naming the field."""
    raw = await read_body(request, config.max_body_bytes)
    return await parse_body(endpoint, raw, request.headers.get("X-SLO-Class"), config, counter)


async def parse_body(
    endpoint: str,
    raw: bytes,
    slo_header: str | None,
    config: SidecarConfig,
    counter: PromptCounter,
) -> tuple[dict[str, Any], Prompt, str]:
    """`parse` of a body already read (the endpoint picker gets it from Envoy in chunks);
    `slo_header`: the request's ``X-SLO-Class``, if any."""
    body = await json_object(raw)
    model = body.get("model")
    if model is not None and model != config.model:
        raise NotFound(f"The model `{model}` does not exist.", "model")
    body["model"] = config.model
    for key in ("max_tokens", "max_completion_tokens", "min_tokens"):
        value = body.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise BadRequest(f"must be an integer, got {value!r}", key)
        if value is not None and value < (0 if key == "min_tokens" else 1):
            raise BadRequest(f"must be at least 1, got {value}", key)
    if not isinstance(body.get("stream", False), bool):
        raise BadRequest("must be a boolean", "stream")
    if "kv_transfer_params" in body:
        raise BadRequest("is set by the router, not by clients", "kv_transfer_params")
    priority = body.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise BadRequest(f"must be an integer, got {priority!r}", "priority")
    if not config.forward_client_priority:
        body.pop("priority", None)  # it would reorder the engines' queues for everybody
    slo = slo_header or body.pop("slo_class", None) or ""
    if not isinstance(slo, str):
        raise BadRequest("must be a string", "slo_class")
    try:
        if endpoint == "chat":
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise BadRequest("must be a non-empty list of messages", "messages")
            if not all(isinstance(m, dict) for m in messages):
                raise BadRequest("every message must be an object", "messages")
            prompt_seen = await counter.chat(
                messages,
                bool(body.get("add_generation_prompt", True)),
                bool(body.get("add_special_tokens", False)),
            )
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
                prompt = prompt[0]
            valid_ids = isinstance(prompt, list) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt
            )
            if not (isinstance(prompt, str) or valid_ids) or not prompt:
                raise BadRequest("must be a non-empty string or list of token ids", "prompt")
            assert isinstance(prompt, str | list)
            prompt_seen = await counter.completion(
                prompt, bool(body.get("add_special_tokens", True))
            )
    except ValueError as exc:  # the engine's /tokenize refused the prompt
        raise BadRequest(str(exc), "messages" if endpoint == "chat" else "prompt") from None
    return body, prompt_seen, slo


def check_length(body: dict[str, Any], prompt: int, max_tokens: int | None, length: int) -> None:
    """vLLM's own length checks, made here so that a request the pods would refuse runs no
    prefill leg first (the decode pod would refuse it only after the prefill)."""
    if not length:  # not known yet: the pods will say
        return
    key = "max_completion_tokens" if body.get("max_completion_tokens") else "max_tokens"
    if max_tokens is not None and max_tokens > length:
        raise BadRequest(
            f"{key}={max_tokens} cannot be greater than max_model_len={length}. "
            "Please request fewer output tokens.",
            key,
        )
    if prompt > length or (max_tokens is None and prompt >= length):
        raise BadRequest(
            f"This model's maximum context length is {length} tokens. However, your prompt "
            f"contains {prompt} input tokens, which exceeds this limit even without any "
            "output tokens. Please reduce the length of the input prompt.",
            "messages" if "messages" in body else "prompt",
        )
    if max_tokens is not None and prompt + max_tokens > length:
        raise BadRequest(
            f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This "
            f"model's maximum context length is {length} tokens and your request has "
            f"{prompt} input tokens ({max_tokens} > {length} - {prompt}).",
            key,
        )
