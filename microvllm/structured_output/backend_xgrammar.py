"""xgrammar (what vLLM uses by default): JSON schemas, JSON objects, regexes, EBNF
grammars and choices, compiled to a pushdown automaton over the vocabulary's bytes
(vLLM: ``v1/structured_output/backend_xgrammar.py``). Imported only when used."""

from __future__ import annotations

import json

import torch

from microvllm.structured_output.backend_types import (StructuredOutputBackend, StructuredOutputGrammar,
                                                       StructuredOutputOptions)


class XgrammarGrammar(StructuredOutputGrammar):
    def __init__(self, matcher):
        self.matcher = matcher
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

    def compile_grammar(self, kind: StructuredOutputOptions, spec: str) -> XgrammarGrammar:
        try:
            if kind == StructuredOutputOptions.JSON:
                compiled = self.compiler.compile_json_schema(spec if isinstance(spec, str) else json.dumps(spec))
            elif kind == StructuredOutputOptions.JSON_OBJECT:
                compiled = self.compiler.compile_builtin_json_grammar()
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
        return XgrammarGrammar(self.xgr.GrammarMatcher(compiled))
