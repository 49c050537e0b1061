"""The prompt types ``generate`` and ``add_request`` accept (vLLM's ``vllm.inputs``)::

    "Hello"                                 a string: tokenized by the model's tokenizer
    TextPrompt(prompt="Hello")              the same, as a dict
    TokensPrompt(prompt_token_ids=[1, 2])   token ids, used as they are

They are plain dicts with a declared shape (``TypedDict``), so ``{"prompt_token_ids":
[1, 2]}`` works just as well. ``engine/prompts.py`` turns each into token ids.
"""

from __future__ import annotations

from typing import TypedDict, Union

from typing_extensions import NotRequired


class TextPrompt(TypedDict):
    prompt: str
    """The text; the tokenizer turns it into ids."""


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    """The token ids of the prompt, used as they are."""
    prompt: NotRequired[str]
    """Optional text for the output's ``prompt`` field (not tokenized)."""


PromptType = Union[str, TextPrompt, TokensPrompt]
