"""The course's own backend: a regex's DFA (``regex_dfa.py``) turned into token masks.

The model does not write characters, it writes tokens, and one token spans several
characters (so several DFA states). For the DFA state ``s`` the text is in, token ``t``
may come next iff reading t's characters from ``s`` never reaches a dead state::

    pattern  [0-9]+(\\.[0-9]+)?         state after "3":  digits or "." may follow
    token "14"    -> 1, 4: live     allowed        token ".5"  -> ., 5: live     allowed
    token "."     -> live           allowed        token "5a"  -> 5, a: dead     masked
    token " 7"    -> " ": dead      masked         EOS: allowed (the text "3" matches)

Checking every vocabulary entry byte by byte is slow (49,152 entries for SmolLM2), so
the vocabulary is a trie: tokens that share a prefix share its walk, and a dead prefix
prunes all tokens below it. Each state's mask is remembered: a pattern visits few states.

The DFA reads UTF-8 bytes, and so does the trie: a token is its bytes, even when they
are only part of a character (a byte-level BPE has such tokens for every character it
has no whole token for). A character split over tokens is then no special case::

    choice ["😀 smile", "🙂 ok"]        😀 = F0 9F 98 80,  🙂 = F0 9F 99 82
    SmolLM2's tokens, each [its bytes]:

    start ─[F0 9F]─> a ─[98]────> b ─[80]─> c ─[20 73 6D 69 6C 65]─> accept    😀 " smile"
                     └─[99 82]──────────> d ─[20 6F 6B]───────────> accept    🙂 " ok"

    State a sits inside a character: only a token whose bytes start with 98 or 99 may
    come next ([98], [99 82], ...); [80], " ok" and whole characters are masked.

Special tokens are never allowed while a grammar runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from microvllm.structured_output.backend_types import (
    SpecCompiler,
    StructuredOutputBackend,
    StructuredOutputGrammar,
    StructuredOutputOptions,
)
from microvllm.structured_output.bitmask import pack
from microvllm.structured_output.regex_dfa import RegexDFA
from microvllm.structured_output.token_bytes import is_text, token_bytes_reader


class TokenTrie:
    """The vocabulary's tokens as a trie of their UTF-8 bytes: ``children[node]`` maps a
    byte (an int) to a node, ``ends[node]`` lists the ids whose bytes end there. Node 0
    is the empty prefix. A text given as ``str`` is read as its UTF-8 bytes."""

    def __init__(self, texts: dict[int, str] | dict[int, bytes]):
        self.children: list[dict[int, int]] = [{}]
        self.ends: list[list[int]] = [[]]
        for token_id, text in texts.items():
            node = 0
            for byte in text.encode() if isinstance(text, str) else text:
                nxt = self.children[node].get(byte)
                if nxt is None:
                    nxt = len(self.children)
                    self.children[node][byte] = nxt
                    self.children.append({})
                    self.ends.append([])
                node = nxt
            self.ends[node].append(token_id)

    def allowed_from(self, dfa: RegexDFA, state: int) -> list[int]:
        """Every id whose whole text can be read from ``state`` without dying.

        A depth-first walk of the trie, carrying the DFA state each prefix reaches (an
        edge is one byte: an ASCII character, or a piece of a longer one)::

            node 0 ("", state) ──"1"──> ("1", s1) ──"4"──> ("14", s2)   ids ending at "1", "14": allowed
                               └─" "──> DEAD: prune, never walk below (" 7", " a", ...)

        Each live edge is stepped once (``dfa.step`` is never called on ``dfa.DEAD``). Node 0 holds
        only empty tokens' ids (the engine's vocabulary has none), never allowed: they add nothing."""
        ### BEGIN SOLUTION
        allowed: list[int] = []
        stack = [(0, state)]
        while stack:
            node, at = stack.pop()
            if node:
                allowed.extend(self.ends[node])
            for ch, child in self.children[node].items():
                nxt = dfa.step(at, ch)
                if nxt != dfa.DEAD:
                    stack.append((child, nxt))
        return allowed
        ### END SOLUTION


class TokenVocabulary:
    """What the backend needs of a tokenizer: each usable id's bytes, the EOS ids.

    ``token_bytes[id]``: what the id adds to the output's UTF-8 bytes (every id but the
    special ones); ``texts[id]``: the same as text, for the ids that are whole characters
    (for people to read: ``b"\\xf0\\x9f"``, the start of 😀, has none)."""

    def __init__(self, tokenizer, vocab_size: int, trie_class: type = TokenTrie):
        hf = getattr(tokenizer, "hf_tokenizer", tokenizer)
        special = set(getattr(hf, "all_special_ids", []))
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(getattr(tokenizer, "eos_token_ids", None) or {hf.eos_token_id} - {None})
        read_bytes = token_bytes_reader(hf)
        self.token_bytes: dict[int, bytes] = {}
        for token_id in range(min(vocab_size, len(hf))):
            data = None if token_id in special else read_bytes(token_id)
            if data:
                self.token_bytes[token_id] = data
        self.texts = {token_id: data.decode() for token_id, data in self.token_bytes.items() if is_text(data)}
        self.trie = trie_class(self.token_bytes)


class RegexGrammar(StructuredOutputGrammar):
    """A matcher: the DFA state after each accepted token (a stack, for rollback)."""

    def __init__(self, dfa: RegexDFA, vocabulary: TokenVocabulary, masks: dict[int, torch.Tensor]):
        self.dfa, self.vocabulary, self._masks = dfa, vocabulary, masks
        self.states = [dfa.start]
        self.terminated = False

    def allowed_ids(self) -> torch.Tensor:
        """bool [vocab_size]: the ids that may come next."""
        state = self.states[-1]
        if state not in self._masks:
            mask = torch.zeros(self.vocabulary.vocab_size, dtype=torch.bool)
            mask[self.vocabulary.trie.allowed_from(self.dfa, state)] = True
            if self.dfa.is_accepting(state):
                mask[self.vocabulary.eos_token_ids] = True
            self._masks[state] = mask
        return self._masks[state]

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        states = list(self.states)
        for token in tokens:
            if self.terminated:
                return False
            state = states[-1]
            if token in self.vocabulary.eos_token_ids:
                if not self.dfa.is_accepting(state):
                    return False
                self.terminated = True
                states.append(state)
                continue
            data = self.vocabulary.token_bytes.get(token)
            nxt = self.dfa.walk(state, data) if data is not None else self.dfa.DEAD
            if nxt == self.dfa.DEAD:
                return False
            states.append(nxt)
        self.states = states
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = pack(self.allowed_ids())

    def is_terminated(self) -> bool:
        return self.terminated

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            del self.states[-num_tokens:]
            self.terminated = False

    def reset(self) -> None:
        self.states, self.terminated = [self.dfa.start], False


class RegexBackend(StructuredOutputBackend):
    """``regex`` and ``choice`` with the course's DFA; other kinds need xgrammar."""

    name = "course"

    def __init__(self, tokenizer, vocab_size: int, trie_class: type = TokenTrie):
        self.vocabulary = TokenVocabulary(tokenizer, vocab_size, trie_class)   # trie_class: exercise 15's

    def spec_compiler(self) -> CourseSpecCompiler:
        return CourseSpecCompiler()

    def new_grammar(self, kind: StructuredOutputOptions, compiled: CompiledRegex,
                    any_whitespace: bool) -> RegexGrammar:
        return RegexGrammar(compiled.dfa, self.vocabulary, compiled.masks)

    def compiled_size(self, compiled: CompiledRegex) -> int:
        """What the manager's cache counts for a pattern: its masks, one bool per id each.
        They are built as states are visited, after it is cached, so a budget stands for
        them: ``MASKS_PER_PATTERN`` masks (a pattern visits a handful of states)."""
        return MASKS_PER_PATTERN * self.vocabulary.vocab_size


MASKS_PER_PATTERN = 32


@dataclass
class CompiledRegex:
    """A pattern's DFA and its states' masks (``state -> bool [vocab]``), shared by every
    request with that pattern: a mask is only valid for the DFA whose state numbers key it.
    The masks start empty (so it pickles small, out of a compile worker) and fill as the
    requests' grammars visit states."""

    pattern: str
    dfa: RegexDFA
    masks: dict[int, torch.Tensor] = field(default_factory=dict)


class CourseSpecCompiler(SpecCompiler):
    """A regex (or a choice list, as a regex) -> its ``CompiledRegex``: plain Python
    objects, so a worker process can build the DFA and pickle it back."""

    def compile(self, kind: StructuredOutputOptions, spec: str, any_whitespace: bool) -> CompiledRegex:
        try:
            if kind == StructuredOutputOptions.CHOICE:
                spec = choice_regex(spec)
            elif kind != StructuredOutputOptions.REGEX:
                raise ValueError(f"the course backend compiles regex and choice only, not {kind.value}: "
                                 "use the xgrammar backend for JSON schemas, JSON objects, grammars and "
                                 "structural tags")
            return CompiledRegex(spec, RegexDFA(spec))
        except ValueError as error:   # the error starts with the field it is about (a 400's param)
            raise ValueError(f"structured_outputs.{kind.value} cannot be compiled: {error}") from None


def choice_regex(choices) -> str:
    """``["yes", "no"]`` -> ``(yes|no)``, every other character escaped."""
    import json

    if isinstance(choices, str):
        choices = json.loads(choices)
    escaped = ["".join(ch if ch.isalnum() else "\\" + ch for ch in choice) for choice in choices]
    return "(" + "|".join(escaped) + ")"
