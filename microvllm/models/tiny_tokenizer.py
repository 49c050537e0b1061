"""A tiny byte-level BPE tokenizer for tiny random test models.

Real tokenizers have 30k-150k tokens; a tiny random model with a few hundred
thousand parameters wants a vocabulary of a few hundred. ``build_tiny_tokenizer``
trains one in well under a second, deterministically, on the short English text
below, and writes an ordinary Hugging Face tokenizer folder::

    folder/
      tokenizer.json          the BPE model: 256 byte tokens + merges + 3 specials
      tokenizer_config.json   special tokens and the chat template

    id   token              role
    0    <|endoftext|>      unk / pad
    1    <|im_start|>       starts a chat turn
    2    <|im_end|>         ends a chat turn = eos (as in SmolLM2)
    3..  the 256 bytes, then learned merges ("th", " the", ...)

Byte-level means every string maps to tokens: text is first turned into UTF-8
bytes, and every byte has its own token. A character outside the training text
(an emoji, a CJK character) simply becomes 2-4 byte tokens, which is exactly what
makes incremental detokenization interesting: one token can be half a character.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# The same ChatML shape as SmolLM2's template, without its default system prompt.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Training text: plain English with the words a course about inference uses.
TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. A language model reads a prompt,
one token at a time, and predicts the next token. The engine keeps a cache of
keys and values for every token it has seen, so that each new token only needs
one step of attention over the past. The scheduler decides which requests run in
each step; the model runner turns that plan into tensors; the sampler picks the
next token from the logits. Greedy sampling always takes the most likely token.
Random sampling divides the logits by a temperature, keeps the top k tokens or
the smallest set whose probability is at least top p, and then draws one.
Hello, world! How are you today? I am fine, thank you. What is the capital of
France? The capital of France is Paris. Once upon a time there was a small
robot who liked to read books about the sea, the sky and the stars.
1 2 3 4 5 6 7 8 9 10 11 12 100 1000 2024 3.14 (a) [b] {c} "quoted" 'single'
user: Please write a short poem.  assistant: Roses are red, violets are blue.
"""


def build_tiny_tokenizer(folder: Path, vocab_size: int = 512, added_tokens: Sequence[str] = ()) -> None:
    """Train a byte-level BPE tokenizer of ``vocab_size`` tokens and save it in ``folder``.

    ``added_tokens`` (e.g. ``("<think>", "</think>")``, as Qwen3's tokenizer has them): text
    that is one token each, with the last ids (``vocab_size - len(added_tokens)`` on), not
    special (decoding keeps them in the text, as a model's reasoning and tool-call tags are).

    The result loads with ``transformers.AutoTokenizer.from_pretrained(folder)`` and
    with ``microvllm.tokenizer.Tokenizer.from_pretrained(folder)``. Training is
    deterministic: the same ``vocab_size`` always writes the same files.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    min_size = len(SPECIAL_TOKENS) + 256 + len(added_tokens)
    if vocab_size < min_size:
        raise ValueError(f"vocab_size={vocab_size} is too small: a byte-level tokenizer needs "
                         f"at least {min_size} tokens (3 special + 256 bytes + the added ones); use {min_size} or more")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)

    tokenizer = Tokenizer(models.BPE())
    # ByteLevel maps each UTF-8 byte to a printable character (space -> "Ġ"), so BPE
    # works on bytes and no input is ever unknown.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(added_tokens),
        special_tokens=SPECIAL_TOKENS,  # trained first, so they get ids 0, 1, 2
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes
        show_progress=False,
    )
    tokenizer.train_from_iterator(TRAINING_TEXT.splitlines(keepends=True), trainer=trainer)
    tokenizer.add_tokens([AddedToken(text, special=False, normalized=False) for text in added_tokens])
    tokenizer.save(str(folder / "tokenizer.json"))

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,  # like SmolLM2: encode() adds no special tokens
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>",
        "model_max_length": 2048,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
