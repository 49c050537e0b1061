"""The llama3_json tool-call parser: exact cases, then the property that however the text is
cut into deltas, the deltas add up to the whole message's parse."""

from __future__ import annotations

import json

from hypothesis import given, settings, strategies as st

from microvllm.tool_parsers import ToolParserManager
from microvllm.tool_parsers.llama_tool_parser import Llama3JsonToolParser
from tests.tool_parsers.deltas import (
    ARGUMENTS,
    NAMES,
    as_objects,
    assert_stream_is_whole,
    cuts_of,
    every_cut,
    soups,
    stream,
    whole,
)

P = Llama3JsonToolParser
TWO_CALLS = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris \\"Nord\\" </x>"}}; '
             '{"name": "get_time", "arguments": {"tz": "CET"}}')


def test_two_calls_after_the_python_tag():
    content, calls = whole(P, TWO_CALLS)
    assert content is None
    assert as_objects(calls) == [("get_weather", {"city": 'Paris "Nord" </x>'}), ("get_time", {"tz": "CET"})]
    for cuts in (every_cut(TWO_CALLS), [3, 9], [20, 21, 60]):   # the tag split over three deltas
        assert_stream_is_whole(P, TWO_CALLS, cuts)
    _, _, deltas = stream(P, TWO_CALLS, every_cut(TWO_CALLS))
    assert not any(d.content for d in filter(None, deltas)), "the tag leaked as content"


def test_a_call_without_the_tag_and_text_after_the_calls():
    text = '  {"name": "f", "parameters": {"a": [1, "}"]}}\nHope that helps.'
    assert whole(P, text) == ("Hope that helps.", [("f", '{"a": [1, "}"]}')])
    assert_stream_is_whole(P, text, every_cut(text))
    first_call = next(i for i, d in enumerate(stream(P, text, every_cut(text))[2]) if d and d.tool_calls)
    assert first_call == text.index("}}") + 1, "the call was not sent the moment its object closed"


def test_text_that_is_not_calls_stays_content():
    for text in ("The weather is {fine}.", "Sure: {\"name\": \"f\"}", "<|python_t", "{not json", "   ",
                 '{"name": "f", "parameters": "a string"}'):
        assert whole(P, text) == (text, []), text
        assert_stream_is_whole(P, text, every_cut(text))


def test_a_broken_call_after_a_good_one_is_content_from_there():
    text = '{"name": "f", "parameters": {}}; {"name": 3, "parameters": {}}; {"name": "g", "parameters": {}}'
    assert whole(P, text) == ('{"name": 3, "parameters": {}}; {"name": "g", "parameters": {}}', [("f", "{}")])
    assert_stream_is_whole(P, text, [5, 40, 41])


def test_an_unclosed_call_at_the_end_is_content():
    text = '{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"a": "b'
    assert whole(P, text) == ('{"name": "g", "parameters": {"a": "b', [("f", "{}")])
    content, calls, deltas = stream(P, text, every_cut(text))
    assert (content, calls) == whole(P, text)
    assert deltas[-1].content == '{"name": "g", "parameters": {"a": "b', "finish_streaming flushes what was held"


def test_the_names():
    assert ToolParserManager.get_tool_parser("llama3_json") is P
    assert ToolParserManager.get_tool_parser("llama4_json") is P


@st.composite
def messages(draw) -> str:
    calls = [json.dumps({"name": draw(NAMES), draw(st.sampled_from(["parameters", "arguments"])): draw(ARGUMENTS)},
                        ensure_ascii=draw(st.booleans()), indent=draw(st.sampled_from([None, 1])))
             for _ in range(draw(st.integers(0, 3)))]
    text = draw(st.sampled_from(["", "<|python_tag|>", " "])) + draw(st.sampled_from([";", "; ", " ;\n"])).join(calls)
    return text + draw(st.sampled_from(["", " ", "\nDone.", "; {\"na", "{x"]))


@settings(max_examples=250, deadline=None, derandomize=True)
@given(data=st.data())
def test_any_cut_into_deltas_gives_the_whole_messages_parse(data):
    text = data.draw(messages())
    assert_stream_is_whole(P, text, data.draw(cuts_of(text)))


PIECES = ['<|python_tag|>', '<|py', '{', '}', '"name"', ':', '"f"', '"parameters"', '"arguments"', ',', ';', ' ', '\n',
          '"a"', '1', '[', ']', 'x', '"', '\\']


@settings(max_examples=200, deadline=None, derandomize=True)
@given(data=st.data())
def test_broken_text_comes_out_the_same_however_it_is_cut(data):
    text = data.draw(soups(PIECES))
    assert_stream_is_whole(P, text, data.draw(cuts_of(text)))
