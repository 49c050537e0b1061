"""The course's regex -> DFA against Python's ``re`` on random patterns and strings, and
its token masks against a brute-force walk of every vocabulary entry and against xgrammar."""

import re

import pytest
import torch
from hypothesis import given, settings, strategies as st

from microvllm.structured_output.backend_regex import RegexBackend, choice_regex
from microvllm.structured_output.backend_types import StructuredOutputOptions as Kind
from microvllm.structured_output.bitmask import allocate_bitmask, pack, unpack
from microvllm.structured_output.regex_dfa import RegexDFA, RegexError

ALPHABET = "ab1 ."


@st.composite
def regexes(draw, depth=0):
    """Random patterns of the supported syntax over a small alphabet (so that random
    strings often match)."""
    kind = draw(st.sampled_from(["lit", "set", "class", "any"] + (["cat", "alt", "rep", "group"] if depth < 3 else [])))
    if kind == "lit":
        return re.escape(draw(st.sampled_from(ALPHABET)))
    if kind == "set":
        return draw(st.sampled_from(["[ab]", "[a-b1]", "[^a]", "[ .]", "[\\d]"]))
    if kind == "class":
        return draw(st.sampled_from(["\\d", "\\w", "\\s", "\\D"]))
    if kind == "any":
        return "."
    if kind == "group":
        return "(" + draw(regexes(depth + 1)) + ")"
    if kind == "cat":
        return draw(regexes(depth + 1)) + draw(regexes(depth + 1))
    if kind == "alt":
        return "(" + draw(regexes(depth + 1)) + "|" + draw(regexes(depth + 1)) + ")"
    inner = "(" + draw(regexes(depth + 1)) + ")"
    return inner + draw(st.sampled_from(["*", "+", "?", "{2}", "{1,3}", "{0,}", "*?"]))


@settings(max_examples=300, deadline=None)
@given(regexes(), st.lists(st.text(alphabet=ALPHABET, max_size=6), min_size=1, max_size=8))
def test_dfa_matches_like_python_re(pattern, texts):
    dfa = RegexDFA(pattern)
    for text in texts:
        assert dfa.fullmatch(text) == bool(re.fullmatch(pattern, text)), (pattern, text)


@settings(max_examples=200, deadline=None)
@given(regexes(), st.text(alphabet=ALPHABET, max_size=6))
def test_a_dead_state_cannot_match_any_more(pattern, prefix):
    """A prefix that leads to the dead state has no continuation that matches (searched
    up to 4 more characters)."""
    dfa = RegexDFA(pattern)
    state = dfa.walk(dfa.start, prefix)
    if state == dfa.DEAD:
        # No continuation of up to 4 characters from the alphabet matches.
        import itertools
        for n in range(5):
            for tail in itertools.product(ALPHABET, repeat=n):
                assert not re.fullmatch(pattern, prefix + "".join(tail))


@pytest.mark.parametrize("pattern", ["a(b", "a)", "[a-", "*a", "a{3,1}", "(?=a)", "\\1", "a\\"])
def test_unsupported_or_broken_patterns_say_so(pattern):
    with pytest.raises(RegexError, match="regex"):
        RegexDFA(pattern)


def test_choice_regex_escapes():
    dfa = RegexDFA(choice_regex(["a.b", "c+d", "x y"]))
    assert dfa.fullmatch("a.b") and dfa.fullmatch("c+d") and dfa.fullmatch("x y")
    assert not dfa.fullmatch("axb") and not dfa.fullmatch("ccd")


def test_pack_and_unpack_round_trip():
    allowed = torch.rand(3, 70, generator=torch.Generator().manual_seed(0)) > 0.5
    words = pack(allowed)
    assert words.shape == (3, 3) and words.dtype == torch.int32
    assert torch.equal(unpack(words, 70), allowed)
    assert unpack(allocate_bitmask(2, 70), 70).all()


# ------------------------------------------------------------- token masks
@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from microvllm.models.tiny import make_tiny_model
    from microvllm.tokenizer import Tokenizer

    folder = make_tiny_model(tmp_path_factory.mktemp("dfa") / "llama", "llama", seed=7)
    return Tokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def backend(tokenizer):
    return RegexBackend(tokenizer, 512)


PATTERNS = [r"[0-9]+(\.[0-9]+)?", r"(yes|no|maybe)", r"[a-z ]{3,12}", r"\d{3}-\d{4}", r"(the|a) (cat|dog)s?",
            r"[A-Z][a-z]*( [A-Z][a-z]*){0,2}", r"\w+@\w+\.(com|org)"]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_mask_equals_a_brute_force_walk_of_every_token(backend, pattern):
    """Every allowed token keeps a completion possible; every forbidden one does not
    (each vocabulary entry walked on its own, no trie), along a random walk."""
    grammar = backend.compile_grammar(Kind.REGEX, pattern)
    vocabulary, dfa = backend.vocabulary, grammar.dfa
    generator = torch.Generator().manual_seed(1)
    for _ in range(10):
        state = grammar.states[-1]
        allowed = grammar.allowed_ids()
        for token_id, text in vocabulary.texts.items():
            assert bool(allowed[token_id]) == (dfa.walk(state, text) != dfa.DEAD), (pattern, text)
        assert all(bool(allowed[e]) == dfa.is_accepting(state) for e in vocabulary.eos_token_ids)
        choices = [t for t in allowed.nonzero().flatten().tolist() if t not in vocabulary.eos_token_ids]
        if not choices:
            break
        token = choices[int(torch.randint(len(choices), (1,), generator=generator))]
        assert grammar.accept_tokens("r", [token])


@pytest.mark.parametrize("pattern", PATTERNS)
def test_the_course_backend_and_xgrammar_give_the_same_masks(tokenizer, backend, pattern):
    pytest.importorskip("xgrammar")
    from microvllm.structured_output.backend_xgrammar import XgrammarBackend

    ours = backend.compile_grammar(Kind.REGEX, pattern)
    theirs = XgrammarBackend(tokenizer, 512).compile_grammar(Kind.REGEX, pattern)
    usable = torch.zeros(512, dtype=torch.bool)
    usable[list(backend.vocabulary.texts) + backend.vocabulary.eos_token_ids] = True
    generator = torch.Generator().manual_seed(2)
    for _ in range(12):
        masks = [allocate_bitmask(1, 512), allocate_bitmask(1, 512)]
        ours.fill_bitmask(masks[0], 0)
        theirs.fill_bitmask(masks[1], 0)
        a, b = unpack(masks[0], 512)[0], unpack(masks[1], 512)[0]
        assert torch.equal(a & usable, b & usable), pattern
        choices = [t for t in a.nonzero().flatten().tolist() if t not in backend.vocabulary.eos_token_ids]
        if not choices:
            break
        token = choices[int(torch.randint(len(choices), (1,), generator=generator))]
        assert ours.accept_tokens("r", [token]) and theirs.accept_tokens("r", [token])


def test_accept_rejects_and_rolls_back(backend):
    grammar = backend.compile_grammar(Kind.CHOICE, '["yes", "no"]')
    texts = {text: t for t, text in backend.vocabulary.texts.items()}
    bad = next(t for text, t in texts.items() if text and text[0] not in "yn")
    assert not grammar.accept_tokens("r", [bad]) and grammar.states == [grammar.dfa.start]
    y = texts.get("y") or texts.get("ye")
    if y is not None:
        assert grammar.accept_tokens("r", [y])
        grammar.rollback(1)
        assert grammar.states == [grammar.dfa.start]


def test_the_course_backend_refuses_what_it_cannot_compile(backend):
    with pytest.raises(ValueError, match="xgrammar"):
        backend.compile_grammar(Kind.JSON, '{"type": "object"}')
    with pytest.raises(ValueError, match="regex"):
        backend.compile_grammar(Kind.REGEX, "a(b")
