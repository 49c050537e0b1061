"""The pythonic tool-call parser: exact cases, then the property that however the text is
cut into deltas, the deltas add up to the whole message's parse (the arguments as the JSON
built from the Python literals)."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from microvllm.tool_parsers import ToolParserManager
from microvllm.tool_parsers.pythonic_tool_parser import PythonicToolParser
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

P = PythonicToolParser
TWO_CALLS = '[get_weather(city="Paris \\"Nord\\" </x>)", days=(1, 2), unit=None), get_time(tz=\'CET\', dst=True)]'


def test_two_calls_with_python_literals():
    content, calls = whole(P, TWO_CALLS)
    assert content is None
    assert as_objects(calls) == [("get_weather", {"city": 'Paris "Nord" </x>)', "days": [1, 2], "unit": None}),
                                 ("get_time", {"tz": "CET", "dst": True})]
    for cuts in (every_cut(TWO_CALLS), [1, 5], [12, 13, 50]):
        assert_stream_is_whole(P, TWO_CALLS, cuts)


def test_a_call_is_sent_whole_when_its_parenthesis_closes():
    _, _, deltas = stream(P, TWO_CALLS, every_cut(TWO_CALLS))
    sent_at = [i for i, d in enumerate(deltas) if d and d.tool_calls]
    first_end = TWO_CALLS.index("None)") + len("None")
    assert sent_at == [first_end, len(TWO_CALLS) - 2], sent_at
    assert not any(d.content for d in filter(None, deltas))


def test_text_after_the_list_is_content_and_text_that_is_not_calls_stays_content():
    text = '  [f(a=1), g()] Done.'
    assert whole(P, text) == (" Done.", [("f", '{"a": 1}'), ("g", "{}")])
    assert_stream_is_whole(P, text, every_cut(text))
    for text in ("[1, 2, 3]", "[see below] ok", "[f(1)]", "[f(a=x)]", "[f(**k)]", "[f(a={1})]", "[]", "Paris",
                 "[a.b(c=1)]", "[f (a=1)]"):
        assert whole(P, text) == (text, []), text
        assert_stream_is_whole(P, text, every_cut(text))
    text = "[f(a=1) g(b=2)]"   # no comma: the first call stands, the rest is text
    assert whole(P, text) == ("g(b=2)]", [("f", '{"a": 1}')])
    assert_stream_is_whole(P, text, every_cut(text))


def test_an_unclosed_call_at_the_end_is_content_and_the_calls_before_it_stand():
    text = '[f(a="x"), g(b="y'
    assert whole(P, text) == ('g(b="y', [("f", '{"a": "x"}')])
    content, calls, deltas = stream(P, text, every_cut(text))
    assert (content, calls) == whole(P, text) and deltas[-1].content == 'g(b="y'
    assert whole(P, "[f(a=1)") == (None, [("f", '{"a": 1}')])   # a list left open after a whole call


def test_the_name():
    assert ToolParserManager.get_tool_parser("pythonic") is P


@st.composite
def messages(draw) -> str:
    calls = []
    for _ in range(draw(st.integers(0, 3))):
        arguments = draw(ARGUMENTS)   # repr of JSON-like values is a Python literal
        calls.append(f"{draw(NAMES)}(" + ", ".join(f"{k}={v!r}" for k, v in arguments.items()) + ")")
    text = draw(st.sampled_from(["", " ", "\n"])) + "[" + draw(st.sampled_from([", ", ",", " ,\n"])).join(calls)
    return text + draw(st.sampled_from(["]", "", "] ok", ", h(x=", "]]", "x"]))


@settings(max_examples=250, deadline=None, derandomize=True)
@given(data=st.data())
def test_any_cut_into_deltas_gives_the_whole_messages_parse(data):
    text = data.draw(messages())
    assert_stream_is_whole(P, text, data.draw(cuts_of(text)))


PIECES = ['[', ']', 'f', '(', ')', 'a', '=', '1', '"', "'", ',', ' ', '\n', 'True', 'x.y', '{', '}', ':', '\\',
          '"""', '#']


@settings(max_examples=200, deadline=None, derandomize=True)
@given(data=st.data())
def test_broken_text_comes_out_the_same_however_it_is_cut(data):
    text = data.draw(soups(PIECES))
    assert_stream_is_whole(P, text, data.draw(cuts_of(text)))
