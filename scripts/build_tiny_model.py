"""Build a tiny random-weight Llama with its own tokenizer, fully offline and deterministic.

Run it with the vLLM venv's interpreter (it needs torch, tokenizers and transformers)::

    /var/cache/disaggpool/vllm-venv/bin/python scripts/build_tiny_model.py OUT_DIR

The text the model generates is meaningless; it exists so that real vLLM engines can be started
on a CPU without a model hub (see tests/realvllm/README.md). vLLM's CPU attention needs
head_dim 64 (hidden 256 / 4 heads); head_dim 16 is rejected.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

SEED = 20240601
VOCAB_SIZE = 512
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]
PUNCTUATION = [".", ",", "?", "!", ":", ";"]
# A plain template: "<s><|user|> hi there </s><|assistant|>". Handles string content and
# OpenAI-style lists of text parts.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['content'] is string %}{% set text = message['content'] %}"
    "{% else %}{% set text = message['content'] | map(attribute='text') | join(' ') %}{% endif %}"
    "<|{{ message['role'] }}|> {{ text }} {{ eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def corpus(rng: random.Random) -> list[str]:
    """A few hundred lines of generated words (deterministic for a given rng)."""
    onsets = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "sh", "tr"]
    vowels = ["a", "e", "i", "o", "u", "ai", "ou"]
    codas = ["", "n", "r", "s", "l", "k"]
    words: list[str] = []
    seen: set[str] = set()
    while len(words) < 440:
        w = "".join(
            rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas)
            for _ in range(rng.randint(1, 3))
        )
        if w not in seen:
            seen.add(w)
            words.append(w)
    lines = []
    # Every word appears at least once, so the vocabulary is exactly the generated list.
    for i in range(0, len(words), 10):
        lines.append(" ".join(words[i : i + 10]) + " .")
    weights = [1.0 / (rank + 1) for rank in range(len(words))]
    for _ in range(400):
        n = rng.randint(5, 20)
        sent = rng.choices(words, weights=weights, k=n)
        lines.append(" ".join(sent) + " " + rng.choice(PUNCTUATION))
    return lines


def build_tokenizer(out: Path, rng: random.Random):  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(
        vocab_size=VOCAB_SIZE, min_frequency=1, special_tokens=SPECIALS, show_progress=False
    )
    tok.train_from_iterator(corpus(rng), trainer=trainer)
    vocab = tok.get_vocab()
    assert len(vocab) <= VOCAB_SIZE, len(vocab)
    assert [vocab[s] for s in SPECIALS] == list(range(len(SPECIALS))), "special ids moved"
    bos, eos = vocab["<s>"], vocab["</s>"]
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", bos), ("</s>", eos)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        additional_special_tokens=SPECIALS[4:],
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def build_model(out: Path, tokenizer) -> None:  # type: ignore[no-untyped-def]
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(out, safe_serialization=True)


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit(f"usage: {sys.argv[0]} OUT_DIR")
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(SEED)
    tokenizer = build_tokenizer(out, rng)
    build_model(out, tokenizer)
    # Smoke check: the saved folder loads back and the chat template renders.
    from transformers import AutoTokenizer

    back = AutoTokenizer.from_pretrained(out)
    text = back.apply_chat_template(
        [{"role": "user", "content": "hello there"}], tokenize=False, add_generation_prompt=True
    )
    ids = back(text, add_special_tokens=False)["input_ids"]
    print(f"tiny model written to {out}: vocab {len(back)}, chat prompt {text!r} -> {ids}")


if __name__ == "__main__":
    main()
