"""Parsing and validation of vLLM's request bodies: completion, chat, tokenize, detokenize.

`parse_completion` and `parse_chat` turn a JSON body into a `GenerationRequest` (which leg it
is, the prompt's token ids, the resolved `max_tokens`, the streaming options) or raise the
`errors.ApiError` vLLM would answer, with its status, type, message and offending parameter.
The checks run in vLLM's order: schema, model, tokenisation and context length, sampling
parameters, so that a body with several faults gets the error vLLM reports first.

Field reading (`_Fields`) deliberately mirrors pydantic's lax coercion (``"5"`` and ``5.0`` are
the integer 5, ``"yes"`` is true) and names the field in vLLM's schema-error shape: it is the
request schema of an OpenAI server, not a configuration reader, and its errors are part of the
wire contract checked against real vLLM.

Pure functions of their inputs; `server` calls them with the instance's tokenizer.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Sequence
from typing import Any, Literal

from disaggpool.emulator.errors import (
    SCHEMA_ERROR,
    ApiError,
    schema_error,
    value_error,
    vllm_error,
)
from disaggpool.wordtokenizer import Tokenizer

__all__ = [
    "Endpoint",
    "GenerationRequest",
    "Kind",
    "RemotePrefill",
    "check_content_type",
    "parse_chat",
    "parse_completion",
    "parse_detokenize",
    "parse_json",
    "parse_tokenize",
]

Endpoint = Literal["completions", "chat"]
Kind = Literal["local", "prefill", "decode"]

_INT_TEXT = re.compile(r"\s*[+-]?[0-9]+\s*")


def check_content_type(content_type: str | None) -> None:
    """vLLM accepts JSON bodies only (and insists on the header)."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        raise ApiError(
            400,
            "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed",
            None,
            err_type=SCHEMA_ERROR,
        )


def parse_json(raw: bytes) -> Any:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise schema_error(
            str(exc.start), "json_invalid", "JSON decode error", {}, error=exc.reason
        ) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise schema_error(
            str(exc.pos), "json_invalid", "JSON decode error", {}, error=exc.msg
        ) from None
    except (ValueError, RecursionError) as exc:  # over 4300 digits, or nested too deep
        raise schema_error("0", "json_invalid", "JSON decode error", {}, error=str(exc)) from None


# ---------------------------------------------------------------------------- typed field access
class _Fields:
    """Reads one body's fields with pydantic's lax coercion; errors name the field."""

    def __init__(self, body: Any) -> None:
        if not isinstance(body, dict):
            raise schema_error(
                "",
                "model_attributes_type",
                "Input should be a valid dictionary or object to extract fields from",
                body,
            )
        self.body: dict[str, Any] = body

    def invalid(self, key: str, kind: str, msg: str) -> ApiError:
        return schema_error(key, kind, msg, self.body.get(key))

    def int_(self, key: str, default: int | None) -> int | None:
        value = self.body.get(key, default)
        if value is None or (isinstance(value, int) and not isinstance(value, bool)):
            return value
        if isinstance(value, float) and math.isfinite(value) and value == int(value):
            return int(value)
        if isinstance(value, str) and _INT_TEXT.fullmatch(value) and len(value) < 1000:
            return int(value)
        if isinstance(value, str):
            raise self.invalid(
                key, "int_parsing", "Input should be a valid integer, unable to parse string"
            )
        if isinstance(value, float):
            raise self.invalid(
                key,
                "int_from_float",
                "Input should be a valid integer, got a number with a fractional part",
            )
        raise self.invalid(key, "int_type", "Input should be a valid integer")

    def bool_(self, key: str, default: bool | None) -> bool | None:
        value = self.body.get(key, default)
        if value is None or isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        if isinstance(value, str):
            text = value.strip().lower()
            if text in ("true", "1", "yes", "on", "t", "y"):
                return True
            if text in ("false", "0", "no", "off", "f", "n"):
                return False
        raise self.invalid(
            key, "bool_parsing", "Input should be a valid boolean, unable to interpret input"
        )

    def number(self, key: str) -> float | None:
        value = self.body.get(key)
        if value is None:
            return None
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
        raise self.invalid(key, "float_type", "Input should be a valid number")

    def str_(self, key: str) -> str | None:
        value = self.body.get(key)
        if value is None or isinstance(value, str):
            return value
        raise self.invalid(key, "string_type", "Input should be a valid string")

    def obj(self, key: str) -> dict[str, Any] | None:
        value = self.body.get(key)
        if value is None or isinstance(value, dict):
            return value
        raise self.invalid(key, "dict_type", "Input should be a valid dictionary")


def _check_model(model: str | None, served: Sequence[str]) -> None:
    if model is not None and model not in served:
        raise ApiError(
            404,
            f"The model `{model}` does not exist. Valid aliases: {', '.join(served)}.",
            "model",
        )


# ---------------------------------------------------------------------------- the parsed request
@dataclasses.dataclass(frozen=True, slots=True)
class RemotePrefill:
    """Where a decode leg's KV lives: the prefill side's `kv_transfer_params`."""

    host: str
    port: int  # -1 when the params carry no usable port (the pull then fails: HTTP 500)
    request_id: str
    engine_id: str
    block_ids: Any  # passed back to P verbatim; P checks it against its lease
    raw: dict[str, Any]


@dataclasses.dataclass(frozen=True, slots=True)
class GenerationRequest:
    """A validated completion or chat request."""

    endpoint: Endpoint
    model: str | None
    prompt_ids: list[int]
    max_tokens: int  # resolved: what the engine will generate (no EOS in the emulator)
    max_tokens_param: int | None  # as sent, for vllm:request_params_max_tokens
    min_tokens: int
    stream: bool
    include_usage: bool
    continuous_usage: bool
    seed: int | None
    body_request_id: str | None
    kind: Kind
    remote: RemotePrefill | None
    kv_transfer_params: dict[str, Any] | None
    priority: int = 0  # the body's; the X-Vllm-Priority header overrides it (server)


def _common(f: _Fields, served: Sequence[str]) -> tuple[str | None, dict[str, Any] | None]:
    """Schema checks both endpoints share, then the model; returns (model, kv params)."""
    model = f.str_("model")
    for key in ("ignore_eos", "echo", "add_special_tokens"):
        f.bool_(key, None)
    f.int_("seed", None)
    f.str_("request_id")
    for key in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
        f.number(key)
    f.int_("top_k", None)
    f.int_("min_tokens", 0)
    n = f.int_("n", 1)
    stream = f.bool_("stream", False)
    options = f.obj("stream_options")
    if options is not None:
        for key in ("include_usage", "continuous_usage_stats"):
            value = options.get(key)
            if value is not None and not isinstance(value, bool):
                raise schema_error(
                    f"stream_options.{key}", "bool_type", "Input should be a valid boolean", value
                )
    stop = f.body.get("stop")
    if stop is not None and not (
        isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))
    ):
        raise f.invalid("stop", "string_type", "Input should be a valid string")
    kv = f.obj("kv_transfer_params")
    f.int_("priority", 0)  # whether the engine takes it is the instance's call (its policy)
    # Model-level validators (pydantic's `model_validator`), still request-schema time:
    if options is not None and not stream:
        raise vllm_error("Stream options can only be defined when `stream=True`.", "stream_options")
    _check_model(model, served)
    if n is not None and n != 1:
        # vLLM supports n > 1; the emulator generates one sequence per request.
        raise vllm_error("The emulator generates one sequence per request (n must be 1).", "n", n)
    return model, kv


def _is_port(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value <= 65535


def _kind(kv: dict[str, Any] | None) -> tuple[Kind, RemotePrefill | None]:
    """Which leg this is, read as vLLM's NIXL connector reads `kv_transfer_params`."""
    if not kv:
        return "local", None
    if kv.get("do_remote_prefill"):
        keys = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")
        # vLLM computes locally (with a warning) when the remote coordinates are incomplete.
        if all(kv.get(k) is not None for k in keys) and kv.get("remote_block_ids") is not None:
            port = kv["remote_port"]
            return "decode", RemotePrefill(
                host=str(kv["remote_host"]),
                port=port if _is_port(port) else -1,
                request_id=str(kv["remote_request_id"]),
                engine_id=str(kv["remote_engine_id"]),
                block_ids=kv["remote_block_ids"],
                raw=kv,
            )
        return "local", None
    if kv.get("do_remote_decode"):
        return "prefill", None
    return "local", None


def _token_ids(f: _Fields, key: str, vocab: int) -> list[int]:
    value = f.body.get(key)
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    ):
        raise f.invalid(key, "list_type", "Input should be a valid list of integers")
    for t in value:
        if not 0 <= t < vocab:
            raise value_error(f"Token id {t} is out of vocabulary")
    return list(value)


def _finish(
    f: _Fields,
    endpoint: Endpoint,
    model: str | None,
    kv: dict[str, Any] | None,
    prompt_ids: list[int],
    max_tokens_param: int | None,
    max_key: str,
    max_model_len: int,
) -> GenerationRequest:
    """Length and sampling checks once the prompt is tokenised, in vLLM's order."""
    n = len(prompt_ids)
    length = max_model_len
    if max_tokens_param is not None and max_tokens_param > length:
        raise vllm_error(
            f"{max_key}={max_tokens_param} cannot be greater than max_model_len={length}. "
            "Please request fewer output tokens.",
            max_key,
            max_tokens_param,
        )
    if n == 0:
        raise value_error("The decoder prompt cannot be empty")
    if n > length or (max_tokens_param is None and n >= length):
        shown = min(n, length + 1)  # vLLM stops tokenising one token past the limit
        raise vllm_error(
            f"This model's maximum context length is {length} tokens. However, your prompt "
            f"contains at least {shown} input tokens, which exceeds this limit even without "
            "any output tokens. Please reduce the length of the input prompt.",
            "input_tokens",
            shown,
        )
    if max_tokens_param is not None and n + max_tokens_param > length:
        raise vllm_error(
            f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens_param}. This "
            f"model's maximum context length is {length} tokens and your request has {n} "
            f"input tokens ({max_tokens_param} > {length} - {n}).",
            max_key,
            max_tokens_param,
        )
    max_tokens = max_tokens_param if max_tokens_param is not None else length - n
    if max_tokens < 1:
        raise vllm_error(f"max_tokens must be at least 1, got {max_tokens}.", max_key, max_tokens)
    min_tokens = f.int_("min_tokens", 0) or 0
    if min_tokens < 0:
        raise value_error(f"min_tokens must be greater than or equal to 0, got {min_tokens}.")
    if min_tokens > max_tokens:
        raise value_error(
            f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}."
        )
    temperature = f.number("temperature")
    if temperature is not None and temperature < 0:
        raise value_error(f"temperature must be non-negative, got {temperature}.")
    top_p = f.number("top_p")
    if top_p is not None and not 0 < top_p <= 1:
        raise value_error(f"top_p must be in (0, 1], got {top_p}.")
    options = f.obj("stream_options") or {}
    kind, remote = _kind(kv)
    return GenerationRequest(
        endpoint=endpoint,
        model=model,
        prompt_ids=prompt_ids,
        max_tokens=max_tokens,
        max_tokens_param=max_tokens_param,
        min_tokens=min_tokens,
        stream=bool(f.bool_("stream", False)),
        include_usage=bool(options.get("include_usage")),
        continuous_usage=bool(options.get("continuous_usage_stats")),
        seed=f.int_("seed", None),
        body_request_id=f.str_("request_id"),
        kind=kind,
        remote=remote,
        kv_transfer_params=kv,
        priority=f.int_("priority", 0) or 0,
    )


def parse_completion(
    body: Any, tokenizer: Tokenizer, served: Sequence[str], max_model_len: int
) -> GenerationRequest:
    f = _Fields(body)
    prompt = f.body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            # vLLM answers one choice per prompt; the emulator serves one prompt per request.
            raise vllm_error("The emulator serves one prompt per request.", "prompt", len(prompt))
        f.body = {**f.body, "prompt": prompt[0]}
        prompt = prompt[0]
    if prompt is not None and not isinstance(prompt, str | list):
        raise f.invalid("prompt", "string_type", "Input should be a valid string")
    max_tokens = f.int_("max_tokens", 16)
    model, kv = _common(f, served)
    if prompt is None or prompt == [] or prompt == "":
        raise vllm_error("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
    if isinstance(prompt, str):
        special = f.bool_("add_special_tokens", True)
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=bool(special))
    else:
        prompt_ids = _token_ids(f, "prompt", tokenizer.vocab_size)
    return _finish(f, "completions", model, kv, prompt_ids, max_tokens, "max_tokens", max_model_len)


def _message_text(content: Any, index: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                parts.append(part)
            elif (
                isinstance(part, dict)
                and part.get("type", "text") == "text"
                and isinstance(part.get("text"), str)
            ):
                parts.append(part["text"])
            else:
                raise schema_error(
                    f"messages.{index}.content.{j}",
                    "union_tag_invalid",
                    "Input tag does not match any of the expected tags ('text')",
                    part,
                )
        return "\n".join(parts)
    raise schema_error(
        f"messages.{index}.content", "string_type", "Input should be a valid string", content
    )


def _chat_messages(f: _Fields) -> list[dict[str, str]]:
    messages = f.body.get("messages")
    if messages is None:
        raise schema_error("messages", "missing", "Field required", f.body)
    if not isinstance(messages, list):
        raise f.invalid("messages", "list_type", "Input should be a valid list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise schema_error(
                f"messages.{i}", "dict_type", "Input should be a valid dictionary", m
            )
        role = m.get("role")
        if not isinstance(role, str):
            kind, msg = (
                ("missing", "Field required")
                if role is None
                else (
                    "string_type",
                    "Input should be a valid string",
                )
            )
            raise schema_error(f"messages.{i}.role", kind, msg, m if role is None else role)
        out.append({"role": role, "content": _message_text(m.get("content"), i)})
    return out


def parse_chat(
    body: Any, tokenizer: Tokenizer, served: Sequence[str], max_model_len: int
) -> GenerationRequest:
    f = _Fields(body)
    messages = _chat_messages(f)
    # max_completion_tokens replaces the deprecated max_tokens and wins when both are set.
    key = (
        "max_completion_tokens" if f.body.get("max_completion_tokens") is not None else "max_tokens"
    )
    max_tokens = f.int_(key, None)
    add_generation_prompt = f.bool_("add_generation_prompt", True)
    f.bool_("continue_final_message", False)
    model, kv = _common(f, served)
    if not messages:
        raise value_error("The decoder prompt cannot be empty")
    text = tokenizer.chat_prompt(messages, bool(add_generation_prompt))
    # Chat templates carry their own BOS, so vLLM adds no special tokens to chat by default.
    special = f.bool_("add_special_tokens", False)
    prompt_ids = tokenizer.encode(text, add_special_tokens=bool(special))
    return _finish(f, "chat", model, kv, prompt_ids, max_tokens, key, max_model_len)


def parse_tokenize(
    body: Any, tokenizer: Tokenizer, served: Sequence[str]
) -> tuple[list[int], list[str]]:
    """/tokenize: a `prompt` string or chat `messages`; returns (ids, their texts)."""
    f = _Fields(body)
    model = f.str_("model")
    f.bool_("return_token_strs", False)
    if "messages" in f.body:
        messages = _chat_messages(f)
        text = tokenizer.chat_prompt(messages, bool(f.bool_("add_generation_prompt", True)))
        special = bool(f.bool_("add_special_tokens", False))
    else:
        prompt = f.str_("prompt")
        if prompt is None:
            raise schema_error("prompt", "missing", "Field required", f.body)
        text = prompt
        special = bool(f.bool_("add_special_tokens", True))
    _check_model(model, served)
    pieces = tokenizer.pieces(text)
    return tokenizer.encode(text, add_special_tokens=special), (
        ["<s>", *pieces] if special else pieces
    )


def parse_detokenize(body: Any, tokenizer: Tokenizer, served: Sequence[str]) -> list[int]:
    f = _Fields(body)
    model = f.str_("model")
    if "tokens" not in f.body:
        raise schema_error("tokens", "missing", "Field required", f.body)
    ids = _token_ids(f, "tokens", tokenizer.vocab_size)
    _check_model(model, served)
    return ids
