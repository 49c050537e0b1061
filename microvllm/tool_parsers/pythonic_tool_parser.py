"""Pythonic tool calls (vLLM: ``vllm/tool_parsers/pythonic_tool_parser.py``,
``--tool-call-parser pythonic``), the format of Llama 3.2's and ToolACE's templates: the
message is a Python list of calls with keyword arguments, whose values are Python literals::

    [get_weather(city="Paris", days=[1, 2]), get_time(tz='CET', dst=True)]
     └─ call 0: {"city": "Paris", "days": [1, 2]} ┘└─ call 1: {"tz": "CET", "dst": true} ┘

The message holds calls if it begins (after whitespace) with ``[``; otherwise all of it is
content. The calls are read one after another: ``name(key=literal, ...)`` (a plain name;
keywords only; each value something ``ast.literal_eval`` reads: strings, numbers,
``True``/``False``/``None``, lists, tuples, dicts), its arguments turned into a JSON object
(``True`` -> ``true``, ``None`` -> ``null``, tuples -> lists). The first thing that is not a
call is content from there on (if it is the first, the whole message is), and so is text
after the closing ``]``. (vLLM's whole-message parse takes the message only if all of it is
one such list.)

Streaming (``ReparsingToolParser``): the arguments are not JSON as written, so a call is
sent once its closing ``)`` is written: its name, then its JSON arguments whole. A call
still open when the stream ends is content; the calls before it stand (a list left open
after a whole call is simply the calls so far).
"""

from __future__ import annotations

import ast
import json

from microvllm.tool_parsers.reparse import Parsed, ReparsingToolParser, skip_whitespace

_UNFINISHED = "unfinished"


def read_call(text: str, at: int) -> tuple[str, str, int] | None | str:
    """The call that starts at ``at``: (name, arguments JSON, where it ends), None if it is
    not a call, ``_UNFINISHED`` if no ``)`` closes it yet.

    The call ends at the first ``)`` up to which the text is a whole Python expression
    (a ``)`` inside a string or a nested call is not one of those)."""
    name_end = at
    while name_end < len(text) and (text[name_end].isalnum() or text[name_end] == "_"):
        name_end += 1
    if name_end == len(text):
        return _UNFINISHED
    if not text[at:name_end].isidentifier() or text[name_end] != "(":
        return None   # decided at once: "[1, 2]" or "[see below]" is text
    close = text.find(")", name_end)
    while close >= 0:
        try:
            expression = ast.parse(text[at:close + 1], mode="eval").body
        except (SyntaxError, ValueError, MemoryError, RecursionError):
            close = text.find(")", close + 1)
            continue
        return _call(expression, close + 1)
    return _UNFINISHED


def _call(expression: ast.expr, end: int) -> tuple[str, str, int] | None:
    if not (isinstance(expression, ast.Call) and isinstance(expression.func, ast.Name)) or expression.args:
        return None
    arguments = {}
    for keyword in expression.keywords:
        if keyword.arg is None:   # **kwargs
            return None
        try:
            arguments[keyword.arg] = ast.literal_eval(keyword.value)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return None
    try:
        return expression.func.id, json.dumps(arguments, ensure_ascii=False), end
    except (TypeError, ValueError):   # a set, bytes, a complex number: not JSON
        return None


def parse_pythonic(text: str, final: bool) -> Parsed:
    at = skip_whitespace(text, 0)
    if at == len(text):
        return Parsed(text) if final else Parsed()
    if text[at] != "[":
        return Parsed(text)
    parsed = Parsed()
    at += 1
    while True:
        at = skip_whitespace(text, at)
        if at == len(text):
            return parsed   # nothing more yet (final: the list was left open)
        if text[at] == "]" and parsed.calls:
            parsed.content = text[at + 1:]
            return parsed
        if parsed.calls:
            if text[at] != ",":
                parsed.content = text[at:]
                return parsed
            at = skip_whitespace(text, at + 1)
            if at == len(text):
                return parsed
            if text[at] == "]":   # a comma after the last call
                parsed.content = text[at + 1:]
                return parsed
        call = read_call(text, at)
        if call == _UNFINISHED and not final:
            return parsed
        if not isinstance(call, tuple):   # not a call: text from here on
            parsed.content = text[at:] if parsed.calls else text
            return parsed
        name, arguments, at = call
        parsed.calls.append((name, arguments))


class PythonicToolParser(ReparsingToolParser):
    """vLLM's class for ``pythonic``."""

    def parse(self, text: str, final: bool, request=None) -> Parsed:
        return parse_pythonic(text, final)
