"""Any Unicode under a grammar (issue 38, item 5): emoji (outside the BMP), CJK and
combining marks, in every kind each backend offers.

A byte-level BPE splits such characters over several tokens, so a token may hold only
some bytes of a character (SmolLM2: "😀" = F0 9F | 98 | 80, three tokens). The course
backend's DFA reads UTF-8 bytes, so these tokens walk it like any other; it used to drop
them, and a choice or regex with an emoji could only end in end-of-text tokens.
"""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings, strategies as st

from microvllm import LLM, SamplingParams
from microvllm.sampling_params import StructuredOutputsParams
from microvllm.structured_output.backend_regex import RegexBackend, choice_regex
from microvllm.structured_output.backend_types import StructuredOutputOptions as Kind
from microvllm.structured_output.regex_dfa import CharSet, RegexDFA, utf8_sequences

EMOJI = ["😀 smile", "🙂 ok"]
CJK = ["東京", "北京", "大阪"]
COMBINING = ["cafe\u0301", "nin\u0303o"]   # e + U+0301 (combining acute), n + U+0303 (combining tilde)
ALPHABET = "aé東😀\u0301 "                 # 1, 2, 3, 4, 2 and 1 bytes in UTF-8


# ------------------------------------------------------------ the DFA over bytes
def test_the_dfa_reads_each_character_as_its_utf8_bytes():
    dfa = RegexDFA("(😀|東京|e\u0301)+ ok")
    assert dfa.fullmatch("😀東京e\u0301 ok") and not dfa.fullmatch("😀東 ok")
    state = dfa.start
    for byte in "😀".encode():   # inside the character: live, not yet accepting
        state = dfa.step(state, byte)
        assert state != dfa.DEAD
    assert dfa.walk(dfa.start, "😀".encode()[:3] + b"\x81") == dfa.DEAD   # 😁 is not in the pattern
    assert dfa.step(dfa.start, "😀") == dfa.walk(dfa.start, "😀".encode())   # a character: its bytes


@pytest.mark.parametrize("lo, hi, sequences", [
    (0x61, 0x7A, [((0x61, 0x7A),)]),
    (0x80, 0x7FF, [((0xC2, 0xDF), (0x80, 0xBF))]),
    (0xE9, 0xFF, [((0xC3, 0xC3), (0xA9, 0xBF))]),
    (0x800, 0xFFFF, [((0xE0, 0xE0), (0xA0, 0xBF), (0x80, 0xBF)), ((0xE1, 0xEF), (0x80, 0xBF), (0x80, 0xBF))]),
])
def test_utf8_sequences_of_a_range(lo, hi, sequences):
    assert utf8_sequences(lo, hi) == sequences


def _matches(sequence, data: bytes) -> bool:
    return len(sequence) == len(data) and all(lo <= b <= hi for (lo, hi), b in zip(sequence, data))


CODE_POINTS = st.one_of(st.integers(0, 0xD7FF), st.integers(0xE000, 0x10FFFF))   # no surrogates


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(CODE_POINTS, CODE_POINTS).map(sorted), min_size=1, max_size=3), st.booleans(),
       st.lists(CODE_POINTS, max_size=20))
def test_a_sets_utf8_sequences_match_exactly_its_characters(ranges, negated, probes):
    """Each character of the set matches exactly one chain; a character outside, none."""
    charset = CharSet(tuple(tuple(r) for r in ranges), negated)
    sequences = charset.utf8_sequences()
    edges = [code + delta for lo, hi in ranges for code in (lo, hi) for delta in (-1, 0, 1)]
    for code in edges + probes:
        if not 0 <= code <= 0x10FFFF or 0xD800 <= code <= 0xDFFF:
            continue
        inside = any(lo <= code <= hi for lo, hi in ranges) != negated
        assert sum(_matches(s, chr(code).encode()) for s in sequences) == inside, (ranges, negated, hex(code))


@st.composite
def unicode_regexes(draw, depth=0):
    """Patterns over a few characters of 1 to 4 bytes (no \\w, \\d, \\s: Python's are Unicode-wide)."""
    kind = draw(st.sampled_from(["lit", "set", "any"] + (["cat", "alt", "rep"] if depth < 3 else [])))
    if kind == "lit":
        return re.escape(draw(st.sampled_from(ALPHABET)))
    if kind == "set":
        return draw(st.sampled_from(["[é😀]", "[^a]", "[a-東]", "[é-😀]", "[^東\u0301]", "[\u0300-\u036f]"]))
    if kind == "any":
        return "."
    if kind == "cat":
        return draw(unicode_regexes(depth + 1)) + draw(unicode_regexes(depth + 1))
    if kind == "alt":
        return "(" + draw(unicode_regexes(depth + 1)) + "|" + draw(unicode_regexes(depth + 1)) + ")"
    return "(" + draw(unicode_regexes(depth + 1)) + ")" + draw(st.sampled_from(["*", "+", "?", "{1,2}"]))


@settings(max_examples=200, deadline=None)
@given(unicode_regexes(), st.lists(st.text(alphabet=ALPHABET, max_size=5), min_size=1, max_size=8))
def test_the_byte_dfa_matches_like_python_re_on_unicode(pattern, texts):
    dfa = RegexDFA(pattern)
    for text in texts:
        assert dfa.fullmatch(text) == bool(re.fullmatch(pattern, text)), (pattern, text)
        if re.fullmatch(pattern, text):   # every byte prefix of a match, mid-character too, is live
            data = text.encode()
            assert all(dfa.walk(dfa.start, data[:i]) != dfa.DEAD for i in range(len(data))), (pattern, text)


def test_choice_regex_keeps_any_character():
    dfa = RegexDFA(choice_regex(EMOJI + CJK + COMBINING))
    assert all(dfa.fullmatch(choice) for choice in EMOJI + CJK + COMBINING)
    assert not dfa.fullmatch("cafe") and not dfa.fullmatch("東")


# ------------------------------------------------- the vocabulary of a real model
@pytest.fixture(scope="module")
def smollm2_tokenizer(default_model_folder):
    from microvllm.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(default_model_folder)


@pytest.fixture(scope="module")
def course_backend(smollm2_tokenizer):
    return RegexBackend(smollm2_tokenizer, smollm2_tokenizer.vocab_size)


def test_tokens_that_hold_part_of_a_character_keep_their_bytes(smollm2_tokenizer, course_backend):
    vocabulary = course_backend.vocabulary
    for text in EMOJI + CJK + COMBINING:
        ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
        assert b"".join(vocabulary.token_bytes[i] for i in ids) == text.encode(), text
    partial = [i for i in smollm2_tokenizer.encode("😀", add_special_tokens=False) if i not in vocabulary.texts]
    assert partial, "SmolLM2 splits 😀 into tokens that are not whole characters"


@pytest.mark.parametrize("kind, spec", [(Kind.CHOICE, json.dumps(EMOJI)), (Kind.REGEX, "[一-龥]{2,3}"),
                                        (Kind.CHOICE, json.dumps(COMBINING))],
                         ids=["emoji choice", "cjk regex", "combining choice"])
def test_masks_equal_a_walk_of_every_tokens_bytes(smollm2_tokenizer, course_backend, kind, spec):
    """Along the tokenization of each answer, the mask allows exactly the tokens whose bytes
    keep the DFA alive (every vocabulary entry walked on its own, no trie)."""
    grammar = course_backend.compile_grammar(kind, spec)
    vocabulary, dfa = course_backend.vocabulary, grammar.dfa
    answer = json.loads(spec)[-1] if kind == Kind.CHOICE else "北京"
    for token in smollm2_tokenizer.encode(answer, add_special_tokens=False):
        state = grammar.states[-1]
        allowed = grammar.allowed_ids()
        expected = {i for i, data in vocabulary.token_bytes.items() if dfa.walk(state, data) != dfa.DEAD}
        assert set(allowed.nonzero().flatten().tolist()) - set(vocabulary.eos_token_ids) == expected
        assert allowed[token] and grammar.accept_tokens("r", [token])
    assert dfa.is_accepting(grammar.states[-1])


# ---------------------------------------------- the engine on SmolLM2, both backends
BOTH = {  # kind -> specs, and how to read the output back
    "choice": [EMOJI, CJK, COMBINING],
    "regex": ["(😀|🙂) (smile|ok)", "[一-龥]{2,3}", "(cafe\u0301|nin\u0303o)!"],
}
XGRAMMAR_ONLY = {
    "json": [{"type": "string", "enum": EMOJI}, {"enum": CJK}, {"type": "string", "enum": COMBINING}],
    "grammar": ['root ::= "😀 smile" | "🙂 ok"', 'root ::= [一-龥] [一-龥] [一-龥]?',
                'root ::= ("cafe\u0301" | "nin\u0303o") "!"'],
}


def _cases(backend):
    kinds = BOTH if backend == "course" else {**BOTH, **XGRAMMAR_ONLY}
    return [(kind, spec) for kind, specs in kinds.items() for spec in specs]


def _valid(kind: str, spec, text: str) -> bool:
    if kind == "choice":
        return text in spec
    if kind == "regex":
        return re.fullmatch(spec, text) is not None
    if kind == "json":
        return json.loads(text) in spec["enum"]
    return text in EMOJI or re.fullmatch("[一-龥]{2,3}|(cafe\u0301|nin\u0303o)!", text) is not None


@pytest.fixture(scope="module", params=["course", "xgrammar"])
def smollm2(request, default_model_folder):
    if request.param == "xgrammar":
        pytest.importorskip("xgrammar")
    return LLM(str(default_model_folder), structured_outputs_backend=request.param, max_model_len=256,
               max_num_seqs=16), request.param


def test_every_kind_generates_emoji_cjk_and_combining_marks(smollm2):
    """Greedy and sampled (n=2), every output is valid, whole-character text, ended by the
    grammar (``stop``), never the end-of-text tokens of a grammar the vocabulary cannot write."""
    llm, backend = smollm2
    cases = _cases(backend)
    params = [SamplingParams(n=2, temperature=[0.0, 1.0][i % 2], seed=i, max_tokens=24,
                             structured_outputs=StructuredOutputsParams(**{kind: spec}))
              for i, (kind, spec) in enumerate(cases)]
    outs = llm.generate(["Pick one:"] * len(cases), params, use_tqdm=False)
    for (kind, spec), out in zip(cases, outs):
        for completion in out.outputs:
            assert completion.finish_reason == "stop", (backend, kind, spec, completion)
            assert "\ufffd" not in completion.text and _valid(kind, spec, completion.text), \
                (backend, kind, spec, completion.text)
