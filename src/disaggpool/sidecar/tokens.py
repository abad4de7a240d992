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
router's prefix index turns into block ids.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import aiohttp

from disaggpool.sidecar.config import TokenizerConfig
from disaggpool.sidecar.state import PoolState
from disaggpool.wordtokenizer import Tokenizer

__all__ = ["Prompt", "PromptCounter", "TokenizeError"]


class Prompt(NamedTuple):
    """A measured prompt: its length in tokens, and its token ids when the source gave them."""

    tokens: int
    ids: tuple[int, ...] | None = None


class TokenizeError(RuntimeError):
    """The prompt could not be measured (no prefill pod answered /tokenize)."""


class PromptCounter:
    def __init__(
        self, config: TokenizerConfig, state: PoolState, model: str, session: aiohttp.ClientSession
    ) -> None:
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
            return _measured(self._emulated.encode(prompt, add_special_tokens=add_special))
        if self._hf is not None:
            return _measured(self._hf.encode(prompt, add_special_tokens=add_special).ids)
        body = {"model": self.model, "prompt": prompt, "add_special_tokens": add_special}
        return await self._remote(body)

    async def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        add_special: bool = False,
    ) -> Prompt:
        if self._emulated is not None:
            text = self._emulated.chat_prompt(messages, add_generation_prompt)
            return _measured(self._emulated.encode(text, add_special_tokens=add_special))
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
        for inst in pods[:2]:
            try:
                async with self.session.post(f"{inst.member.url}/tokenize", json=body) as resp:
                    data = await resp.json(content_type=None)
                    if resp.status == 200 and isinstance(data.get("count"), int):
                        ids = data.get("tokens")
                        valid = isinstance(ids, list) and len(ids) == data["count"]
                        return Prompt(int(data["count"]), tuple(ids) if valid else None)
                    if 400 <= resp.status < 500:
                        err = (data.get("error") or {}) if isinstance(data, dict) else {}
                        raise ValueError(err.get("message") or f"HTTP {resp.status}")
                    last = f"{inst.name}: HTTP {resp.status}"
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                last = f"{inst.name}: {exc or type(exc).__name__}"
        raise TokenizeError(f"/tokenize failed ({last})")


def _measured(ids: Sequence[int]) -> Prompt:
    return Prompt(len(ids), tuple(ids))
