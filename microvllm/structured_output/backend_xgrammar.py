"""xgrammar (what vLLM uses by default): JSON schemas, JSON objects, regexes, EBNF
grammars and choices, compiled to a pushdown automaton over the vocabulary's bytes
(vLLM: ``v1/structured_output/backend_xgrammar.py``). Imported only when used."""

from __future__ import annotations

import json

import torch

from microvllm.structured_output.backend_types import (
    SpecCompiler,
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


class XgrammarSpecCompiler(SpecCompiler):
    """xgrammar's ``GrammarCompiler`` over one vocabulary. Pickled as the vocabulary's
    JSON (``TokenizerInfo.serialize_json``, ~1.6 MB for SmolLM2's 49,152 ids); the
    compiler itself is built on first use in whichever process compiles.
    ``cache_limit_bytes`` bounds xgrammar's cache of compiled grammars (unbounded by
    default: 30 distinct small regexes held 54 MB)."""

    def __init__(self, tokenizer_info_json: str, cache_limit_bytes: int):
        self.tokenizer_info_json, self.cache_limit_bytes = tokenizer_info_json, cache_limit_bytes
        self._compiler = None

    def __getstate__(self):
        return {"tokenizer_info_json": self.tokenizer_info_json, "cache_limit_bytes": self.cache_limit_bytes,
                "_compiler": None}

    def compiler(self):
        if self._compiler is None:
            import xgrammar

            info = xgrammar.TokenizerInfo.deserialize_json(self.tokenizer_info_json)
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_limit_bytes=self.cache_limit_bytes)
        return self._compiler

    def compile(self, kind: StructuredOutputOptions, spec: str, any_whitespace: bool):
        from microvllm.structured_output.errors import clean_compiler_message

        compiler = self.compiler()
        try:
            if kind == StructuredOutputOptions.JSON:
                return compiler.compile_json_schema(spec, any_whitespace=any_whitespace)
            if kind == StructuredOutputOptions.JSON_OBJECT:   # an object, not any JSON value
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=any_whitespace)
            if kind == StructuredOutputOptions.REGEX:
                return compiler.compile_regex(spec)
            if kind == StructuredOutputOptions.GRAMMAR:
                return compiler.compile_grammar(spec)
            if kind == StructuredOutputOptions.STRUCTURAL_TAG:
                return compiler.compile_structural_tag(spec)
            return compiler.compile_grammar(choice_grammar(json.loads(spec) if isinstance(spec, str) else spec))
        except RuntimeError as error:   # xgrammar reports a bad spec as RuntimeError
            raise ValueError(f"structured_outputs.{kind.value} cannot be compiled: "
                             f"{clean_compiler_message(str(error))}") from None

    def dump(self, compiled) -> str:
        return compiled.serialize_json()


def choice_grammar(choices: list[str]) -> str:
    """``["yes", "no"]`` -> ``root ::= "yes" | "no"``: an EBNF alternation, one string
    literal each, built in one pass. Characters outside ASCII stay themselves
    (``ensure_ascii=False``): JSON would escape "😀" as the surrogate pair
    ``\\ud83d\\ude00``, which xgrammar reads as two lone code points (U+FFFD twice)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


class XgrammarBackend(StructuredOutputBackend):
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, cache_limit_bytes: int = 64 << 20):
        try:
            import xgrammar
        except ImportError:
            raise ValueError("the xgrammar backend needs the xgrammar package: pip install xgrammar "
                             "(or choose structured_outputs_backend='course' for regex and choice)") from None
        self.xgr = xgrammar
        hf = getattr(tokenizer, "hf_tokenizer", tokenizer)
        stop = sorted(getattr(tokenizer, "eos_token_ids", None) or [hf.eos_token_id])
        self.tokenizer_info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=stop)
        self._spec_compiler = XgrammarSpecCompiler(self.tokenizer_info.serialize_json(), cache_limit_bytes)
        self.tokenizer, self.vocab_size = hf, vocab_size
        self._json_safe: dict[bool, torch.Tensor] = {}

    def spec_compiler(self) -> XgrammarSpecCompiler:
        return self._spec_compiler

    def load(self, blob: str):
        return self.xgr.CompiledGrammar.deserialize_json(blob, self.tokenizer_info)

    def compiled_size(self, compiled) -> int:
        return int(compiled.memory_size_bytes)

    def new_grammar(self, kind: StructuredOutputOptions, compiled, any_whitespace: bool) -> XgrammarGrammar:
        # A structural tag's calls are JSON too; its free text loses no more than raw control
        # characters (the mask cannot tell the two apart: it holds everywhere).
        is_json = kind in (StructuredOutputOptions.JSON, StructuredOutputOptions.JSON_OBJECT,
                           StructuredOutputOptions.STRUCTURAL_TAG)
        return XgrammarGrammar(self.xgr.GrammarMatcher(compiled),
                               self.json_safe(any_whitespace or kind == StructuredOutputOptions.STRUCTURAL_TAG)
                               if is_json else None)

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
