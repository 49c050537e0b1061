"""Turn what the user passed as a prompt into token ids, checked at the door."""

from __future__ import annotations

import functools
import json
from pathlib import Path

from microvllm.tokenizer import Tokenizer


class PromptProcessor:
    def __init__(self, tokenizer: Tokenizer | None, eos_token_ids: set[int], vocab_size: int | None):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size

    @classmethod
    def from_model_folder(cls, folder: Path, vocab_size: int | None = None) -> "PromptProcessor":
        has_tokenizer = (folder / "tokenizer.json").exists() or (folder / "tokenizer.model").exists()
        tokenizer = Tokenizer.from_pretrained(folder) if has_tokenizer else None
        eos = set(tokenizer.eos_token_ids) if tokenizer else _config_eos(folder)
        return cls(tokenizer, eos, vocab_size)

    @property
    def eos_token_id(self) -> int | None:
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            return self.tokenizer.eos_token_id
        return min(self.eos_token_ids) if self.eos_token_ids else None

    def process(self, prompt) -> tuple[str | None, list[int]]:
        """Return (prompt text or None, token ids) for a str or a dict prompt."""
        if isinstance(prompt, str):
            return prompt, self._encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt and isinstance(prompt["prompt"], str):
                return prompt["prompt"], self._encode(prompt["prompt"])
            raise ValueError(f"prompt dict has keys {sorted(prompt)}: give 'prompt_token_ids' "
                             "(a list of ints) or 'prompt' (a string)")
        raise TypeError(f"prompt must be a str or a dict such as {{'prompt_token_ids': [1, 2, 3]}}, "
                        f"got {type(prompt).__name__}: {str(prompt)[:60]!r}")

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token can stand for: a bound for "this text needs at
        least len(text) / max_token_chars tokens" (a byte-level token's string has one
        character per byte, so its decoded text is never longer)."""
        tokenizer = self.tokenizer
        if tokenizer is None:   # no text prompts at all: nothing to bound
            return 1
        tokens = tokenizer.convert_ids_to_tokens(list(range(tokenizer.vocab_size)))
        return max(1, max(len(t) for t in tokens if t is not None))

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word as token ids, as it would appear at the start of a text and after a
        space (``"York"`` and ``" York"`` are different tokens), without special tokens."""
        if self.tokenizer is None:
            raise ValueError("bad_words needs a tokenizer, and this model folder has none: "
                             "remove bad_words (or ban ids with logit_bias={id: -100})")
        sequences: list[list[int]] = []
        for word in words:
            for variant in (word, " " + word.lstrip()):
                ids = self.tokenizer.encode(variant, add_special_tokens=False)
                if ids and ids not in sequences:
                    sequences.append(ids)
        return sequences

    def _encode(self, text: str) -> list[int]:
        if not text:
            raise ValueError("prompt is an empty string: give at least one character "
                             "(or {'prompt_token_ids': [...]})")
        if self.tokenizer is None:
            raise ValueError("this model folder has no tokenizer, so text prompts cannot be encoded: "
                             "pass {'prompt_token_ids': [...]} instead")
        return self.tokenizer.encode(text)

    def _check_ids(self, ids) -> list[int]:
        if not isinstance(ids, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise TypeError(f"prompt_token_ids must be a list of ints, got {str(ids)[:60]!r}")
        if not ids:
            raise ValueError("prompt_token_ids is empty: give at least one token id")
        bad = [t for t in ids if t < 0 or (self.vocab_size is not None and t >= self.vocab_size)]
        if bad:
            raise ValueError(f"prompt_token_ids contains {bad[:5]} outside the vocabulary "
                             f"[0, {self.vocab_size}): every id must be 0 <= id < vocab_size")
        return list(ids)


def _config_eos(folder: Path) -> set[int]:
    for name in ("generation_config.json", "config.json"):
        path = folder / name
        if path.exists():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if eos is not None:
                return set(eos) if isinstance(eos, list) else {eos}
    return set()
