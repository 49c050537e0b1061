"""The prompt types ``generate`` and ``add_request`` accept (vLLM's ``vllm.inputs``)::

    "Hello"                                 a string: tokenized by the model's tokenizer
    TextPrompt(prompt="Hello")              the same, as a dict
    TokensPrompt(prompt_token_ids=[1, 2])   token ids, used as they are

They are plain dicts with a declared shape (``TypedDict``), so ``{"prompt_token_ids":
[1, 2]}`` works just as well. ``engine/prompts.py`` turns each into token ids.
"""

from __future__ import annotations

from typing import TypedDict, Union


class TextPrompt(TypedDict):
    prompt: str
    """The text; the tokenizer turns it into ids."""


class _OptionalPromptText(TypedDict, total=False):
    prompt: str
    """Optional text for the output's ``prompt`` field (not tokenized)."""


class TokensPrompt(_OptionalPromptText):
    prompt_token_ids: list[int]
    """The token ids of the prompt, used as they are."""


PromptType = Union[str, TextPrompt, TokensPrompt]
