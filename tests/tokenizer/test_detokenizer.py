"""IncrementalDetokenizer: streamed text never breaks a character, always adds up
to the full decode, finds stop strings across tokens and never shows what follows."""

import random

import pytest

from microvllm.checks import detokenizer as checks
from microvllm.checks.detokenizer import CountingTokenizer
from microvllm.detokenizer import IncrementalDetokenizer, find_stop_string
from microvllm.sampling_params import SamplingParams

# The exercise checker's texts (one copy), and one more.
MULTIBYTE_TEXTS = [*checks.MULTIBYTE_TEXTS, "Mixed: Ωmega ≈ 3.14 — “quotes” → 漢字 🎉!"]


def stream(tokenizer, token_ids, chunk_sizes=None, **kwargs):
    """The engine's detokenizer through the checker's streaming loop (one copy)."""
    return checks.stream_detokenizer(IncrementalDetokenizer, tokenizer, token_ids, chunk_sizes, **kwargs)


@pytest.mark.parametrize("text", MULTIBYTE_TEXTS[1:])
def test_naive_per_token_decode_breaks_characters(any_tokenizer, text):
    """The problem the detokenizer solves: decoding token by token gives "�".
    (SmolLM2 has whole tokens for accented Latin letters, so MULTIBYTE_TEXTS[0]
    only breaks with the tiny tokenizer; see the next test.)"""
    ids = any_tokenizer.encode(text, add_special_tokens=False)
    naive = [any_tokenizer.decode([i]) for i in ids]
    assert any("\ufffd" in piece for piece in naive)
    assert "".join(naive) != text


def test_naive_decode_breaks_accents_with_byte_tokens(tiny_tokenizer):
    ids = tiny_tokenizer.encode("café", add_special_tokens=False)
    assert [tiny_tokenizer.decode([i]) for i in ids][-2:] == ["\ufffd", "\ufffd"]


@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
def test_one_token_at_a_time(any_tokenizer, text):
    ids = any_tokenizer.encode(text, add_special_tokens=False)
    detok, deltas = stream(any_tokenizer, ids)
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == any_tokenizer.decode(ids) == text
    assert detok.output_text == text
    assert detok.finished and detok.stop_reason is None


@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
def test_text_streams_before_the_end(any_tokenizer, text):
    """Holding back is only for incomplete characters: most text arrives early."""
    ids = any_tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(any_tokenizer, [])
    emitted = "".join(detok.update([i]) for i in ids[:-1])
    # Everything but a last incomplete character (decoded as trailing "�") is out.
    assert emitted == any_tokenizer.decode(ids[:-1]).rstrip("\ufffd")


@pytest.mark.parametrize("seed", range(4))
def test_random_chunks(any_tokenizer, seed):
    rng = random.Random(seed)
    text = " ".join(MULTIBYTE_TEXTS)
    ids = any_tokenizer.encode(text, add_special_tokens=False)
    sizes = [rng.randint(1, 4) for _ in ids]
    _, deltas = stream(any_tokenizer, ids, sizes)
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == text


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("seed", range(6))
def test_random_token_ids_add_up_to_the_full_decode(any_tokenizer, seed, skip_special_tokens):
    """Any id sequence (invalid UTF-8 and special tokens included): the deltas add up
    to decoding everything at once. Only a real "�" in the full text may appear."""
    rng = random.Random(seed)
    ids = [rng.randrange(any_tokenizer.vocab_size) for _ in range(40)] + [2, 1]
    detok, deltas = stream(any_tokenizer, ids, skip_special_tokens=skip_special_tokens)
    full = any_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert "".join(deltas) == full == detok.output_text


def test_work_per_step_is_bounded(any_tokenizer):
    """O(new tokens) per step: every decode call sees a short window, never the whole output."""
    spy = CountingTokenizer(any_tokenizer)
    ids = any_tokenizer.encode(" ".join(MULTIBYTE_TEXTS * 4), add_special_tokens=False)
    assert len(ids) > 200
    _, deltas = stream(spy, ids)
    assert "".join(deltas) == any_tokenizer.decode(ids)
    assert max(spy.lengths) <= 8


# ---- stop strings ----------------------------------------------------------------

STOP_TEXT = "The capital of France is Paris. It is a big city 🚀 with many cafés."


def split_across_tokens(tokenizer, ids, stop):
    """Precondition for the tests below: no single token holds the whole stop string."""
    return all(stop not in tokenizer.decode([i]) for i in ids)


@pytest.mark.parametrize("stop", ["is Paris", "s. It", "🚀"])
def test_stop_string_across_tokens_is_cut(any_tokenizer, stop):
    check_stop_is_cut(any_tokenizer, stop)


def test_one_character_stop_split_into_byte_tokens(tiny_tokenizer):
    check_stop_is_cut(tiny_tokenizer, "é")  # C3 A9: two tokens in the tiny vocabulary


def check_stop_is_cut(tokenizer, stop):
    ids = tokenizer.encode(STOP_TEXT, add_special_tokens=False)
    assert split_across_tokens(tokenizer, ids, stop)
    expected = STOP_TEXT[:STOP_TEXT.index(stop)]
    detok, deltas = stream(tokenizer, ids, stop=[stop])
    assert detok.finished and detok.stop_reason == stop
    assert detok.output_text == expected
    assert "".join(deltas) == expected
    # Nothing was ever shown that the stop string later took back.
    shown = ""
    for d in deltas:
        shown += d
        assert expected.startswith(shown)


@pytest.mark.parametrize("stop", ["is Paris", "🚀"])
def test_include_stop_str_in_output(any_tokenizer, stop):
    ids = any_tokenizer.encode(STOP_TEXT, add_special_tokens=False)
    expected = STOP_TEXT[:STOP_TEXT.index(stop) + len(stop)]
    detok, deltas = stream(any_tokenizer, ids, stop=[stop], include_stop_str_in_output=True)
    assert detok.stop_reason == stop
    assert "".join(deltas) == detok.output_text == expected


def test_earliest_stop_string_wins(smol_tokenizer):
    ids = smol_tokenizer.encode(STOP_TEXT, add_special_tokens=False)
    detok, deltas = stream(smol_tokenizer, ids, chunk_sizes=[len(ids)], stop=["big", "France"])
    assert detok.stop_reason == "France"
    assert "".join(deltas) == "The capital of "


def test_stop_buffer_holds_back_a_possible_stop_start(smol_tokenizer):
    """Before the stop string completes, its possible beginning is not shown."""
    detok = IncrementalDetokenizer(smol_tokenizer, [], stop=["Paris!"])
    ids = smol_tokenizer.encode("I love Par", add_special_tokens=False)
    shown = "".join(detok.update([i]) for i in ids)
    assert shown == "I lov"  # the last len("Paris!") - 1 = 5 characters wait
    assert detok.output_text == "I love Par"
    assert not detok.finished
    # The stop string never came: finishing releases the held-back text.
    shown += detok.update(smol_tokenizer.encode("ma", add_special_tokens=False), finished=True)
    assert shown == "I love Parma" and detok.stop_reason is None


def test_stop_string_ignored_before_min_tokens(tiny_tokenizer):
    ids = tiny_tokenizer.encode("ab ab ab ab ab", add_special_tokens=False)
    first_ab_tokens = len(tiny_tokenizer.encode("ab", add_special_tokens=False))
    detok, deltas = stream(tiny_tokenizer, ids, stop=["ab"], min_tokens=first_ab_tokens + 1)
    assert detok.stop_reason == "ab"
    assert detok.output_text.startswith("ab ") and len(detok.output_text) > 2


def test_stop_terminated_leaves_the_eos_text_out(smol_tokenizer):
    ids = smol_tokenizer.encode("Hi there", add_special_tokens=False) + [2]  # 2 = <|im_end|>
    for include, expected in [(False, "Hi there"), (True, "Hi there<|im_end|>")]:
        detok = IncrementalDetokenizer(smol_tokenizer, [], skip_special_tokens=False,
                                       include_stop_str_in_output=include)
        text = "".join(detok.update([i], stop_terminated=(i == 2)) for i in ids)
        assert text == expected and detok.finished


def test_update_after_finish_is_an_error(smol_tokenizer):
    detok = IncrementalDetokenizer(smol_tokenizer, [], stop=["b"])
    detok.update(smol_tokenizer.encode("a b c", add_special_tokens=False))
    assert detok.finished
    with pytest.raises(RuntimeError, match="after the request finished"):
        detok.update([5])


def test_from_sampling_params(smol_tokenizer):
    params = SamplingParams(stop="x", include_stop_str_in_output=True, skip_special_tokens=False,
                            min_tokens=3, max_tokens=5)
    detok = IncrementalDetokenizer.from_sampling_params(smol_tokenizer, [1], params)
    assert (detok.stop, detok.include_stop_str_in_output, detok.skip_special_tokens,
            detok.min_tokens) == (["x"], True, False, 3)


@pytest.mark.parametrize("text, new_chars, stop, expected", [
    ("hello world", 5, ["world"], ("world", 6)),
    ("hello world", 5, ["lo w"], ("lo w", 3)),      # straddles old and new text
    ("hello world", 1, ["hello"], None),            # already searched on an earlier step
    ("a stop b halt", 13, ["halt", "stop"], ("stop", 2)),
    ("abc", 0, ["abc"], None),
])
def test_find_stop_string(text, new_chars, stop, expected):
    assert find_stop_string(text, new_chars, stop) == expected
