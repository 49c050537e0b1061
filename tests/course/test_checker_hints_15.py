"""Exercise 15's checker names the real bug of each wrong ``TokenTrie.allowed_from`` (issue 40,
items 6 and 7): a memo keyed by the state alone (shared across DFAs, or across tries), one
cache for every state, and a mask of the accepting end states only. Each once failed only the
engine cell, with no hint, or got the hint of another bug ("not only of leaves"). And the
engine never passes off the id a mask that allows nothing leaves the sampler (id 0) as output.
"""

from __future__ import annotations

import re

from microvllm import LLM, SamplingParams, checks
from microvllm.models.tiny import make_tiny_model
from microvllm.sampling_params import StructuredOutputsParams
from microvllm.structured_output import backend_regex
from microvllm.structured_output.backend_regex import TokenTrie
from tests.course.mutants import TrieLeavesOnly, mutant


def caught(trie_class, cause: str, *, not_said: str | None = None) -> str:
    """The checker fails ``trie_class`` (not "not implemented"); its first failure names ``cause``."""
    result = checks.check_token_trie(trie_class, quiet=True)
    assert not result.passed and not result.not_implemented, result.report()
    first = next(case for case in result.cases if case.status == "fail")
    report = result.report()
    assert re.search(cause, result.message, re.S), report
    if not_said is not None:
        assert not_said not in result.message, report
    return first.name


class TrieMemoByState(TokenTrie):
    """Remembers each answer under the state number alone: the engine's one trie then answers
    state 1 of one pattern with state 1 of another."""

    def allowed_from(self, dfa, state):
        memo = self.__dict__.setdefault("memo", {})
        if state not in memo:
            memo[state] = super().allowed_from(dfa, state)
        return memo[state]


class TrieClassMemo(TokenTrie):
    """The same memo as a class attribute: it outlives its trie, so even a fresh trie is
    answered from another vocabulary."""

    memo: dict = {}

    def allowed_from(self, dfa, state):
        if state not in self.memo:
            self.memo[state] = super().allowed_from(dfa, state)
        return self.memo[state]


class TrieOneCache(TokenTrie):
    """One cache for all states: the first answer, whatever is asked next."""

    def allowed_from(self, dfa, state):
        if getattr(self, "cache", None) is None:
            self.cache = super().allowed_from(dfa, state)
        return self.cache


# Allows only tokens whose walk ends in an accepting state ("is a match" for "can still be one").
TrieAcceptingOnly = mutant(backend_regex, [("            if node:\n",
                                            "            if node and dfa.is_accepting(at):\n")]).TokenTrie


def test_a_memo_keyed_by_the_state_alone_is_named():
    caught(TrieMemoByState, r"a memo keyed by the state alone is shared across DFAs.*hint:.*key it by \(dfa, state\)")


def test_a_memo_that_outlives_its_trie_is_named():
    caught(TrieClassMemo, r"memo keyed by the state alone is shared across DFAs.*outlives its trie \(a class attribute")


def test_one_cache_for_every_state_is_named():
    caught(TrieOneCache, r"answered state \d+ with the ids it gave for state \d+ of the same pattern: one cache "
                         r"serves every state")


def test_a_mask_of_accepting_states_only_is_named_not_blamed_on_leaves():
    caught(TrieAcceptingOnly, r"token 2 '\.' must be allowed.*hint: +allowed means 'can still become a match', "
                              r"not 'is a match already'.*does not accept but is not dead",
           not_said="not only of leaves")


def test_a_mask_of_leaves_only_keeps_its_own_hint():
    caught(TrieLeavesOnly, r"token 2 '\.' must be allowed.*not only of leaves", not_said="is a match already")


def test_the_hints_ask_instead_of_giving_the_solution():
    from microvllm.course.specs.token_mask import EXERCISE

    first, second = EXERCISE.hints[:2]
    for hint in (first, second):
        assert "?" in hint, hint
        assert "stack.append" not in hint and "nxt = dfa.step" not in hint, hint
    assert "──" in first   # a picture of the trie
    assert "holds none" not in EXERCISE.contract


class TrieEmptyAfterTheStart(TokenTrie):
    """A mask that allows nothing once the text has begun, while the grammar accepts anything."""

    def allowed_from(self, dfa, state):
        return super().allowed_from(dfa, state) if state == dfa.start else []


def test_an_empty_mask_fails_its_request_instead_of_emitting_id_0(tmp_path):
    folder = make_tiny_model(tmp_path / "llama", "llama", seed=7)
    llm = LLM(str(folder), structured_outputs_backend="course", max_model_len=128, max_num_seqs=2,
              max_num_batched_tokens=64, components={"token_trie": TrieEmptyAfterTheStart})
    manager = llm.engine.structured_output_manager
    accept = manager.accept_tokens   # a grammar that disagrees with its mask: it takes every token
    manager.accept_tokens = lambda request_id, token_ids: accept(request_id, token_ids) or True
    params = SamplingParams(temperature=0, max_tokens=6,
                            structured_outputs=StructuredOutputsParams(regex="[a-z]{25,30}"))
    out = llm.generate(["the"], params, use_tqdm=False)[0]
    assert out.error is not None and "allows no token after 1 generated token" in out.error, out.error
    assert out.outputs[0].finish_reason == "error"
    assert 0 not in out.outputs[0].token_ids, out.outputs[0].token_ids
