"""The mistral tool-call parser, both forms ([TOOL_CALLS] + a JSON list; [TOOL_CALLS]name[ARGS]{...}):
exact cases, then the property that however the text is cut into deltas, the deltas add up
to the whole message's parse."""

from __future__ import annotations

import json

from hypothesis import given, settings, strategies as st

from microvllm.tool_parsers import ToolParserManager
from microvllm.tool_parsers.mistral_tool_parser import MistralToolParser
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

P = MistralToolParser
LIST_FORM = ('Sure.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris \\"Nord\\" </x>"}}, '
             '{"name": "get_time", "arguments": {"tz": "CET"}}]')
NAMED_FORM = ('Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris \\"Nord\\" [TOOL_CALLS]"}'
              '[TOOL_CALLS]get_time[CALL_ID]a1B2c3D4e[ARGS]{"tz": "CET"}[TOOL_CALLS]now{}')


def test_the_list_form():
    content, calls = whole(P, LIST_FORM)
    assert content == "Sure."
    assert as_objects(calls) == [("get_weather", {"city": 'Paris "Nord" </x>'}), ("get_time", {"tz": "CET"})]
    for cuts in (every_cut(LIST_FORM), [6, 11], [5, 17, 30]):   # [TOOL_CALLS] split over three deltas
        assert_stream_is_whole(P, LIST_FORM, cuts)
        assert all("[" not in (d.content or "") for d in filter(None, stream(P, LIST_FORM, cuts)[2]))


def test_the_named_form_with_and_without_args_and_call_id():
    content, calls = whole(P, NAMED_FORM)
    assert content == "Sure."
    assert as_objects(calls) == [("get_weather", {"city": 'Paris "Nord" [TOOL_CALLS]'}), ("get_time", {"tz": "CET"}),
                                 ("now", {})]
    for cuts in (every_cut(NAMED_FORM), [8, 14], [30, 31, 70]):
        assert_stream_is_whole(P, NAMED_FORM, cuts)
    content, calls, deltas = stream(P, NAMED_FORM, every_cut(NAMED_FORM))
    assert not any("[" in (d.content or "") for d in filter(None, deltas)), "a marker leaked as content"
    ids = [c.id for d in filter(None, deltas) for c in d.tool_calls if c.id]
    assert len(ids) == 3 and all(len(i) == 9 and i.isalnum() for i in ids), ids


def test_text_between_and_after_calls_is_content():
    text = 'A[TOOL_CALLS]f[ARGS]{"a": 1} then [TOOL_CALLS]g{"b": 2}\nB'
    assert whole(P, text) == ("A then \nB", [("f", '{"a": 1}'), ("g", '{"b": 2}')])
    assert_stream_is_whole(P, text, every_cut(text))


def test_text_that_is_not_calls_stays_content():
    for text in ("No tools [TOOL", "[TOOL_CALLS] not a call", "x[TOOL_CALLS][1, 2]", "[TOOL_CALLS]f[ARGS][1]",
                 "[TOOL_CALLS]f(1)", "[TOOL_CALLS][]", "[TOOL_CALLS_]"):
        assert whole(P, text) == (text, []), text
        assert_stream_is_whole(P, text, every_cut(text))


def test_a_broken_call_makes_the_rest_content():
    text = '[TOOL_CALLS]f[ARGS]{}[TOOL_CALLS]g[ARGS]{"a": tru}[TOOL_CALLS]h[ARGS]{}'
    assert whole(P, text) == ('[TOOL_CALLS]g[ARGS]{"a": tru}[TOOL_CALLS]h[ARGS]{}', [("f", "{}")])
    assert_stream_is_whole(P, text, [3, 13, 30])


def test_an_unclosed_call_at_the_end_is_content():
    text = 'x[TOOL_CALLS]f[ARGS]{"a": "b'
    assert whole(P, text) == (text, [])
    content, calls, deltas = stream(P, text, every_cut(text))
    assert (content, calls) == (text, []) and deltas[-1].content == '[TOOL_CALLS]f[ARGS]{"a": "b'


def test_the_name():
    assert ToolParserManager.get_tool_parser("mistral") is P


@st.composite
def messages(draw) -> str:
    text = draw(st.text("ab [TOLCS_]\n", max_size=8)).replace("[TOOL_CALLS]", "")
    calls = [(draw(NAMES), draw(ARGUMENTS)) for _ in range(draw(st.integers(0, 3)))]
    ensure_ascii = draw(st.booleans())
    if draw(st.booleans()) and calls:
        text += "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in calls], ensure_ascii=ensure_ascii)
    else:
        for name, arguments in calls:
            middle = draw(st.sampled_from(["[ARGS]", "", "[CALL_ID]x9Y8z7W6v[ARGS]"]))
            text += f"[TOOL_CALLS]{name}{middle}{json.dumps(arguments, ensure_ascii=ensure_ascii)}"
            text += draw(st.sampled_from(["", "", " ok "]))
    return text + draw(st.sampled_from(["", "\n", "[TOOL_CALLS]", "[TOOL_CALLS]f[AR", "[TOOL"]))


@settings(max_examples=250, deadline=None, derandomize=True)
@given(data=st.data())
def test_any_cut_into_deltas_gives_the_whole_messages_parse(data):
    text = data.draw(messages())
    assert_stream_is_whole(P, text, data.draw(cuts_of(text)))


PIECES = ['[TOOL_CALLS]', '[TOOL_', '[ARGS]', '[AR', '[CALL_ID]', 'f', 'ab1', '{', '}', '"a"', ':', '1', '[', ']', ',',
          '"name"', '"arguments"', ' ', '\n', '"', 'x']


@settings(max_examples=200, deadline=None, derandomize=True)
@given(data=st.data())
def test_broken_text_comes_out_the_same_however_it_is_cut(data):
    text = data.draw(soups(PIECES))
    assert_stream_is_whole(P, text, data.draw(cuts_of(text)))
