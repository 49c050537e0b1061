"""The think-tag reasoning parsers (qwen3, deepseek_r1): exact cases, and the property that
any cut of the output into deltas splits reasoning from content as the whole output does."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from microvllm.reasoning import ReasoningParserManager
from microvllm.reasoning.qwen3_reasoning_parser import Qwen3ReasoningParser


def stream(parser, text: str, cuts: list[int]) -> tuple[str | None, str | None]:
    reasoning, content, previous = "", "", ""
    for piece in [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]:
        delta = parser.extract_reasoning_streaming(previous, previous + piece, piece)
        previous += piece
        if delta is not None:
            reasoning += delta.reasoning or ""
            content += delta.content or ""
    last = parser.finish_streaming()
    if last is not None:
        reasoning += last.reasoning or ""
        content += last.content or ""
    return reasoning or None, content or None


def test_reasoning_then_the_answer():
    text = "<think>\nLet me add 2 and 3.\n</think>\n\n5"
    want = ("\nLet me add 2 and 3.\n", "\n\n5")
    assert Qwen3ReasoningParser().extract_reasoning(text) == want
    assert stream(Qwen3ReasoningParser(), text, list(range(1, len(text)))) == want   # a character a delta


def test_the_start_tag_in_the_prompt_and_an_answer_cut_off():
    assert Qwen3ReasoningParser().extract_reasoning("thinking...</think>ok") == ("thinking...", "ok")
    assert Qwen3ReasoningParser().extract_reasoning("still thinking </thi") == ("still thinking </thi", None)
    assert stream(Qwen3ReasoningParser(), "still thinking </thi", [15, 17]) == ("still thinking </thi", None)


def test_enable_thinking_false_makes_everything_content():
    parser = ReasoningParserManager.get_reasoning_parser("qwen3")(chat_template_kwargs={"enable_thinking": False})
    assert parser.extract_reasoning("5") == (None, "5")
    assert stream(ReasoningParserManager.get_reasoning_parser("qwen3")(
        chat_template_kwargs={"enable_thinking": False}), "<think>x</think>5", [3]) == (None, "<think>x</think>5")


def test_the_parsers_are_found_by_vllms_names():
    assert ReasoningParserManager.get_reasoning_parser("qwen3") is Qwen3ReasoningParser
    assert ReasoningParserManager.get_reasoning_parser("deepseek_r1").__name__ == "DeepSeekR1ReasoningParser"
    with pytest.raises(KeyError, match="--reasoning-parser"):
        ReasoningParserManager.get_reasoning_parser("nope")


@settings(max_examples=300, deadline=None, derandomize=True)
@given(text=st.text(alphabet="<think/>ab \n", max_size=30), data=st.data(),
       name=st.sampled_from(["qwen3", "deepseek_r1"]), thinking=st.booleans())
def test_any_cut_into_deltas_splits_as_the_whole_output(text, data, name, thinking):
    cls = ReasoningParserManager.get_reasoning_parser(name)
    kwargs = {"chat_template_kwargs": {"enable_thinking": thinking}}
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=len(text))))
    assert stream(cls(**kwargs), text, [c for c in cuts if c < len(text)]) == cls(**kwargs).extract_reasoning(text)
