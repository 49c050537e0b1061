"""Mistral tool calls (vLLM: ``vllm/tool_parsers/mistral_tool_parser.py``,
``--tool-call-parser mistral``): content, then the ``[TOOL_CALLS]`` token and the calls, in
either of the forms Mistral's tokenizers have used::

    before v11 (Mistral 7B v0.3):  Sure.[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"name": "g"}]
    v11 and later (Mistral Small 3.1+, Devstral, Ministral 3), one token per call:
                                   Sure.[TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g[ARGS]{}
                                   Sure.[TOOL_CALLS]f[CALL_ID]a1b2c3d4e[ARGS]{"a": 1}
                                   Sure.[TOOL_CALLS]f{"a": 1}          (v11 without [ARGS])

After each ``[TOOL_CALLS]``: a JSON list of ``{"name", "arguments"}`` objects if a ``[``
comes first, else a name (letters, digits, ``_``, ``-``, ``.``), an optional ``[CALL_ID]``
(skipped: as vLLM does, the server makes its own ids), an optional ``[ARGS]`` and the
arguments' JSON object. Text between calls and after them is content. The first
``[TOOL_CALLS]`` whose calls do not parse makes the rest of the message content, marker and
all. All forms are read from the text, so the special tokens must be in it (vLLM's
``adjust_request`` sets ``skip_special_tokens=False`` for this; a v11+ ``MistralTokenizer``
lets vLLM stream from the token ids instead, which this parser does not need).

Mistral's chat templates accept only ids of 9 letters and digits (``MistralToolCall``), so
the calls get such ids. Streaming (``ReparsingToolParser``): content is sent as it comes,
less a possible start of ``[TOOL_CALLS]``; each call is sent whole (name, then arguments)
once its JSON closes (the list form: all of its calls when the list closes); a call still
open when the stream ends is content, since its arguments are not known.
"""

from __future__ import annotations

import json
import random
import string

from microvllm.tool_parsers.reparse import Parsed, ReparsingToolParser, may_become, skip_whitespace
from microvllm.tool_parsers.streaming import split_held_back

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
NAME_CHARACTERS = frozenset(string.ascii_letters + string.digits + "_-.")
_DECODER = json.JSONDecoder()
_UNFINISHED = "unfinished"   # the calls after a marker are still being written


def read_list(text: str, at: int) -> tuple[list[tuple[str, str]], int] | None | str:
    """The calls of the JSON list at ``at``: (calls, where the list ends), None if it is
    not a list of calls, ``_UNFINISHED`` if the list is not closed yet."""
    try:
        value, end = _DECODER.raw_decode(text, at)
    except json.JSONDecodeError:
        return _UNFINISHED
    if not isinstance(value, list) or not value:
        return None
    calls = []
    for call in value:
        if not (isinstance(call, dict) and isinstance(call.get("name"), str)
                and isinstance(call.get("arguments", {}), dict)):
            return None
        calls.append((call["name"], json.dumps(call.get("arguments", {}), ensure_ascii=False)))
    return calls, end


def read_named(text: str, at: int) -> tuple[list[tuple[str, str]], int] | None | str:
    """``NAME[CALL_ID]ID[ARGS]{...}`` at ``at`` (the v11+ form), as ``read_list`` answers."""
    end = at
    while end < len(text) and text[end] in NAME_CHARACTERS:
        end += 1
    name = text[at:end]
    if end == len(text):
        return _UNFINISHED
    if not name:
        return None
    if text.startswith(CALL_ID, end):
        end += len(CALL_ID)
        while end < len(text) and text[end].isalnum():
            end += 1
    for marker in (CALL_ID, ARGS):
        if may_become(text[end:], marker):
            return _UNFINISHED
    if text.startswith(ARGS, end):
        end += len(ARGS)
    if end == len(text):
        return _UNFINISHED
    if text[end] != "{":
        return None
    try:
        arguments, end = _DECODER.raw_decode(text, end)
    except json.JSONDecodeError:
        return _UNFINISHED
    return [(name, json.dumps(arguments, ensure_ascii=False))], end


def parse_mistral(text: str, final: bool) -> Parsed:
    parsed, at = Parsed(), 0
    while True:
        marker = text.find(TOOL_CALLS, at)
        if marker < 0:
            parsed.content += text[at:] if final else split_held_back(text[at:], TOOL_CALLS)[0]
            return parsed
        parsed.content += text[at:marker]
        start = skip_whitespace(text, marker + len(TOOL_CALLS))
        found = _UNFINISHED if start == len(text) else (
            read_list(text, start) if text[start] == "[" else read_named(text, start))
        if found == _UNFINISHED and not final:
            return parsed
        if not isinstance(found, tuple):   # not calls: text from the marker on
            parsed.content += text[marker:]
            return parsed
        calls, at = found
        parsed.calls += calls


class MistralToolParser(ReparsingToolParser):
    """vLLM's class for ``mistral``."""

    def parse(self, text: str, final: bool, request=None) -> Parsed:
        return parse_mistral(text, final)

    def new_id(self) -> str:
        """Nine letters and digits, the only ids Mistral's templates accept (vLLM:
        ``MistralToolCall.generate_random_id``)."""
        return "".join(random.choices(string.ascii_letters + string.digits, k=9))
