"""Checks for exercise 15: the token mask of a DFA state (``TokenTrie.allowed_from``).

The reference is deliberately *not* a trie: for every token on its own, walk its characters
through the DFA (``dfa.walk(state, text)``) and allow it iff that never reaches the dead
state. From a live state some text still completes the pattern (``RegexDFA`` makes every
state with no way to acceptance dead), so

    allowed   <=>  reading the token keeps a completion possible
    forbidden <=>  after this token, no text at all can complete the pattern

Each case compares your trie's answer with that walk and explains the first token where they
differ, in the pattern's own characters. One trie answers for every state of every pattern (the
engine builds one for the vocabulary and remembers masks per pattern, ``CompiledRegex.masks``), so
the checks also ask one trie several questions in a row and recognise an answer remembered from an
earlier question (a memo keyed by the state alone, or one cache for all states).
"""

from __future__ import annotations

import itertools

from microvllm.checks.report import Case, CheckFailure, CheckResult, expect, property_settings, run_checks, run_property

# The example of backend_regex.py's docstring, with a few more tokens.
NUMBER = r"[0-9]+(\.[0-9]+)?"
NUMBER_VOCAB = {0: "14", 1: ".5", 2: ".", 3: "5a", 4: " 7", 5: "3", 6: "a", 7: "1.", 8: "1.2.", 9: "...",
                10: "7", 11: "0.25", 12: "2."}   # "2.": a leaf that ends in a live, non-accepting state
SHARED = "(ab|ac)d*!"
SHARED_VOCAB = {0: "a", 1: "ab", 2: "abd", 3: "abdd", 4: "ac", 5: "acx", 6: "b", 7: "abx", 8: "d", 9: "abd!",
                10: "ab!", 11: "ab", 12: "x"}
ALPHABET = "ab1 ."


class _CountingDFA:
    """A RegexDFA that remembers whether ``step`` was ever asked to leave the dead state."""

    def __init__(self, dfa):
        self.dfa, self.DEAD, self.start = dfa, dfa.DEAD, dfa.start
        self.steps, self.dead_steps = 0, []

    def step(self, state, ch):
        self.steps += 1
        if state == self.DEAD:
            self.dead_steps.append(ch)
        return self.dfa.step(state, ch)

    def walk(self, state, text):
        for ch in text:
            state = self.step(state, ch)
            if state == self.DEAD:
                break
        return state

    def __getattr__(self, name):
        return getattr(self.dfa, name)


def brute_force_allowed(dfa, state: int, texts: dict[int, str]) -> set[int]:
    """The reference: each token walked on its own, no trie."""
    return {token_id for token_id, text in texts.items() if dfa.walk(state, text) != dfa.DEAD}


def _where_it_dies(dfa, state: int, text: str) -> int:
    for index, ch in enumerate(text):
        state = dfa.step(state, ch)
        if state == dfa.DEAD:
            return index
    return -1


def _remembered_answer(history: list, got: set[int], expected: set[int], pattern: str, state: int,
                       trie, where: str, shown_vocab: str) -> None:
    """Fail with the cause if ``got`` is wrong here but is what an earlier question was answered."""
    for earlier in reversed(history):
        if not got or got != earlier["got"] or earlier["expected"] == expected:
            continue
        before = f"pattern {earlier['pattern']!r}, state {earlier['state']}"
        if earlier["pattern"] != pattern:
            message, hint = (
                f"allowed_from() answered state {state} of {pattern!r} with the ids it gave for state "
                f"{earlier['state']} of {earlier['pattern']!r}: a memo keyed by the state alone is shared "
                "across DFAs",
                "state numbers belong to one DFA (state 1 of one pattern is not state 1 of another), and "
                "the engine asks one trie about every pattern: keep no memo in the trie (the engine already "
                "remembers each pattern's masks), or key it by (dfa, state)" + (
                    "; this memo also outlives its trie (a class attribute or a global): keep it in self"
                    if earlier["trie"] is not trie else ""))
        elif earlier["state"] != state:
            message, hint = (
                f"allowed_from() answered state {state} with the ids it gave for state {earlier['state']} "
                "of the same pattern: one cache serves every state",
                "a mask belongs to one DFA state: after '3' a digit or '.' may follow, after '3.' only a "
                "digit. Compute the walk for the state you are given each time (or key a memo by the state)")
        elif earlier["trie"] is not trie:
            message, hint = (
                "allowed_from() answered with the ids of another trie's vocabulary: a memo outlives its trie "
                "(a class attribute or a global)",
                "each TokenTrie has its own vocabulary: keep no memo outside self")
        else:
            continue
        raise CheckFailure(message, input=f"{where}; vocabulary {{{shown_vocab}}} (asked after {before})",
                           expected=sorted(expected), got=sorted(got), hint=hint)


def compare_mask(trie_class, pattern: str, prefix: str, texts: dict[int, str], *, counting: bool = False,
                 trie=None, history: list | None = None) -> None:
    """Build ``trie_class(texts)`` (or ask ``trie``, built from ``texts``, again) for the state
    after ``prefix``, compare with the walk. ``history``: the questions asked before in this
    check, to recognise a remembered answer."""
    from microvllm.structured_output.regex_dfa import RegexDFA

    dfa = RegexDFA(pattern)
    state = dfa.walk(dfa.start, prefix)
    assert state != dfa.DEAD, (pattern, prefix)
    trie = trie if trie is not None else trie_class(dict(texts))
    asked = _CountingDFA(dfa)
    result = trie.allowed_from(asked, state)
    where = f"pattern {pattern!r}, " + (f"the state after {prefix!r} (state {state})" if prefix
                                        else f"the start state ({state})")
    shown_vocab = ", ".join(f"{i}: {t!r}" for i, t in list(texts.items())[:16]) + (
        f", ... ({len(texts) - 16} more)" if len(texts) > 16 else "")
    expect(isinstance(result, (list, tuple)), "allowed_from() must return a list of token ids",
           input=where, got=f"a {type(result).__name__}",
           hint="collect the ids in a list: allowed.extend(self.ends[node])")
    got = {int(i) for i in result}
    expected = brute_force_allowed(dfa, state, texts)
    if history is not None:
        if got != expected:
            _remembered_answer(history, got, expected, pattern, state, trie, where, shown_vocab)
        history.append({"pattern": pattern, "state": state, "got": got, "expected": expected, "trie": trie})
    unknown = sorted(got - set(texts))
    expect(not unknown, f"allowed_from() returned ids that are in no token: {unknown}",
           input=f"{where}; vocabulary {{{shown_vocab}}}",
           hint="add only the ids in self.ends[node] of the nodes you reach")
    if len(texts) > 2 and got == set(texts) and expected != got:
        raise CheckFailure("allowed_from() allowed every token: a grammar must mask out the tokens that lead to "
                           "the dead state", input=f"{where}; vocabulary {{{shown_vocab}}}",
                           expected=sorted(expected), got=sorted(got),
                           hint="step the DFA by each child's character and enter only the children where "
                                "dfa.step(at, ch) != dfa.DEAD")
    from_start = brute_force_allowed(dfa, dfa.start, texts)
    start_hint = ("your answer is the start state's mask: walk from the state you are given (the text so far), "
                  "not from dfa.start" if prefix and got == from_start and from_start != expected else None)
    for token_id in sorted(got - expected):
        text = texts[token_id]
        dies = _where_it_dies(dfa, state, text)
        raise CheckFailure(
            f"token {token_id} {text!r} must be masked out: after {prefix + text[:dies + 1]!r} no text can "
            f"complete the pattern (its character {text[dies]!r}, at position {dies}, leads to the dead state)",
            input=f"{where}; vocabulary {{{shown_vocab}}}", expected=sorted(expected), got=sorted(got),
            hint=start_hint or (
                "step the DFA by every character of the token, not only the first: an id ending at a node is "
                "allowed only if every edge on the way from node 0 stayed live" if dies > 0 else
                "prune: a child whose character takes the DFA to dfa.DEAD is never entered, and the ids below "
                "it are never added"))
    for token_id in sorted(expected - got):
        text = texts[token_id]
        deeper = any(len(texts[other]) > len(text) and texts[other].startswith(text) for other in got)
        raise CheckFailure(
            f"token {token_id} {text!r} must be allowed: {prefix + text!r} can still become a match "
            "(reading it never reaches the dead state)",
            input=f"{where}; vocabulary {{{shown_vocab}}}", expected=sorted(expected), got=sorted(got),
            hint=start_hint or _missing_hint(dfa, state, texts, expected, got, text, deeper))
    if counting:
        expect(not asked.dead_steps, "allowed_from() walked below a dead prefix: dfa.step() was called on "
               f"dfa.DEAD {len(asked.dead_steps)} times",
               input=f"{where}; vocabulary {{{shown_vocab}}}",
               hint="when dfa.step(at, ch) returns dfa.DEAD, do not push that child: nothing below it can be "
                    "allowed, and SmolLM2's 49,152 tokens make the walk slow")


def _missing_hint(dfa, state: int, texts: dict[int, str], expected: set[int], got: set[int], text: str,
                  deeper: bool) -> str:
    """Why a live token is missing: a mask of the accepting end states only, of leaves only, or
    a walk that stops early. The first two are told apart by what the whole answer looks like."""
    ends_accepting = {i for i in expected if dfa.is_accepting(dfa.walk(state, texts[i]))}
    is_leaf = {i for i in expected
               if not any(len(other) > len(texts[i]) and other.startswith(texts[i]) for other in texts.values())}
    if got == ends_accepting and got != is_leaf:
        after = dfa.walk(state, text)
        return (f"allowed means 'can still become a match', not 'is a match already': {text!r} leaves the DFA "
                f"in state {after}, which does not accept but is not dead either, so a later token can finish "
                "the match. Add the ids of every live node; only the end of the text (EOS) needs an accepting "
                "state, and RegexGrammar.allowed_ids adds it")
    if deeper or (got == is_leaf and got != ends_accepting):
        return (f"add the ids of every node you reach, not only of leaves: {text!r} ends at a node that also "
                "has children")
    return ("walk the whole live part of the trie: every child whose character keeps the DFA alive, to any "
            "depth (push (child, next state) and pop until the stack is empty)")


def _regexes():
    """Random patterns over a small alphabet (so that random tokens often stay live)."""
    import re

    from hypothesis import strategies as st

    def extend(inner):
        return st.one_of(
            st.tuples(inner, inner).map("".join),
            st.tuples(inner, inner).map(lambda p: f"({p[0]}|{p[1]})"),
            st.tuples(inner, st.sampled_from(["*", "+", "?", "{2}", "{1,3}"])).map(lambda p: f"({p[0]}){p[1]}"))

    atoms = st.one_of(st.sampled_from(ALPHABET).map(re.escape),
                      st.sampled_from(["[ab]", "[a-b1]", "[^a]", "\\d", "\\s", "."]))
    return st.recursive(atoms, extend, max_leaves=6)


def check_token_trie(trie_class, *, max_examples: int = 60, quiet: bool = False) -> CheckResult:
    """Check a ``TokenTrie`` class's ``allowed_from``; print and return the result."""

    history: list = []   # every question of the cases below: the engine's one trie answers them all

    def docstring_example():
        compare_mask(trie_class, NUMBER, "3", NUMBER_VOCAB, history=history)

    def shared_prefixes():
        compare_mask(trie_class, SHARED, "", SHARED_VOCAB, history=history)
        compare_mask(trie_class, SHARED, "ab", SHARED_VOCAB, history=history)

    def one_trie_for_every_state_and_pattern():
        texts = {**NUMBER_VOCAB, **{20 + i: t for i, t in SHARED_VOCAB.items()}}
        trie = trie_class(dict(texts))
        for pattern, prefix in ((NUMBER, "3"), (NUMBER, "3."), (NUMBER, "3"), (SHARED, "a"), (SHARED, "ab"),
                                (NUMBER, "3.")):
            compare_mask(trie_class, pattern, prefix, texts, trie=trie, history=history)

    def prunes_dead_prefixes():
        compare_mask(trie_class, NUMBER, "3", NUMBER_VOCAB, counting=True, history=history)
        compare_mask(trie_class, SHARED, "a", SHARED_VOCAB, counting=True, history=history)

    def property_case():
        from hypothesis import assume, given, strategies as st

        from microvllm.structured_output.regex_dfa import RegexDFA

        @property_settings(max_examples, report_multiple_bugs=False)
        @given(pattern=_regexes(), prefix=st.text(ALPHABET, max_size=3),
               tokens=st.lists(st.text(ALPHABET, min_size=1, max_size=4), min_size=1, max_size=24),
               every_short_string=st.booleans())
        def random_patterns_and_vocabularies(pattern, prefix, tokens, every_short_string):
            dfa = RegexDFA(pattern)
            assume(dfa.walk(dfa.start, prefix) != dfa.DEAD)
            if every_short_string:   # a dense vocabulary: every string of 1-3 of these characters
                tokens = tokens + ["".join(chars) for n in (1, 2, 3) for chars in itertools.product("ab1.", repeat=n)]
            compare_mask(trie_class, pattern, prefix, dict(enumerate(tokens)))

        run_property(random_patterns_and_vocabularies)

    cases = [
        Case("the docstring's example: [0-9]+(\\.[0-9]+)? after '3' ('14', '.', '.5' allowed; '5a', ' 7' not)",
             docstring_example),
        Case("tokens that share prefixes: an id may end at a node that has children", shared_prefixes),
        Case("one trie asked about several states of two patterns (state 1 of one DFA is not state 1 of "
             "the other)", one_trie_for_every_state_and_pattern),
        Case("a dead prefix is pruned: dfa.step() is never called on dfa.DEAD", prunes_dead_prefixes),
        Case(f"property: random patterns, vocabularies and states ({max_examples} examples) against a "
             "per-token walk of the DFA", property_case),
    ]
    return run_checks("TokenTrie.allowed_from", cases, quiet=quiet)
