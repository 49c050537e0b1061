"""Llama 3 JSON tool calls (vLLM: ``vllm/tool_parsers/llama_tool_parser.py``,
``--tool-call-parser llama3_json``), the format of vLLM's Llama 3.1/3.2 JSON chat templates:
the whole message is the calls, each a JSON object, several separated by ``;``, maybe
after the ``<|python_tag|>`` token::

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "f", "parameters": {}}
    └─ dropped ──┘└─ call 0 ────────────────────────────────────────────┘  └─ call 1 ─────────────────┘

The message holds calls if it begins (after whitespace) with ``<|python_tag|>`` or ``{``;
otherwise all of it is content. Calls are read one after another; a call is an object with
a string ``name`` and an object ``parameters`` (or ``arguments``), whose JSON is the call's
arguments. The first thing that is not a call (a malformed object, text after the calls)
is content from there to the end; if the first one is not a call, the whole message is
content. (vLLM's whole-message parse looks for objects anywhere in the text and drops the
text around them; its stream reads calls only from the start, as this one does.)

Streaming (``ReparsingToolParser``): a call is sent whole, name then arguments, the moment
its object closes; text at the start waits until it is clear whether calls begin; an
object still open when the stream ends is text, since its arguments are not known.
"""

from __future__ import annotations

import json

from microvllm.tool_parsers.reparse import Parsed, ReparsingToolParser, may_become, skip_whitespace

PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()


def read_call(text: str, at: int) -> tuple[str, str, int] | None | bool:
    """The call whose object starts at ``at``: (name, arguments JSON, where it ends); None if
    it is not a call; False if its object is not closed yet (or never will be: the stream's
    end decides)."""
    if text[at] != "{":
        return None
    try:
        value, end = _DECODER.raw_decode(text, at)
    except json.JSONDecodeError:
        return False
    arguments = value.get("parameters", value.get("arguments"))
    if not isinstance(value.get("name"), str) or not isinstance(arguments, dict):
        return None
    return value["name"], json.dumps(arguments, ensure_ascii=False), end


def parse_llama3_json(text: str, final: bool) -> Parsed:
    start = skip_whitespace(text, 0)
    if text.startswith(PYTHON_TAG, start):
        at = start + len(PYTHON_TAG)
    elif text.startswith("{", start):
        at = start
    elif not final and may_become(text[start:], PYTHON_TAG):
        return Parsed()   # calls may still begin: hold the text back
    else:
        return Parsed(text)
    parsed = Parsed()
    while True:
        at = skip_whitespace(text, at)
        if at == len(text):
            return parsed   # nothing more yet (final: the calls end here)
        call = read_call(text, at)
        if call is False and not final:
            return parsed   # an object still being written
        if not isinstance(call, tuple):   # not a call: text from here on
            parsed.content = text[at:] if parsed.calls else text
            return parsed
        name, arguments, at = call
        parsed.calls.append((name, arguments))
        after = skip_whitespace(text, at)
        if after == len(text):
            return parsed
        if text[after] != ";":
            parsed.content = text[after:]
            return parsed
        at = after + 1


class Llama3JsonToolParser(ReparsingToolParser):
    """vLLM's class for ``llama3_json`` (and ``llama4_json``)."""

    def parse(self, text: str, final: bool, request=None) -> Parsed:
        return parse_llama3_json(text, final)
