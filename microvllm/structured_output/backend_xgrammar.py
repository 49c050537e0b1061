"""xgrammar (what vLLM uses by default): JSON schemas, JSON objects, regexes, EBNF
grammars and choices, compiled to a pushdown automaton over the vocabulary's bytes
(vLLM: ``v1/structured_output/backend_xgrammar.py``). Imported only when used."""

from __future__ import annotations

import json

import torch

from microvllm.structured_output.backend_types import (
    StructuredOutputBackend,
    StructuredOutputGrammar,
    StructuredOutputOptions,
)


class XgrammarGrammar(StructuredOutputGrammar):
    def __init__(self, matcher, also_allowed: torch.Tensor | None = None):
        self.matcher = matcher
        self.also_allowed = also_allowed   # packed words ANDed into every mask (see json_safe)
        self.num_accepted = 0

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        for index, token in enumerate(tokens):
            if not self.matcher.accept_token(token):
                self.matcher.rollback(index)   # leave it as it was
                return False
        self.num_accepted += len(tokens)
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)
        if self.also_allowed is not None:
            bitmask[row] &= self.also_allowed

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)
        self.num_accepted -= num_tokens

    def reset(self) -> None:
        self.matcher.reset()
        self.num_accepted = 0


class XgrammarBackend(StructuredOutputBackend):
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int):
        try:
            import xgrammar
        except ImportError:
            raise ValueError("the xgrammar backend needs the xgrammar package: pip install xgrammar "
                             "(or choose structured_outputs_backend='course' for regex and choice)") from None
        self.xgr = xgrammar
        hf = getattr(tokenizer, "hf_tokenizer", tokenizer)
        stop = sorted(getattr(tokenizer, "eos_token_ids", None) or [hf.eos_token_id])
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=stop)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1)
        self.tokenizer, self.vocab_size = hf, vocab_size
        self._json_safe: dict[bool, torch.Tensor] = {}

    def json_safe(self, any_whitespace: bool) -> torch.Tensor:
        """Packed words of the ids whose text holds no raw control character. JSON allows
        none inside strings (RFC 8259), yet xgrammar's string rule lets most through (seen:
        "\x1a"); outside strings only whitespace may appear, and without free whitespace
        not even \t \n \r. So JSON kinds also mask these out."""
        if any_whitespace not in self._json_safe:
            from microvllm.structured_output.bitmask import pack

            allowed_controls = "\t\n\r" if any_whitespace else ""
            safe = torch.ones(self.vocab_size, dtype=torch.bool)
            for token_id in range(min(self.vocab_size, len(self.tokenizer))):
                text = self.tokenizer.decode([token_id], skip_special_tokens=False)
                if any(ord(ch) < 32 and ch not in allowed_controls for ch in text):
                    safe[token_id] = False
            self._json_safe[any_whitespace] = pack(safe)
        return self._json_safe[any_whitespace]

    def compile_grammar(self, kind: StructuredOutputOptions, spec: str, *,
                        any_whitespace: bool = True) -> XgrammarGrammar:
        try:
            if kind == StructuredOutputOptions.JSON:
                compiled = self.compiler.compile_json_schema(spec, any_whitespace=any_whitespace)
            elif kind == StructuredOutputOptions.JSON_OBJECT:   # an object, not any JSON value
                compiled = self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=any_whitespace)
            elif kind == StructuredOutputOptions.REGEX:
                compiled = self.compiler.compile_regex(spec)
            elif kind == StructuredOutputOptions.GRAMMAR:
                compiled = self.compiler.compile_grammar(spec)
            else:   # CHOICE: an EBNF alternation of JSON-quoted strings
                choices = json.loads(spec) if isinstance(spec, str) else spec
                compiled = self.compiler.compile_grammar(
                    "root ::= " + " | ".join(json.dumps(choice) for choice in choices))
        except RuntimeError as error:   # xgrammar reports a bad spec as RuntimeError
            raise ValueError(f"structured_outputs.{kind.value} cannot be compiled: {error}") from None
        is_json = kind in (StructuredOutputOptions.JSON, StructuredOutputOptions.JSON_OBJECT)
        return XgrammarGrammar(self.xgr.GrammarMatcher(compiled),
                               self.json_safe(any_whitespace) if is_json else None)
