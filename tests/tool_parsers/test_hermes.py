"""The hermes tool-call parser: exact cases, then the property that matters in a stream:
however the text is cut into deltas, the concatenated deltas say what the whole-message
parse says (content, each call's name, its arguments' JSON text, character for character)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from microvllm.tool_parsers import ToolParserManager
from microvllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser
from tests.tool_parsers import deltas


def stream(text: str, cuts: list[int]) -> tuple[str | None, list[tuple[str, str]], list]:
    """Feed ``text`` cut at ``cuts``; (content, [(name, arguments)], every delta)."""
    return deltas.stream(Hermes2ProToolParser, text, cuts)


def whole(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    info = Hermes2ProToolParser().extract_tool_calls(text)
    assert info.tools_called == bool(info.tool_calls)
    return info.content, [(c.function.name, c.function.arguments) for c in info.tool_calls]


TWO_CALLS = ('I\'ll check both.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>')


def test_two_calls_and_the_text_around_them():
    content, calls = whole(TWO_CALLS)
    assert content == "I'll check both."   # the newline alone between the calls is not content (vLLM)
    assert calls == [("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "CET"}')]
    assert stream(TWO_CALLS, list(range(1, len(TWO_CALLS))))[:2] == (content, calls)   # one character a delta


def test_a_tag_split_over_three_deltas_never_leaks_as_content():
    text = 'Sure<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    content, calls, deltas = stream(text, [6, 11])   # "Sure<t" "ool_c" "all>{..."
    assert content == "Sure" and calls == [("f", "{}")]
    assert all("<" not in (d.content or "") for d in filter(None, deltas))


def test_text_that_only_looks_like_a_tag_is_content():
    text = "a <tool_cal b </tool_call> c <tool"
    assert whole(text) == (text, [])
    assert stream(text, [3, 9, 20, 33])[:2] == (text, [])


def test_arguments_stream_while_they_are_written():
    text = '<tool_call>{"name": "search", "arguments": {"query": "paged attention", "k": 3}}</tool_call>'
    _, calls, deltas = stream(text, list(range(1, len(text))))
    fragments = [c.function.arguments for d in filter(None, deltas) for c in d.tool_calls if c.function.arguments]
    assert len(fragments) > 10, "the arguments came in one piece, not as they were written"
    assert json.loads("".join(fragments)) == {"query": "paged attention", "k": 3}
    first_name = next(i for i, d in enumerate(deltas) if d and d.tool_calls)
    assert first_name < text.index('"arguments"'), "the name waited for the arguments"


def test_a_call_that_is_not_json_stays_text_and_an_open_one_at_the_end_counts():
    broken = 'x<tool_call>{"name": "f", "arguments": {</tool_call>y'
    assert whole(broken) == (broken, [])
    assert stream(broken, [5, 20])[:2] == (broken, [])
    unclosed = 'x<tool_call>{"name": "f", "arguments": {"a": 1}}\n'
    assert whole(unclosed) == ("x", [("f", '{"a": 1}')])
    assert stream(unclosed, [4, 30])[:2] == ("x", [("f", '{"a": 1}')])


def test_the_parser_is_found_by_vllms_name():
    assert ToolParserManager.get_tool_parser("hermes") is Hermes2ProToolParser
    with pytest.raises(KeyError, match="--tool-call-parser"):
        ToolParserManager.get_tool_parser("nope")


# ------------------------------------------------------------ the property
TEXT = st.text(alphabet="ab <>/_tolcaxyz\n{}\"", max_size=12).filter(lambda t: "<tool_call>" not in t)
JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers(-99, 999) | st.text("ab }{<\"\\é", max_size=5),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text("kq", max_size=2), inner,
                                                                                         max_size=3), max_leaves=6)


@st.composite
def messages(draw) -> str:
    parts = []
    for _ in range(draw(st.integers(0, 3))):
        parts.append(draw(TEXT))
        name = draw(st.sampled_from(["get_weather", "f", "search_docs"]))
        arguments = draw(st.dictionaries(st.text("abc", min_size=1, max_size=3), JSON_VALUES, max_size=3))
        indent = draw(st.sampled_from([None, 2]))
        separators = draw(st.sampled_from([(", ", ": "), (",", ":")]))
        body = json.dumps({"name": name, "arguments": arguments}, indent=indent, separators=separators,
                          ensure_ascii=draw(st.booleans()))
        parts.append(f"<tool_call>{draw(st.sampled_from(['', chr(10)]))}{body}\n</tool_call>")
    parts.append(draw(TEXT))
    return "".join(parts)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(data=st.data())
def test_any_cut_into_deltas_gives_the_whole_messages_parse(data):
    text = data.draw(messages())
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=len(text))))
    assert stream(text, [c for c in cuts if c < len(text)])[:2] == whole(text)


def test_a_plugin_file_registers_its_own_parser(tmp_path):
    plugin = tmp_path / "my_parser.py"
    plugin.write_text("from microvllm.tool_parsers import ToolParserManager\n"
                      "from microvllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser\n\n"
                      "@ToolParserManager.register_module('my_format')\n"
                      "class MyParser(Hermes2ProToolParser):\n    pass\n")
    ToolParserManager.import_tool_parser(str(plugin))
    try:
        assert ToolParserManager.get_tool_parser("my_format").__name__ == "MyParser"
        assert "my_format" in ToolParserManager.list_registered()
    finally:
        ToolParserManager.registered.pop("my_format", None)
