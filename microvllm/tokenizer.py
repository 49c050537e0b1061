"""The tokenizer path: text <-> token ids, around a Hugging Face fast tokenizer.

The engine only ever sees token ids. This file is the one place that turns a
prompt (or a chat) into ids and ids back into text::

    "Hello world"  --encode-->  [19556, 905]  --engine-->  [...new ids...]  --decode-->  text

    [{"role": "user", "content": "Hi"}]
        --apply_chat_template-->  "<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n"
        --encode (no extra specials)-->  [1, 4093, 198, ...]

It also answers the one question the engine asks the tokenizer while generating:
which ids end a sequence (``eos_token_ids``)?

Streaming text token by token is harder than it looks; that lives next door in
``detokenizer.py``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Files any one of which means "there is a tokenizer in this folder".
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


class Tokenizer:
    """A thin wrapper over a Hugging Face tokenizer with the calls the engine makes.

    ``hf_tokenizer`` is the wrapped ``transformers`` tokenizer, for anything else.
    """

    def __init__(self, hf_tokenizer: Any, eos_token_ids: set[int]):
        self.hf_tokenizer = hf_tokenizer
        self.eos_token_ids = eos_token_ids

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "Tokenizer":
        """Load the tokenizer saved in a Hugging Face model folder (local files only).

        ``eos_token_ids`` is the union of what ``generation_config.json`` says (an int
        or a list; ``config.json`` when there is no generation config, as in HF
        ``generate``) and the tokenizer's own ``eos_token``. Chat models often end a
        turn with a token that differs from the tokenizer's eos; both must stop.
        """
        from transformers import AutoTokenizer

        folder = Path(path).expanduser()
        if not folder.is_dir():
            raise FileNotFoundError(f"tokenizer folder {folder} does not exist: pass the path of a "
                                    "Hugging Face model folder (the one holding tokenizer.json)")
        if not any((folder / name).exists() for name in TOKENIZER_FILES):
            raise FileNotFoundError(
                f"no tokenizer files in {folder}: expected one of {', '.join(TOKENIZER_FILES)}. "
                "Save one there with tokenizer.save_pretrained(folder).")
        hf_tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True,
                                                     trust_remote_code=False)
        eos_token_ids = _read_eos_token_ids(folder)
        if hf_tokenizer.eos_token_id is not None:
            eos_token_ids.add(hf_tokenizer.eos_token_id)
        return cls(hf_tokenizer, eos_token_ids)

    # ---- text -> ids -------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``.

        With ``add_special_tokens=True`` the tokenizer adds whatever its own
        post-processor says (a BOS for Llama 2/3, nothing for SmolLM2) — the same
        ids ``tokenizer(text).input_ids`` gives a Hugging Face ``generate`` user.
        """
        return list(self.hf_tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def apply_chat_template(self, messages: list[dict[str, str]],
                            add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a chat rendered with the model's chat template.

        ``add_generation_prompt`` appends the opening of the assistant's turn
        (``<|im_start|>assistant\\n``) so that the model answers instead of
        continuing the user's message.
        """
        self._check_chat_template()
        # transformers 5 returns a BatchEncoding here; ask for the dict explicitly
        # so that older and newer versions both give us "input_ids".
        encoded = self.hf_tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=True)
        return list(encoded["input_ids"])

    def render_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, *,
                             chat_template: str | None = None, continue_final_message: bool = False,
                             chat_template_kwargs: dict | None = None) -> str:
        """The chat as the text the template produces (what ``apply_chat_template`` tokenizes).

        As vLLM's ``LLM.chat``: ``chat_template`` replaces the model's template;
        ``continue_final_message`` leaves the last (assistant) message open so the model
        continues it; ``chat_template_kwargs`` become template variables. A message's
        content may be OpenAI's list of parts, ``[{"type": "text", "text": "Hi"}]``.
        """
        if chat_template is None:
            self._check_chat_template()
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message=True continues the last message, so it cannot also "
                             "add a generation prompt: pass add_generation_prompt=False")
        return self.hf_tokenizer.apply_chat_template(
            [_flatten_content(m) for m in messages], chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, tokenize=False,
            **(chat_template_kwargs or {}))

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True,
                    **template_options) -> dict:
        """The chat as a prompt for the engine: ``{"prompt": text, "prompt_token_ids": ids}``
        (``template_options``: ``render_chat_template``'s). The template wrote the special
        tokens itself, so none are added again when the text is encoded."""
        text = self.render_chat_template(messages, add_generation_prompt, **template_options)
        return {"prompt": text, "prompt_token_ids": self.encode(text, add_special_tokens=False)}

    def _check_chat_template(self) -> None:
        if not getattr(self.hf_tokenizer, "chat_template", None):
            raise ValueError(
                "this tokenizer has no chat template (no chat_template in tokenizer_config.json "
                "and no chat_template.jinja), so chat() cannot format messages: use a chat/instruct "
                "model, or pass a plain text prompt to generate()")

    # ---- ids -> text -------------------------------------------------------------

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ``token_ids`` (special tokens such as ``<|im_end|>`` dropped by default,
        as ``SamplingParams.skip_special_tokens`` does)."""
        return self.hf_tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, token_ids: list[int]) -> list[str]:
        """The vocabulary entries themselves, e.g. ``[19556, 905] -> ['Hello', 'Ġworld']``
        (``Ġ`` is how byte-level BPE writes a space)."""
        return self.hf_tokenizer.convert_ids_to_tokens(token_ids)

    @property
    def vocab_size(self) -> int:
        """Number of tokens including added ones (``len(tokenizer)``). The model's
        logits may be wider (padded vocabularies); the sampler uses the logits' width."""
        return len(self.hf_tokenizer)

    @property
    def eos_token_id(self) -> int | None:
        """The tokenizer's own eos id (one of ``eos_token_ids``)."""
        return self.hf_tokenizer.eos_token_id

    def __repr__(self) -> str:
        name = Path(str(getattr(self.hf_tokenizer, "name_or_path", ""))).name
        return (f"Tokenizer({name!r}, vocab_size={self.vocab_size}, "
                f"eos_token_ids={sorted(self.eos_token_ids)})")


def _flatten_content(message: dict) -> dict:
    """OpenAI content parts -> one string, as vLLM does for text-only chat templates::

        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
        -> {"role": "user", "content": "a\\nb"}
    """
    content = message.get("content")
    if not isinstance(content, list):
        return message
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("text", "input_text"):
            raise ValueError(f"message content part {str(part)[:60]!r}: only text parts "
                             "({'type': 'text', 'text': ...}) are supported; these models read no images or audio")
        texts.append(part["text"])
    return {**message, "content": "\n".join(texts)}


def _read_eos_token_ids(folder: Path) -> set[int]:
    """eos ids from generation_config.json, else config.json; an int, a list, or absent."""
    for name in ("generation_config.json", "config.json"):
        file = folder / name
        if file.exists():
            value = json.loads(file.read_text()).get("eos_token_id")
            if value is None:
                return set()
            return {value} if isinstance(value, int) else {int(v) for v in value}
    return set()
