"""Every registered tool parser against hostile model output (issue 66, items 4 and 12).

A prompt can steer what a model writes, so a parser reads attacker-controlled text. vLLM's
parsers never let an exception out: what they cannot parse comes back as content. Here every
parser is fed, whole and streamed in several delta sizes, text built to break it (1,000 and
5,000 nested brackets, tags left open, 5,000-digit numbers, ``"\\ud800"`` escapes, NaN,
random unicode, soups of each format's markers), and must:

- never raise;
- give strings a response can carry (UTF-8: a lone surrogate made Starlette's JSON answer a 500);
- give calls whose arguments are JSON text;
- account for the text: with no call found, the content is the text itself; with calls,
  never more content than text; and a stream adds up to the whole message's parse (the
  formats read by ``ReparsingToolParser``; hermes streams a call's name before its end,
  so a call broken after its name differs, as vLLM's does).

Then the whitespace rule (item 12): whitespace alone between or around calls is not content,
whole (content None) or streamed (no content delta at all).
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from microvllm.entrypoints.openai.protocol import ChatCompletionRequest
from microvllm.tool_parsers import ToolParserManager
from microvllm.tool_parsers.reparse import ReparsingToolParser
from microvllm.tool_parsers.scanning import MAX_DEPTH, JsonScanner, loads, nesting_depth
from tests.tool_parsers.deltas import stream, whole

PARSERS = ToolParserManager.BUILTIN
DEEP = 1000
TYPED = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "?"}], tools=[
    {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "o": {"type": "object"}, "n": {"type": "integer"}, "x": {"type": "number"}, "b": {"type": "boolean"}}}}}])


def nested(depth: int, closed: bool = True) -> str:
    return "[" * depth + "1" + ("]" * depth if closed else "")


def calls_holding(value: str) -> list[str]:
    """``value`` as a call's argument in every format."""
    return [f'<tool_call>{{"name": "f", "arguments": {{"a": {value}}}}}</tool_call>',
            f'<tool_call>\n{{"name": "f", "arguments": {{"a": {value}}}}}\n</tool_call> after',
            f'{{"name": "f", "parameters": {{"a": {value}}}}}',
            f'<|python_tag|>{{"name": "f", "parameters": {{"a": {value}}}}}; {{"name": "g", "parameters": {{}}}}',
            f'[TOOL_CALLS][{{"name": "f", "arguments": {{"a": {value}}}}}]',
            f'[TOOL_CALLS]f[ARGS]{{"a": {value}}}',
            f'[TOOL_CALLS]f[CALL_ID]abc123def[ARGS]{{"a": {value}}}[TOOL_CALLS]g[ARGS]{{}}',
            f'[f(a={value})]',
            f'<tool_call>\n<function=f>\n<parameter=o>\n{value}\n</parameter>\n</function>\n</tool_call>',
            f'<tool_call>\n<function=f>\n<parameter=n>\n{value}\n</parameter>\n<parameter=x>\n{value}\n</parameter>\n']


HOSTILE = [
    *calls_holding(nested(DEEP)), *calls_holding(nested(DEEP, closed=False)),
    *calls_holding(nested(5 * DEEP)), *calls_holding("{" * DEEP),
    *calls_holding('{"b": ' * DEEP + "1" + "}" * DEEP),
    *calls_holding("1" * 5000), *calls_holding("-" + "9" * 5000 + ".5e99999"),
    *calls_holding('"\\ud800"'), *calls_holding('"\\udc00\\ud800x"'), *calls_holding('{"\\ud800": 1}'),
    *calls_holding("NaN"), *calls_holding("-Infinity"), *calls_holding("1e999"),
    *calls_holding('"unterminated'), *calls_holding('"\\'), *calls_holding("'single'"), *calls_holding("{1, 2}"),
    *calls_holding('b"bytes"'), *calls_holding("1j"), *calls_holding("(" * DEEP + ")" * DEEP),
    "<tool_call>", "<tool_call>{", '<tool_call>{"name": ', '<tool_call>{"name": "f", "arguments": {',
    '<tool_call>{"name": 5}</tool_call>', '<tool_call>{"arguments": {}, "name": "f"}', "<tool_call>" * 300,
    "</tool_call>" * 50, "[TOOL_CALLS]", "[TOOL_CALLS]" * 50, "[TOOL_CALLS]f[CALL_ID]", "[TOOL_CALLS]f[ARGS]",
    "[TOOL_CALLS][", "<|python_tag|>", "<|python_tag|>{", "{" * 3000, "[" * 3000, "[f(", "[f(a='''",
    '[f(a="""x""", b=1)]', "[f(a=1 # )\n)]", "[f(**k)]", "[f(1)]", "[f(a=[1, 2)]", "[(]", "[" + "f()," * 500,
    "<tool_call><function=", "<tool_call>\n<function=f>\n<parameter=", "<tool_call><function=f><parameter=a>",
    "<tool_call><function=f><parameter=a>x</parameter>" * 100, "<tool_call><function=f\"><parameter=\n",
    "\x00\x01\x7f\ufeff\u2028\U0001f600", "", " ", "\n\n", "\u00a0", "\\", '"', "}", "]", ")",
]


def assert_sensible(text: str, content: str | None, calls: list[tuple[str, str]], *, arguments_are_json: bool):
    """What any parse of any text must give (see the module docstring)."""
    for piece in [content or "", *(name for name, _ in calls), *(arguments for _, arguments in calls)]:
        assert isinstance(piece, str)
        piece.encode("utf-8")   # a lone surrogate cannot go out: Starlette's JSON answer was a 500
    if not calls:
        assert content == (text or None), "with no call found, the content must be the text itself"
    else:
        assert content is None or 0 < len(content) <= len(text)
        assert all(isinstance(name, str) and name for name, _ in calls)
    if arguments_are_json:
        for _, arguments in calls:
            json.loads(arguments)


def check(name: str, text: str, request=None) -> None:
    parser = ToolParserManager.get_tool_parser(name)
    content, calls = whole(parser, text, request)
    assert_sensible(text, content, calls, arguments_are_json=True)
    for size in (1, 3, 7, 64, max(1, len(text))) if len(text) < 2500 else (7, 64, len(text)):
        cuts = list(range(size, len(text), size))
        streamed_content, streamed_calls, _ = stream(parser, text, cuts, request)
        assert_sensible(text, streamed_content, streamed_calls, arguments_are_json=False)
        if issubclass(parser, ReparsingToolParser):   # read the same way whole and streamed
            assert (streamed_content, streamed_calls) == (content, calls), (name, text[:80], size)


@pytest.mark.parametrize("name", PARSERS)
def test_no_parser_raises_on_hostile_text(name):
    for text in HOSTILE:
        check(name, text, TYPED if name == "qwen3_xml" else None)


@pytest.mark.parametrize("name", PARSERS)
def test_deep_nesting_is_text_not_a_recursion_error(name):
    """1,000 nested [ raised RecursionError (a stream stopped, a whole message was a 500)."""
    for text in calls_holding(nested(DEEP)):
        content, calls = whole(ToolParserManager.get_tool_parser(name), text, TYPED)
        assert all(nesting_depth(arguments) <= MAX_DEPTH for _, arguments in calls)
        if text.startswith("<tool_call>{") and name == "hermes":
            assert (content, calls) == (text, []), "a call nested too deep to decode is its text"


@settings(max_examples=150, deadline=None, derandomize=True)
@given(data=st.data())
def test_any_text_at_all(data):
    name = data.draw(st.sampled_from(PARSERS))
    markers = ["<tool_call>", "</tool_call>", "<function=f>", "</function>", "<parameter=o>", "</parameter>",
               "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "<|python_tag|>", '{"name": "f", "arguments": ', "[f(", ")]",
               '"', "\\", "{", "}", "[", "]", "\n", " ", ";", ",", "NaN", "1" * 40, '"\\ud800"']
    text = data.draw(st.lists(st.sampled_from(markers) | st.text(max_size=4) | st.sampled_from([nested(150)]),
                              max_size=20).map("".join))
    check(name, text, TYPED if name == "qwen3_xml" else None)


# ------------------------------------------------------------ the scanner itself
def test_the_scanner_finds_a_values_end_reading_each_character_once():
    text = '{"a": [1, "]}\\"", {"b": []}], "c": "x"} tail'
    scanner, end = JsonScanner(0), None
    for at in range(1, len(text) + 1):   # the text grows one character at a time
        before = scanner.at
        end = scanner.scan(text[:at])
        assert scanner.at <= at and scanner.at >= before
        if end is not None:
            break
    assert end == text.index(" tail") and json.loads(text[:end]) == {"a": [1, ']}"', {"b": []}], "c": "x"}


def test_loads_refuses_depth_and_huge_numbers_with_value_error_only():
    for text in (nested(MAX_DEPTH + 1), nested(50 * DEEP), "1" * 5000, "{", '"\\ud800'):
        with pytest.raises(ValueError):
            loads(text)
    assert loads(nested(MAX_DEPTH)) is not None


# ------------------------------------------------------------ item 12: whitespace between calls
HERMES_CALL = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
QWEN_CALL = "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>"
BLANK_AROUND = {   # parser: (text with whitespace alone between and around calls, its number of calls)
    "hermes": (f"\n{HERMES_CALL}\n{HERMES_CALL}\n\n", 2),
    "qwen3_xml": (f"\n{QWEN_CALL}\n \n{QWEN_CALL}\n", 2),
    "mistral": ('\n[TOOL_CALLS]f[ARGS]{"a": 1}\n[TOOL_CALLS]g[ARGS]{}\n', 2),
    "pythonic": ("\n[f(a=1), g()]\n", 2),
    "llama3_json": ('\n{"name": "f", "parameters": {"a": 1}};\n{"name": "g", "parameters": {}}\n', 2),
}


@pytest.mark.parametrize("name", sorted(BLANK_AROUND))
def test_whitespace_alone_between_or_around_calls_is_not_content(name):
    parser = ToolParserManager.get_tool_parser(name)
    text, count = BLANK_AROUND[name]
    content, calls = whole(parser, text)
    assert content is None and len(calls) == count, (content, calls)
    for size in (1, 2, 5, len(text)):
        streamed_content, streamed_calls, deltas = stream(parser, text, list(range(size, len(text), size)))
        assert [d.content for d in deltas if d and d.content] == [], "a content delta of whitespace alone"
        assert streamed_content is None and len(streamed_calls) == count


@pytest.mark.parametrize("name", ["hermes", "qwen3_xml"])
def test_text_around_calls_keeps_its_whitespace(name):
    call = HERMES_CALL if name == "hermes" else QWEN_CALL
    parser = ToolParserManager.get_tool_parser(name)
    for text, content in ((f"Sure.\n{call}\n{call}\n", "Sure.\n"), (f"{call}\n{call}\n Done.", "\n Done."),
                          (f"\n Sure.{call}", "\n Sure."), ("\n \n", "\n \n")):   # no call: the text is content
        assert whole(parser, text)[0] == content, text
        for size in (1, 3, len(text)):
            assert stream(parser, text, list(range(size, len(text), size)))[0] == content, (text, size)
