"""What the tool-parser tests share: feed a parser a message cut into deltas, put the deltas
back together as a client does, and compare with the parse of the whole message."""

from __future__ import annotations

import json

from hypothesis import strategies as st


def stream(parser_class, text: str, cuts: list[int], request=None) -> tuple[str | None, list[tuple[str, str]], list]:
    """Feed ``text`` cut at ``cuts``; (content, [(name, arguments)], every delta). Checks on
    the way that a call's first delta has its id, type and name, and no later one a name."""
    parser = parser_class()
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    deltas, previous = [], ""
    for piece in pieces:
        deltas.append(parser.extract_tool_calls_streaming(previous, previous + piece, piece, request=request))
        previous += piece
    deltas.append(parser.finish_streaming())
    content, calls = "", {}
    for delta in filter(None, deltas):
        content += delta.content or ""
        for call in delta.tool_calls:
            if call.function.name is not None:
                assert call.index not in calls and call.id and call.type == "function", call
                calls[call.index] = [call.function.name, ""]
            else:
                assert call.index in calls and call.id is None, f"arguments before the call's name: {call}"
            calls[call.index][1] += call.function.arguments or ""
    assert sorted(calls) == list(range(len(calls)))
    return content or None, [tuple(calls[i]) for i in range(len(calls))], deltas


def whole(parser_class, text: str, request=None) -> tuple[str | None, list[tuple[str, str]]]:
    info = parser_class().extract_tool_calls(text, request)
    assert info.tools_called == bool(info.tool_calls)
    assert len({call.id for call in info.tool_calls}) == len(info.tool_calls)
    return info.content, [(c.function.name, c.function.arguments) for c in info.tool_calls]


def as_objects(calls: list[tuple[str, str]]) -> list[tuple[str, object]]:
    """Each call's name and its arguments as the client reads them (``json.loads``)."""
    return [(name, json.loads(arguments)) for name, arguments in calls]


def assert_stream_is_whole(parser_class, text: str, cuts: list[int], request=None) -> None:
    """The property: the deltas add up to the whole message's parse (content exactly; the
    calls' names and order, and their arguments as JSON values)."""
    content, calls, _ = stream(parser_class, text, cuts, request)
    whole_content, whole_calls = whole(parser_class, text, request)
    assert content == whole_content, (text, cuts)
    assert as_objects(calls) == as_objects(whole_calls), (text, cuts)


def every_cut(text: str) -> list[int]:
    return list(range(1, len(text)))


@st.composite
def cuts_of(draw, text: str) -> list[int]:
    """Any cut of ``text`` into deltas (one character each at most, none at all at least)."""
    cuts = draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=len(text)))
    return sorted(c for c in cuts if c < len(text))


# JSON values with the characters that trouble a parser: quotes, backslashes, braces,
# brackets, markup, non-ASCII
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-99, 999) | st.text('ab }{[]<>/"\\é;,', max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text("kq", max_size=2), inner, max_size=3),
    max_leaves=6)
ARGUMENTS = st.dictionaries(st.text("abc_", min_size=1, max_size=3), JSON_VALUES, max_size=3)
NAMES = st.sampled_from(["get_weather", "f", "search_docs2"])


def soups(pieces: list[str]):
    """Any text made of a format's pieces (its markers, halves of them, brackets, quotes):
    mostly broken calls, which must come out the same however they are cut."""
    return st.lists(st.sampled_from(pieces), max_size=25).map("".join)
