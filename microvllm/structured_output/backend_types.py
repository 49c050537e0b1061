"""The interface every structured-output backend implements (vLLM:
``v1/structured_output/backend_types.py``).

    backend = SomeBackend(tokenizer, vocab_size)          once per engine
    grammar = backend.compile_grammar(kind, spec)        once per request (slow: off-thread)
    each step:  grammar.fill_bitmask(bitmask, row)       which ids may come next
    after it:   grammar.accept_tokens(request_id, ids)   advance by what was sampled
                grammar.is_terminated()                  EOS was accepted: done
    preempted or rejected tokens: grammar.rollback(n)
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod

import torch


class StructuredOutputOptions(enum.Enum):
    JSON = "json"                 # a JSON schema
    JSON_OBJECT = "json_object"   # any JSON object
    REGEX = "regex"
    GRAMMAR = "grammar"           # EBNF / Lark
    CHOICE = "choice"             # one of a list of strings


class StructuredOutputGrammar(ABC):
    """One request's matcher: where it is in its grammar."""

    @abstractmethod
    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        """Advance by ``tokens``; False (and unchanged) if one is not allowed."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write which ids may come next into ``bitmask[row]``."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once EOS was accepted where the grammar may end."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""

    @abstractmethod
    def reset(self) -> None: ...


class StructuredOutputBackend(ABC):
    name: str

    @abstractmethod
    def compile_grammar(self, kind: StructuredOutputOptions, spec: str, *,
                        any_whitespace: bool = True) -> StructuredOutputGrammar:
        """Compile ``spec``; raises ``ValueError`` saying what is wrong with it.
        ``any_whitespace=False``: JSON in one compact layout."""
