"""A deterministic word-level tokenizer: exact prompt lengths without a model or a hub.

One token per word (a run of letters, digits or underscores) and one per other non-space
character, so ``"Hello, world!"`` is 4 tokens; like a Llama tokenizer it prepends BOS when asked
for special tokens (a completion prompt of 7 words is 8 tokens, as on real vLLM). Ids 0-2 are the
specials ``<unk> <s> </s>``; the rest is a fixed vocabulary of synthetic words (``id ->
"bakodu"``), and any other word maps into it by a stable hash, so the same text always gives the
same ids, across processes and runs. Generated text is made of vocabulary words with a leading
space each, so re-tokenising an answer gives back exactly its token ids.

A shared module, not a test double: the emulator counts prompts, serves `/tokenize` and writes
its output text with it, and the sidecar's ``emulator`` prompt-count mode uses it to price
prompts for emulated pools exactly, in process.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Iterable, Mapping, Sequence

__all__ = ["Tokenizer"]

SPECIALS = ("<unk>", "<s>", "</s>")
BOS_ID = 1
FIRST_WORD_ID = len(SPECIALS)  # ids below are special tokens, never generated
_TOKEN = re.compile(r"<unk>|<s>|</s>|\w+|[^\w\s]")
_CONSONANTS = "bdfghjklmnprstvwxyz"  # 19 plus the empty onset below: 20
_VOWELS = "aeiou"
_SYLLABLES = tuple(c + v for c in ("", *_CONSONANTS) for v in _VOWELS)  # 100 syllables
_SYLLABLE_INDEX = {s: i for i, s in enumerate(_SYLLABLES)}


class Tokenizer:
    """Word-level tokenizer over a synthetic vocabulary of `vocab_size` words."""

    def __init__(self, vocab_size: int = 32000) -> None:
        if vocab_size <= FIRST_WORD_ID:
            raise ValueError(f"vocab_size must exceed {FIRST_WORD_ID}")
        self.vocab_size = vocab_size
        self._width = 3
        while len(_SYLLABLES) ** self._width < vocab_size:
            self._width += 1
        self._ids: dict[str, int] = {}  # filled lazily: most words of a prompt are not vocab words

    # ------------------------------------------------------------------ vocabulary
    def word(self, token_id: int) -> str:
        """The vocabulary word of an id (three or more syllables, all distinct)."""
        if token_id < FIRST_WORD_ID:
            return SPECIALS[token_id]
        n = len(_SYLLABLES)
        out = []
        x = token_id
        for _ in range(self._width):
            x, r = divmod(x, n)
            out.append(_SYLLABLES[r])
        return "".join(reversed(out))

    def token_text(self, token_id: int) -> str:
        """The detokenised text of one generated token (a space, then its word)."""
        return " " + self.word(token_id)

    def _id(self, piece: str) -> int:
        hit = self._ids.get(piece)
        if hit is not None:
            return hit
        ident = SPECIALS.index(piece) if piece in SPECIALS else self._vocab_id(piece)
        if ident is None:
            digest = hashlib.blake2b(piece.encode("utf-8"), digest_size=8).digest()
            span = self.vocab_size - FIRST_WORD_ID
            ident = FIRST_WORD_ID + int.from_bytes(digest, "big") % span
        if len(self._ids) < 1_000_000:  # bounded cache: arbitrary input cannot grow it forever
            self._ids[piece] = ident
        return ident

    def _vocab_id(self, piece: str) -> int | None:
        """The id whose word is `piece`, if it is a vocabulary word (parsed, not looked up)."""
        if not self._width <= len(piece) <= 2 * self._width or not piece.isalpha():
            return None
        x = 0
        i = 0
        for _ in range(self._width):
            # An onset is one consonant or none, so a consonant always starts a 2-letter syllable.
            size = 2 if piece[i : i + 1] in _CONSONANTS else 1
            syllable = _SYLLABLE_INDEX.get(piece[i : i + size])
            if syllable is None:
                return None
            x, i = x * len(_SYLLABLES) + syllable, i + size
        if i != len(piece) or not FIRST_WORD_ID <= x < self.vocab_size or self.word(x) != piece:
            return None
        return x

    # ------------------------------------------------------------------ text <-> ids
    def pieces(self, text: str) -> list[str]:
        """The text of each token of `text`."""
        return _TOKEN.findall(text)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; `add_special_tokens` puts BOS first (vLLM does for prompts)."""
        ids = [self._id(p) for p in _TOKEN.findall(text)]
        return [BOS_ID, *ids] if add_special_tokens else ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`, skipping special tokens (vLLM's `skip_special_tokens` default)."""
        return "".join(self.token_text(i) for i in ids if i >= FIRST_WORD_ID)

    def sample(self, rng: random.Random) -> int:
        """A random generated token: any vocabulary word, never a special token."""
        return rng.randrange(FIRST_WORD_ID, self.vocab_size)

    # ------------------------------------------------------------------ chat
    @staticmethod
    def chat_prompt(messages: Sequence[Mapping[str, str]], add_generation_prompt: bool) -> str:
        """A fixed, simple chat template (BOS included, as chat templates do); its markup is
        tokenised and counted like any text."""
        parts = ["<s>"] + [f"<|{m['role']}|>\n{m['content']}\n" for m in messages]
        if add_generation_prompt:
            parts.append("<|assistant|>\n")
        return "".join(parts)

    # ------------------------------------------------------------------ for other clients
    def huggingface_files(self) -> dict[str, str]:
        """This tokenizer as a Hugging Face tokenizer directory (file name -> text), for
        clients that count tokens themselves (benchmark clients such as aiperf or guidellm).

        A `tokenizers` WordLevel model over the same vocabulary, split on whitespace then into
        the same pieces, with BOS added for special tokens and the same chat template. Every
        text gets the same number of tokens as here, and vocabulary words the same ids; a word
        outside the vocabulary is `<unk>` there (here it maps into the vocabulary by a hash), a
        difference in ids only, which no length-driven client sees."""
        specials = [
            {
                "id": i,
                "content": s,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for i, s in enumerate(SPECIALS)
        ]
        bos = SPECIALS[BOS_ID]
        seq = {"Sequence": {"id": "A", "type_id": 0}}
        tokenizer = {
            "version": "1.0",
            "truncation": None,
            "padding": None,
            "added_tokens": specials,
            "normalizer": None,
            "pre_tokenizer": {
                "type": "Sequence",
                "pretokenizers": [
                    {"type": "WhitespaceSplit"},
                    {
                        "type": "Split",
                        "pattern": {"Regex": r"\w+|[^\w\s]"},
                        "behavior": "Isolated",
                        "invert": False,
                    },
                ],
            },
            "post_processor": {
                "type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, seq],
                "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, seq, seq],
                "special_tokens": {bos: {"id": bos, "ids": [BOS_ID], "tokens": [bos]}},
            },
            "decoder": None,
            "model": {
                "type": "WordLevel",
                "vocab": {self.word(i): i for i in range(self.vocab_size)},
                "unk_token": SPECIALS[0],
            },
        }
        template = (
            "<s>{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + '\n' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
        )
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": bos,
            "eos_token": SPECIALS[2],
            "unk_token": SPECIALS[0],
            "clean_up_tokenization_spaces": False,
            "model_max_length": 1_000_000,
            "chat_template": template,
        }
        return {
            "tokenizer.json": json.dumps(tokenizer),
            "tokenizer_config.json": json.dumps(config, indent=2),
            "special_tokens_map.json": json.dumps(
                {"bos_token": bos, "eos_token": SPECIALS[2], "unk_token": SPECIALS[0]}, indent=2
            ),
        }
