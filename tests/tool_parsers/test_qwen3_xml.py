"""The qwen3_xml tool-call parser: exact cases (values typed by the request's tool schema),
then the property that however the text is cut into deltas, the deltas add up to the whole
message's parse (the arguments as the JSON built from the values)."""

from __future__ import annotations

import json

from hypothesis import given, settings, strategies as st

from microvllm.entrypoints.openai.protocol import ChatCompletionRequest
from microvllm.tool_parsers import ToolParserManager
from microvllm.tool_parsers.qwen3xml_tool_parser import Qwen3XMLToolParser, convert_value
from tests.tool_parsers.deltas import as_objects, assert_stream_is_whole, cuts_of, every_cut, soups, stream, whole

P = Qwen3XMLToolParser
PROPERTIES = {"city": {"type": "string"}, "days": {"type": "integer"}, "scale": {"type": "number"},
              "metric": {"type": "boolean"}, "hours": {"type": "array"}, "where": {"type": "object"},
              "note": {"anyOf": [{"type": "null"}, {"type": "integer"}]}}
REQUEST = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "?"}], tools=[
    {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": properties}}}
    for name, properties in (("get_weather", PROPERTIES), ("get_time", {}))])


def call(name: str, **values: str) -> str:
    return (f"<tool_call>\n<function={name}>\n"
            + "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in values.items()) + "</function>\n</tool_call>")


TWO_CALLS = ("I'll look." + call("get_weather", city='Paris "Nord" </x> \\', days="3", scale="1.5", metric="True",
                                 hours="[9, 12]", where='{"lat": 48.8}', note="null")
             + "\n" + call("get_time") + " Done.")
VALUES = {"city": 'Paris "Nord" </x> \\', "days": 3, "scale": 1.5, "metric": True, "hours": [9, 12],
          "where": {"lat": 48.8}, "note": None}


def test_two_calls_typed_by_the_schema():
    content, calls = whole(P, TWO_CALLS, REQUEST)
    assert content == "I'll look. Done."   # the newline alone between the calls is not content (vLLM)
    assert as_objects(calls) == [("get_weather", VALUES), ("get_time", {})]
    for cuts in (every_cut(TWO_CALLS), [12, 15], [11, 13, 100]):   # <tool_call> split over three deltas
        assert_stream_is_whole(P, TWO_CALLS, cuts, REQUEST)
        assert all("<" not in (d.content or "") for d in filter(None, stream(P, TWO_CALLS, cuts, REQUEST)[2]))


def test_without_the_request_every_value_is_a_string():
    _, calls = whole(P, TWO_CALLS)
    assert as_objects(calls)[0][1] == {"city": 'Paris "Nord" </x> \\', "days": "3", "scale": "1.5", "metric": "True",
                                       "hours": "[9, 12]", "where": '{"lat": 48.8}', "note": "null"}
    assert_stream_is_whole(P, TWO_CALLS, every_cut(TWO_CALLS))


def test_values_that_do_not_fit_their_type_stay_strings():
    assert [convert_value(v, k) for v, k in [("3x", "integer"), ("maybe", "boolean"), ("[1,", "array"),
                                             ("inf", "number"), ("null", "string"), ("7", "weird")]] == \
        ["3x", "maybe", "[1,", "inf", "null", "7"]
    assert [convert_value(v, k) for v, k in [("-4", "integer"), ("2.0", "number"), ("2", "number"),
                                             ("False", "boolean"), ("{'a': (1,)}", "object"), ("None", "integer")]] == \
        [-4, 2.0, 2, False, {"a": (1,)}, None]


def test_strings_stream_as_written_other_values_when_whole():
    text = call("get_weather", city="Paris </par\nNord", days="12")
    _, calls, deltas = stream(P, text, every_cut(text), REQUEST)
    fragments = {i: c.function.arguments for i, d in enumerate(deltas) if d for c in d.tool_calls
                 if c.function.arguments}
    city_end, days_end = (text.index("</parameter>", at) for at in (0, text.index("days")))
    assert "".join(fragments.values()) == '{"city": "Paris </par\\nNord", "days": 12}'
    assert len([i for i in fragments if i < city_end]) > 5, "the string came in one piece"
    assert [(i, f) for i, f in fragments.items() if city_end < i][:2] == [
        (city_end + len("</parameter>") - 1, '"'), (days_end + len("</parameter>") - 1, ', "days": 12')]
    assert max(fragments) == text.index("</function>") + len("</function>") - 1, "the } waited"
    named = next(i for i, d in enumerate(deltas) if d and d.tool_calls)
    assert named == text.index("get_weather>") + len("get_weather"), "the name waited"


def test_text_that_is_not_a_call_stays_content():
    for text in ("a <tool_cal b", "<tool_call>plain</tool_call>", "<tool_call>\n<function=get weather>\n</function>",
                 "x <tool_call><function=f", "<tool_call>"):
        assert whole(P, text) == (text, []), text
        assert_stream_is_whole(P, text, every_cut(text))


def test_a_call_ends_at_anything_that_is_not_a_parameter():
    text = "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\noops</tool_call>after"
    assert whole(P, text) == ("oops</tool_call>after", [("f", '{"a": "1"}')])
    assert_stream_is_whole(P, text, every_cut(text))
    text = "<tool_call><function=f><parameter=a>1</parameter></tool_call>x"   # no </function>, no newlines
    assert whole(P, text) == ("x", [("f", '{"a": "1"}')])
    assert_stream_is_whole(P, text, every_cut(text))


def test_an_unclosed_call_at_the_end_keeps_what_was_written():
    text = "Hi<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\n<parameter=city>\nPar"
    expected = ("Hi", [("get_weather", '{"days": 3, "city": "Par"}')])
    assert whole(P, text, REQUEST) == expected
    content, calls, deltas = stream(P, text, every_cut(text), REQUEST)
    assert (content, calls) == expected
    assert deltas[-1].tool_calls[0].function.arguments == '"}', "finish_streaming closes the string and the object"
    assert whole(P, text + "\n</param", REQUEST) == ("Hi", [("get_weather", '{"days": 3, "city": "Par\\n</param"}')])
    cut_in_name = text[:text.index("city") + 2]
    assert whole(P, cut_in_name, REQUEST) == ("Hi", [("get_weather", '{"days": 3}')])
    assert_stream_is_whole(P, cut_in_name, every_cut(cut_in_name), REQUEST)
    cut_in_number = text[:text.index("3") + 1]
    assert whole(P, cut_in_number, REQUEST) == ("Hi", [("get_weather", '{"days": 3}')])
    assert_stream_is_whole(P, cut_in_number, every_cut(cut_in_number), REQUEST)


def test_the_name():
    assert ToolParserManager.get_tool_parser("qwen3_xml") is P


TEXT = st.text("ab <>/_tolcaxyz\n", max_size=10).filter(lambda t: "<tool_call>" not in t)
RAW_VALUES = st.one_of(st.text('ab "\\<>/é\n{}[]', max_size=8).filter(lambda v: "</parameter>" not in v),
                       st.integers(-50, 50).map(str), st.sampled_from(["1.5", "true", "False", "null", "[1, 2]",
                                                                       '{"lat": 1}', "x", "a</param", "\n\nb\n\n",
                                                                       "</parameter", "\n", ""]))


@st.composite
def messages(draw) -> str:
    parts = []
    for _ in range(draw(st.integers(0, 3))):
        parts.append(draw(TEXT))
        names = draw(st.lists(st.sampled_from([*PROPERTIES, "other"]), max_size=4))
        parts.append(call(draw(st.sampled_from(["get_weather", "get_time", "f"])),
                          **{name: draw(RAW_VALUES) for name in names}))
    parts.append(draw(TEXT))
    text = "".join(parts)
    return text[:draw(st.integers(len(text) - 30, len(text)))] if draw(st.booleans()) else text   # maybe cut short


@settings(max_examples=250, deadline=None, derandomize=True)
@given(data=st.data())
def test_any_cut_into_deltas_gives_the_whole_messages_parse(data):
    text = data.draw(messages())
    request = data.draw(st.sampled_from([REQUEST, None]))
    assert_stream_is_whole(P, text, data.draw(cuts_of(text)), request)
    json.dumps(whole(P, text, request))


PIECES = ['<tool_call>', '</tool_call>', '<function=', '</function>', '<parameter=', '</parameter>', '</param',
          'get_weather', 'days', 'city', 'note', '>', '<', '\n', ' ', '3', 'null', 'x', '"', '</', '[1]', 'f']


@settings(max_examples=200, deadline=None, derandomize=True)
@given(data=st.data())
def test_broken_text_comes_out_the_same_however_it_is_cut(data):
    text = data.draw(soups(PIECES))
    assert_stream_is_whole(P, text, data.draw(cuts_of(text)), data.draw(st.sampled_from([REQUEST, None])))
