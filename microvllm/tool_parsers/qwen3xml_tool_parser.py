"""Qwen3 XML tool calls (vLLM: ``vllm/tool_parsers/qwen3xml_tool_parser.py``,
``--tool-call-parser qwen3_xml``; vLLM's newest releases serve it, and ``qwen3_coder``, with
``Qwen3EngineToolParser``), the format Qwen3-Coder's and Qwen3.5's chat templates teach: no
JSON at all, each argument a tagged block of plain text::

    I'll look.<tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A value is the text between ``<parameter=P>`` and the first ``</parameter>`` after it, less
one newline at each end; anything may be in it (code, ``</``, quotes) but
``</parameter>`` itself. Its JSON type comes from the request's tool schema
(``parameter_types``): ``"3"`` is the number 3 for an ``integer`` parameter and the string
``"3"`` for a ``string`` one; without a schema every value is a string. The arguments are the
JSON object built from the values, in the order written.

Reading a call, and what happens to text that breaks the format::

    <tool_call> <function=NAME>   a call begins (whitespace between the tags is allowed);
                                  a <tool_call> not followed by a valid <function=NAME>
                                  is text, and reading goes on right after it
    <parameter=P>value</parameter> ... any number of them
    </function> </tool_call>      the call ends (either tag, or both); so does anything else
                                  that is not a parameter, which is text again from there

Streaming (``ReparsingToolParser``): content is sent as it comes, less a possible start of
``<tool_call>``; a call's name as soon as ``<function=NAME>`` is whole; a string parameter's
value as it is written (less a possible start of ``</parameter>`` and a last newline, which
may be the one before it); any other parameter once its ``</parameter>`` is written, since
its type may turn the whole value into something else (``nul`` is text, ``null`` is null);
the closing ``}`` when the call ends. A call still open when the stream ends counts, with
what was written of it: a parameter cut off mid-value keeps its value so far (as vLLM's
parser closes what is open), one cut off mid-name is left out.
"""

from __future__ import annotations

import ast
import json
import math
from typing import Any

from microvllm.tool_parsers.abstract_tool_parser import triggered_tags
from microvllm.tool_parsers.reparse import Parsed, ReparsingToolParser, may_become, skip_whitespace
from microvllm.tool_parsers.streaming import split_held_back

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
FUNCTION_START, FUNCTION_END = "<function=", "</function>"
PARAMETER_START, PARAMETER_END = "<parameter=", "</parameter>"
NOT_IN_A_NAME = frozenset("<>{}\"' \t\n\r")   # vLLM: not a function's name but stray markup
STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")


# ---------------------------------------------------------------- the values' types
def parameter_types(request, function_name: str) -> dict[str, str]:
    """{parameter: JSON schema type} of ``function_name`` in the request's ``tools`` (empty
    without a request or a schema). A type list or ``anyOf`` gives its first type that is
    not ``null``."""
    for tool in getattr(request, "tools", None) or []:
        function = (tool.get("function") or {}) if isinstance(tool, dict) else {}
        if function.get("name") != function_name:
            continue
        properties = (function.get("parameters") or {}).get("properties") or {}
        return {name: _type_of(schema) for name, schema in properties.items() if isinstance(schema, dict)}
    return {}


def _type_of(schema: dict) -> str:
    kinds = schema.get("type")
    if kinds is None and isinstance(schema.get("anyOf"), list):
        kinds = [option.get("type") for option in schema["anyOf"] if isinstance(option, dict)]
    for kind in kinds if isinstance(kinds, list) else [kinds]:
        if isinstance(kind, str) and kind != "null":
            return kind
    return "string"


def convert_value(value: str, kind: str) -> Any:
    """A parameter's text as its schema type says (vLLM's ``_convert_param_value``); text
    that does not fit the type stays a string, so nothing the model wrote is lost."""
    if kind not in STRING_TYPES and value.strip().lower() in ("null", "none"):
        return None
    if kind in ("integer", "int"):
        try:
            return int(value)
        except ValueError:
            return value
    if kind in ("number", "float"):
        try:
            number = float(value)
        except ValueError:
            return value
        if not math.isfinite(number):   # JSON has no inf or nan
            return value
        return int(number) if number.is_integer() and "." not in value and "e" not in value.lower() else number
    if kind in ("boolean", "bool"):
        return {"true": True, "false": False}.get(value.strip().lower(), value)
    if kind in ("object", "array", "dict", "list"):
        for read in (json.loads, ast.literal_eval):   # JSON, or else a Python literal
            try:
                return read(value)
            except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                pass
    return value   # a string, or a type this parser does not know


def arguments_json(members: list[str], finished: bool) -> str:
    """The arguments' JSON text from its members' ``"key": value`` texts: all of it once the
    call is finished, else as far as it can no longer change (nothing before the first)."""
    if finished:
        return "{" + ", ".join(members) + "}"
    return "{" + ", ".join(members) if members else ""


# ---------------------------------------------------------------- reading the text
def without_end_newlines(value: str) -> str:
    """A value less the newline after ``<parameter=P>`` and the one before ``</parameter>``."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def settled_string(written: str) -> str:
    """What is certain of a string value still being written: all but a possible start of
    ``</parameter>`` and the newline that may be the one before it."""
    written = written[1:] if written.startswith("\n") else written
    safe, _ = split_held_back(written, PARAMETER_END)
    return safe[:-1] if safe.endswith("\n") else safe


def read_name(text: str, at: int) -> tuple[str, int] | None | bool:
    """The name that starts at ``at`` and ends at ``>``: (name, where ``>`` ends); None if
    it cannot be a name; False if it is not whole yet."""
    end = at
    while end < len(text) and text[end] != ">":
        if text[end] in NOT_IN_A_NAME:
            return None
        end += 1
    if end == len(text):
        return False
    return (text[at:end], end + 1) if end > at else None


def parse_qwen3_xml(text: str, final: bool, request=None) -> Parsed:
    parsed, at = Parsed(), 0
    while True:
        start = text.find(TOOL_CALL_START, at)
        if start < 0:
            parsed.content += text[at:] if final else split_held_back(text[at:], TOOL_CALL_START)[0]
            return parsed
        parsed.content += text[at:start]
        at = start + len(TOOL_CALL_START)
        function = skip_whitespace(text, at)
        if not final and may_become(text[function:], FUNCTION_START):
            return parsed
        name = read_name(text, function + len(FUNCTION_START)) if text.startswith(FUNCTION_START, function) else None
        if name is False and not final:
            return parsed
        if not isinstance(name, tuple):   # not a call: the tag is text
            parsed.content += TOOL_CALL_START
            continue
        at = _read_call(text, name[1], final, parameter_types(request, name[0]), parsed, name[0])
        if at < 0:
            return parsed


def _read_call(text: str, at: int, final: bool, types: dict[str, str], parsed: Parsed, name: str) -> int:
    """Read a call's parameters and its end from ``at`` into ``parsed``; where the text
    goes on after it, or -1 if that is not known yet."""
    members: list[str] = []
    index = len(parsed.calls)
    parsed.calls.append((name, ""))
    while True:
        parsed.calls[index] = (name, arguments_json(members, False))
        at = skip_whitespace(text, at)
        if text.startswith(PARAMETER_START, at):
            parameter = read_name(text, at + len(PARAMETER_START))
            if parameter is False and not final:
                return -1   # its name is still being written
            if isinstance(parameter, tuple):
                key, start = parameter
                kind = types.get(key, "string")
                end = text.find(PARAMETER_END, start)
                if end < 0 and not final:   # its value is still being written
                    if kind in STRING_TYPES:   # a string: its text so far is certain
                        written = json.dumps({key: settled_string(text[start:])}, ensure_ascii=False)[1:-2]
                        parsed.calls[index] = (name, arguments_json([*members, written], False))
                    return -1
                value = convert_value(without_end_newlines(text[start:end if end >= 0 else len(text)]), kind)
                members.append(json.dumps({key: value}, ensure_ascii=False)[1:-1])   # '"key": value'
                at = end + len(PARAMETER_END) if end >= 0 else len(text)
                continue
            if parameter is False:   # the end cut its name off: it is left out
                at = len(text)
        elif not final and any(may_become(text[at:], tag) for tag in (PARAMETER_START, FUNCTION_END, TOOL_CALL_END)):
            return -1   # nothing more yet, or the start of a tag
        elif text.startswith(FUNCTION_END, at):
            at = skip_whitespace(text, at + len(FUNCTION_END))
            parsed.calls[index] = (name, arguments_json(members, True))
            if not final and may_become(text[at:], TOOL_CALL_END):
                return -1   # </tool_call> may follow: where the text goes on is not known yet
            return at + len(TOOL_CALL_END) if text.startswith(TOOL_CALL_END, at) else at
        elif text.startswith(TOOL_CALL_END, at):
            at += len(TOOL_CALL_END)
        parsed.calls[index] = (name, arguments_json(members, True))
        return at


class Qwen3XMLToolParser(ReparsingToolParser):
    """vLLM's class for ``qwen3_xml``. The request's ``tools`` type the values; without
    them (a caller that passes no request) every value is a string."""

    def parse(self, text: str, final: bool, request=None) -> Parsed:
        return parse_qwen3_xml(text, final, request)

    @classmethod
    def structural_tag(cls, functions: dict[str, dict]) -> dict:
        """After ``<tool_call>``: one function's call, its parameters as xgrammar's ``qwen_xml``
        style writes a schema (``<parameter=P>value</parameter>``, each value of its type)."""
        tag = triggered_tags(TOOL_CALL_START, [
            (f"{TOOL_CALL_START}\n{FUNCTION_START}{name}>\n", schema, f"{FUNCTION_END}\n{TOOL_CALL_END}")
            for name, schema in functions.items()])
        for each in tag["format"]["tags"]:
            each["content"]["style"] = "qwen_xml"
        return tag
