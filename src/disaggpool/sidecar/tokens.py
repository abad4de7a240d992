"""Exact prompt lengths for routing: the cost model prices the prompt a pod will really prefill.

Three sources (`TokenizerConfig.kind`):

* ``engine``: ask a healthy prefill pod's vLLM ``POST /tokenize`` (prompt or chat messages, with
  the same defaults as the generation endpoints: BOS for completions, the chat template for
  chat); exact for any model, at the cost of one round trip;
* ``emulator``: the emulator's deterministic tokenizer in process (exact for emulated pools,
  no round trip; the demo uses it);
* ``huggingface``: a ``tokenizer.json`` read with the `tokenizers` library for completion
  prompts (exact, in process); chat still goes to ``/tokenize``, because the chat template lives
  in the model's tokenizer config, not in ``tokenizer.json``.

A prompt given as token ids is counted directly whatever the source. Every source also hands back
the token ids themselves (`Prompt.ids`; `/tokenize` returns them with the count), which the
router's prefix index turns into block ids. In-process tokenizers run off the event loop for
long prompts (the loop also serves gRPC and every stream); `/tokenize` calls carry the pods' API
key and a deadline of their own, and an answer that is not vLLM's shape counts as a failed try.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import aiohttp

from disaggpool.sidecar.config import TokenizerConfig
from disaggpool.sidecar.state import PoolState
from disaggpool.wordtokenizer import Tokenizer

__all__ = ["Prompt", "PromptCounter", "TokenizeError"]

OFF_LOOP_CHARS = 64 * 1024  # prompts longer than this are tokenized in a worker thread
TOKENIZE_TIMEOUT_S = 10.0


class Prompt(NamedTuple):
    """A measured prompt: its length in tokens, and its token ids when the source gave them."""

    tokens: int
    ids: tuple[int, ...] | None = None


class TokenizeError(RuntimeError):
    """The prompt could not be measured (no prefill pod answered /tokenize)."""


class PromptCounter:
    def __init__(
        self,
        config: TokenizerConfig,
        state: PoolState,
        model: str,
        session: aiohttp.ClientSession,
        headers: Callable[[], Mapping[str, str]] = dict,
    ) -> None:
        self.headers = headers  # what every pod request carries (the pods' API key)
        self.kind = config.kind
        self.state = state
        self.model = model
        self.session = session
        self._emulated = Tokenizer() if config.kind == "emulator" else None
        self._hf: Any = None
        if config.kind == "huggingface":
            try:
                from tokenizers import Tokenizer as HFTokenizer
            except ImportError as exc:
                raise TokenizeError(
                    "tokenizer.kind huggingface needs the 'tokenizers' package"
                ) from exc
            self._hf = HFTokenizer.from_file(config.path)
        self._rng = random.Random(0)

    async def completion(self, prompt: str | Sequence[int], add_special: bool = True) -> Prompt:
        if not isinstance(prompt, str):
            return _measured(prompt)
        if self._emulated is not None:
            emulated = self._emulated
            return await _local(len(prompt), lambda: emulated.encode(prompt, add_special))
        if self._hf is not None:
            hf = self._hf
            return await _local(
                len(prompt), lambda: hf.encode(prompt, add_special_tokens=add_special).ids
            )
        body = {"model": self.model, "prompt": prompt, "add_special_tokens": add_special}
        return await self._remote(body)

    async def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        add_special: bool = False,
    ) -> Prompt:
        if self._emulated is not None:
            emulated = self._emulated

            def encode() -> Sequence[int]:
                try:
                    text = emulated.chat_prompt(messages, add_generation_prompt)
                except (KeyError, TypeError) as exc:  # a message without a role or content
                    raise ValueError(f"every message needs a role and a content ({exc})") from None
                return emulated.encode(text, add_special_tokens=add_special)

            size = sum(len(str(m.get("content", ""))) for m in messages)
            return await _local(size, encode)
        body = {
            "model": self.model,
            "messages": list(messages),
            "add_generation_prompt": add_generation_prompt,
            "add_special_tokens": add_special,
        }
        return await self._remote(body)

    async def _remote(self, body: dict[str, Any]) -> Prompt:
        pods = [i for i in self.state.members("prefill") if i.healthy]
        if not pods:
            raise TokenizeError("no healthy prefill pod to tokenize the prompt")
        self._rng.shuffle(pods)
        last = ""
        timeout = aiohttp.ClientTimeout(total=TOKENIZE_TIMEOUT_S)
        for inst in pods[:2]:
            try:
                async with self.session.post(
                    f"{inst.member.url}/tokenize", json=body, headers=self.headers(),
                    timeout=timeout,
                ) as resp:  # fmt: skip
                    data = await resp.json(content_type=None)
                    if not isinstance(data, dict):
                        raise ValueError("the answer is not a JSON object")
                    if 400 <= resp.status < 500 and resp.status != 401:
                        err = data.get("error")
                        message = err.get("message") if isinstance(err, dict) else None
                        raise _Refused(str(message or f"HTTP {resp.status}"))
                    count = data.get("count")
                    if resp.status != 200 or not isinstance(count, int) or count < 0:
                        raise ValueError(f"HTTP {resp.status}")
                    ids = data.get("tokens")
                    if isinstance(ids, list) and len(ids) == count:
                        return Prompt(count, tuple(ids))
                    return Prompt(count)
            except _Refused as exc:  # the prompt's fault: another pod would refuse it too
                raise ValueError(str(exc)) from None
            except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
                last = f"{inst.name}: {exc or type(exc).__name__}"
        raise TokenizeError(f"/tokenize failed ({last})")


class _Refused(Exception):
    """A pod's 4xx to /tokenize: the prompt itself is at fault."""


async def _local(size: int, encode: Callable[[], Sequence[int]]) -> Prompt:
    """Run an in-process tokenizer, in a worker thread when the prompt is long."""
    if size <= OFF_LOOP_CHARS:
        return _measured(encode())
    return _measured(await asyncio.to_thread(encode))


def _measured(ids: Sequence[int]) -> Prompt:
    return Prompt(len(ids), tuple(ids))
