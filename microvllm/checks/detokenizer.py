"""Checks for exercise 01: the incremental detokenizer and stop strings.

The tokenizer is the tiny byte-level BPE of the test models (``build_tiny_tokenizer``):
every character outside its small training text becomes 2-4 byte tokens, so half
characters, emoji split over four tokens and stop strings split across tokens all show
up in a few words.
"""

from __future__ import annotations

import functools
import random
import tempfile
from pathlib import Path

from microvllm.checks.report import (
    Case,
    CheckFailure,
    CheckResult,
    expect,
    expect_equal,
    property_settings,
    run_checks,
    run_property,
)

MULTIBYTE_TEXTS = [
    "Héllo wörld, café crème brûlée, naïve Zoë.",
    "日本語のテキストです。中文也可以。한국어도 됩니다.",
    "Emoji 🙂🚀👍🏽 family 👨‍👩‍👧 flag 🇫🇷 done",
]
STOP_TEXT = "The capital of France is Paris. It is a big city 🚀 with many cafés."


@functools.cache
def tiny_tokenizer():
    """The tiny byte-level tokenizer, built once per process in a temporary folder."""
    from microvllm.models.tiny_tokenizer import build_tiny_tokenizer
    from microvllm.tokenizer import Tokenizer

    folder = Path(tempfile.mkdtemp(prefix="microvllm-tiny-tokenizer-"))
    build_tiny_tokenizer(folder)
    return Tokenizer.from_pretrained(folder)


class CountingTokenizer:
    """Wraps a tokenizer and records how many ids each decode() call gets."""

    def __init__(self, inner):
        self.inner, self.lengths = inner, []

    def decode(self, ids, skip_special_tokens=True):
        self.lengths.append(len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def stream_detokenizer(detokenizer_class, tokenizer, token_ids, chunk_sizes=None, **kwargs):
    """Feed ``token_ids`` to a fresh detokenizer (prompt ``[1, 2, 3]``), in chunks of
    ``chunk_sizes`` (then one at a time); return ``(detokenizer, list of deltas)``. The
    checker and ``tests/tokenizer/test_detokenizer.py`` both stream through it."""
    detok = detokenizer_class(tokenizer, [1, 2, 3], **kwargs)
    deltas, i = [], 0
    sizes = iter(chunk_sizes or [])
    while i < len(token_ids) and not detok.finished:
        n = next(sizes, 1)
        chunk = token_ids[i:i + n]
        i += n
        delta = detok.update(chunk, finished=i >= len(token_ids))
        expect(isinstance(delta, str), "update() must return the new text as a str", got=repr(delta))
        deltas.append(delta)
    return detok, deltas


def check_detokenizer(detokenizer_class, *, max_examples: int = 40, quiet: bool = False) -> CheckResult:
    """Check an ``IncrementalDetokenizer`` class; print and return the result."""
    tok = tiny_tokenizer()

    def stream(token_ids, chunk_sizes=None, tokenizer=tok, **kwargs):
        return stream_detokenizer(detokenizer_class, tokenizer, token_ids, chunk_sizes, **kwargs)

    def ids_of(text):
        return tok.encode(text, add_special_tokens=False)

    def one_token_at_a_time():
        for text in MULTIBYTE_TEXTS:
            ids = ids_of(text)
            detok, deltas = stream(ids)
            where = f"{text!r} = {len(ids)} tokens, fed one per update()"
            broken = [d for d in deltas if "\ufffd" in d]
            expect(not broken, "a delta showed a half character (�)", input=where, got=f"deltas {broken[:3]}",
                   hint="if the window's text ends in '\\ufffd' the character is incomplete: return '' and "
                        "keep prefix_offset/read_offset so the next update decodes these tokens again")
            expect_equal("".join(deltas), text, "the deltas must add up to the text", input=where,
                         hint="new_text = decode(tokens[prefix_offset:]); emit new_text[len(prefix_text):]")
            expect_equal(detok.output_text, text, "output_text after the last token", input=where)

    def streams_early():
        for text in MULTIBYTE_TEXTS:
            ids = ids_of(text)
            detok = detokenizer_class(tok, [])
            emitted = "".join(detok.update([i]) for i in ids[:-1])
            expected = tok.decode(ids[:-1]).rstrip("\ufffd")
            expect_equal(emitted, expected, "text must be emitted as soon as its characters are complete",
                         input=f"{text!r} without its last token, one token per update()",
                         hint="hold back only an incomplete last character; advance the offsets after each emit")

    def invalid_byte_mid_stream():
        lead_byte = ids_of("日")[0]   # the first of 日's three UTF-8 bytes, here followed by no other
        ids = ids_of("Hello ") + [lead_byte] + ids_of(" the capital of France is Paris")
        counting = CountingTokenizer(tok)
        detok = detokenizer_class(counting, [])
        emitted = "".join(detok.update([i]) for i in ids[:-1])
        expected = tok.decode(ids[:-1])
        where = ("'Hello ' + one lone UTF-8 lead byte (invalid for good) + ' the capital of France is "
                 "Paris', one token per update(), the last one not yet")
        hint = ("a '\\ufffd' in the middle of the window is a byte no later token can complete: only "
                "new_text.endswith('\\ufffd') means 'wait for the next token'")
        expect_equal(emitted, expected, "text after an invalid byte must keep streaming", input=where,
                     hint=hint)
        expect(max(counting.lengths) <= 8, "the window must stay short after an invalid byte", input=where,
               expected="decode() calls of at most 8 ids", got=f"a decode() call of {max(counting.lengths)} ids",
               hint=hint)

    def random_chunks():
        rng = random.Random(0)
        text = " ".join(MULTIBYTE_TEXTS)
        ids = ids_of(text)
        sizes = [rng.randint(1, 4) for _ in ids]
        _, deltas = stream(ids, sizes)
        expect_equal("".join(deltas), text, "several tokens per update() must work too",
                     input=f"{text[:30]!r}... in chunks of {sizes[:8]}...",
                     hint="decode the new tokens one by one, as if they had arrived separately")

    def bounded_work():
        counting = CountingTokenizer(tok)
        ids = ids_of(" ".join(MULTIBYTE_TEXTS * 3))
        _, deltas = stream(ids, tokenizer=counting)
        expect_equal("".join(deltas), tok.decode(ids), "the deltas must add up to the text",
                     input=f"{len(ids)} tokens")
        expect(max(counting.lengths) <= 8, "each step must decode a short window, not the whole output",
               input=f"{len(ids)} tokens, one per update()", expected="decode() calls of at most 8 ids",
               got=f"a decode() call of {max(counting.lengths)} ids",
               hint="decode tokens[prefix_offset:], and move prefix_offset up to read_offset after each emit")

    def stop_strings_across_tokens():
        for stop in ("is Paris", "s. It", "🚀", "é"):
            ids = ids_of(STOP_TEXT)
            expected = STOP_TEXT[:STOP_TEXT.index(stop)]
            detok, deltas = stream(ids, stop=[stop])
            where = f"{STOP_TEXT!r} one token at a time, stop={[stop]}"
            expect(detok.finished and detok.stop_reason == stop, "the stop string must end the request",
                   input=where, got=f"finished={detok.finished}, stop_reason={detok.stop_reason!r}",
                   hint="search the new text and the len(stop) - 1 characters before it: a stop string "
                        "can straddle two tokens")
            expect_equal("".join(deltas), expected, "the text must stop just before the stop string",
                         input=where)
            shown = ""
            for d in deltas:
                shown += d
                if not expected.startswith(shown):
                    raise CheckFailure("text was shown that the stop string later took back", input=where,
                                       got=repr(shown), hint="hold back the last len(longest stop) - 1 "
                                                             "characters until the request finishes")

    def include_stop_string():
        stop = "is Paris"
        expected = STOP_TEXT[:STOP_TEXT.index(stop) + len(stop)]
        detok, deltas = stream(ids_of(STOP_TEXT), stop=[stop], include_stop_str_in_output=True)
        expect_equal("".join(deltas), expected, "with include_stop_str_in_output the stop string is kept",
                     input=f"stop={[stop]}, include_stop_str_in_output=True")

    def stop_buffer():
        detok = detokenizer_class(tok, [], stop=["Paris!"])
        shown = "".join(detok.update([i]) for i in ids_of("I love Par"))
        expect_equal(shown, "I lov", "a possible start of a stop string must wait",
                     input="'I love Par' one token at a time, stop=['Paris!']",
                     hint="'Par' may become 'Paris!': hold back len('Paris!') - 1 = 5 characters")
        shown += detok.update(ids_of("ma"), finished=True)
        expect_equal(shown, "I love Parma", "finishing releases the held-back text",
                     input="then 'ma' with finished=True")

    def min_tokens():
        ids = ids_of("ab ab ab ab ab")
        first = len(ids_of("ab"))
        detok, _ = stream(ids, stop=["ab"], min_tokens=first + 1)
        expect(detok.stop_reason == "ab" and detok.output_text.startswith("ab ") and len(detok.output_text) > 2,
               "stop strings only count after min_tokens tokens", input=f"'ab ab ab ...', stop=['ab'], "
               f"min_tokens={first + 1}", got=repr(detok.output_text))

    def random_ids():
        from hypothesis import given, strategies as st

        @property_settings(max_examples)
        @given(st.lists(st.integers(0, tok.vocab_size - 1), max_size=40), st.lists(st.integers(1, 4)),
               st.booleans())
        def test(ids, sizes, skip_special_tokens):
            _, deltas = stream(ids, sizes, skip_special_tokens=skip_special_tokens)
            full = tok.decode(ids, skip_special_tokens=skip_special_tokens)
            expect_equal("".join(deltas), full, "the deltas must add up to decoding everything at once",
                         input=f"token ids {ids}, chunk sizes {sizes[:len(ids)]}, "
                               f"skip_special_tokens={skip_special_tokens}",
                         hint="at the end (finished=True) flush what is held back even if it ends in '�'")

        run_property(test)

    cases = [
        Case("one token at a time, multibyte text never shows a half character", one_token_at_a_time),
        Case("text streams as soon as its characters are complete", streams_early),
        Case("an invalid byte in the middle does not stall the stream", invalid_byte_mid_stream),
        Case("several tokens per update()", random_chunks),
        Case("each step decodes a short window (O(new tokens))", bounded_work),
        Case("a stop string split across tokens cuts the text, nothing is taken back", stop_strings_across_tokens),
        Case("include_stop_str_in_output keeps the stop string", include_stop_string),
        Case("a possible start of a stop string waits", stop_buffer),
        Case("stop strings count only after min_tokens", min_tokens),
        Case(f"property: {max_examples} random token id streams add up to the full decode", random_ids),
    ]
    return run_checks("check_detokenizer", cases, quiet=quiet)


def check_find_stop_string(find_stop_string, *, quiet: bool = False) -> CheckResult:
    """Check ``find_stop_string(output_text, new_char_count, stop)``."""
    examples = [
        ("hello world", 5, ["world"], ("world", 6), "a stop string in the new text"),
        ("hello world", 5, ["lo w"], ("lo w", 3), "a stop string that straddles old and new text"),
        ("hello world", 1, ["hello"], None, "old text was searched on an earlier step"),
        ("hello world", 1, ["worl"], None, "a stop string that ends just before the new text was "
                                           "searched on an earlier step"),
        ("a stop b halt", 13, ["halt", "stop"], ("stop", 2), "the earliest stop string wins"),
        ("abc", 0, ["abc"], None, "no new characters: nothing to find"),
        ("abc", 3, [], None, "no stop strings"),
    ]

    def make_case(text, new, stop, expected, why):
        def run():
            expect_equal(find_stop_string(text, new, stop), expected, why,
                         input=f"find_stop_string({text!r}, {new}, {stop})",
                         hint="for each stop string, search from len(text) - new - len(stop) + 1 "
                              "(not before 0); return (stop, index) of the smallest index")
        return Case(why, run)

    return run_checks("check_find_stop_string", [make_case(*e) for e in examples], quiet=quiet)
