"""The interface every structured-output backend implements (vLLM:
``v1/structured_output/backend_types.py``).

    backend = SomeBackend(tokenizer, vocab_size)          once per engine
    grammar = backend.compile_grammar(kind, spec)        once per request (slow: off-thread;
                                                         a server: in a worker process, see SpecCompiler)
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
    STRUCTURAL_TAG = "structural_tag"   # free text; after a trigger, one of the tags (xgrammar's)


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


class SpecCompiler(ABC):
    """The slow half of compiling: spec text -> a compiled grammar, with no matcher state.
    Picklable, so that a server can run it in a worker process (``compile_workers.py``),
    where a crash or a runaway compile cannot take the engine down::

        engine process                                  compile worker process
        backend.spec_compiler() ── pickled once ──────> compiler
        (kind, spec, any_whitespace) ─────────────────> compiled = compiler.compile(...)
        compiled = backend.load(blob) <── blob ──────── blob = compiler.dump(compiled)
        grammar = backend.new_grammar(kind, compiled, any_whitespace): one per sample
    """

    @abstractmethod
    def compile(self, kind: StructuredOutputOptions, spec: str, any_whitespace: bool):
        """The compiled grammar; ``ValueError`` saying what is wrong with ``spec``."""

    def dump(self, compiled):
        """``compiled`` as something picklable (to cross back from a worker process)."""
        return compiled


class StructuredOutputBackend(ABC):
    name: str

    @abstractmethod
    def spec_compiler(self) -> SpecCompiler: ...

    def load(self, blob):
        """What ``SpecCompiler.dump`` made, as a compiled grammar in this process."""
        return blob

    @abstractmethod
    def new_grammar(self, kind: StructuredOutputOptions, compiled, any_whitespace: bool) -> StructuredOutputGrammar:
        """A fresh matcher (one request sample's state) over a compiled grammar."""

    def compiled_size(self, compiled) -> int:
        """Bytes a compiled grammar holds (what the manager's cache counts)."""
        return 1

    def compile_grammar(self, kind: StructuredOutputOptions, spec: str, *,
                        any_whitespace: bool = True) -> StructuredOutputGrammar:
        """Compile ``spec`` here, in this process; raises ``ValueError`` saying what is
        wrong with it. ``any_whitespace=False``: JSON in one compact layout."""
        compiled = self.spec_compiler().compile(kind, spec, any_whitespace)
        return self.new_grammar(kind, compiled, any_whitespace)
