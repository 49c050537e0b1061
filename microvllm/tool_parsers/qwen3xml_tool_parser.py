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
parser closes what is open), one cut off mid-name is left out. Each character is read once:
the search for a value's ``</parameter>`` goes on from where the last delta's stopped, and
a string value's new characters are escaped and sent without touching the old ones.
"""

from __future__ import annotations

import ast
import json
import math
import re
from typing import Any

from microvllm.tool_parsers.abstract_tool_parser import triggered_tags
from microvllm.tool_parsers.reparse import ReparsingToolParser, match_end, may_become, skip_whitespace
from microvllm.tool_parsers.scanning import dumps, loads
from microvllm.tool_parsers.streaming import partial_tag_length

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
FUNCTION_START, FUNCTION_END = "<function=", "</function>"
PARAMETER_START, PARAMETER_END = "<parameter=", "</parameter>"
NAME = re.compile(r"[^<>{}\"' \t\n\r]*")   # a function's or a parameter's name (vLLM: else stray markup)
STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")


# ---------------------------------------------------------------- the values' types
def parameter_types(request, function_name: str) -> dict[str, str]:
    """{parameter: JSON schema type} of ``function_name`` in the request's ``tools`` (empty
    without a request or a schema). A type list or ``anyOf`` gives its first type that is
    not ``null``."""
    for tool in getattr(request, "tools", None) or []:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or function.get("name") != function_name:
            continue
        parameters = function.get("parameters")
        properties = parameters.get("properties") if isinstance(parameters, dict) else None
        if not isinstance(properties, dict):
            return {}
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
        for read in (loads, ast.literal_eval):   # JSON, or else a Python literal (neither recurses deeply)
            try:
                converted = read(value)
                dumps(converted)   # a set, bytes, a complex number: a Python literal that is not JSON
                return converted
            except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                pass
    return value   # a string, or a type this parser does not know


def member(key: str, value: Any) -> str:
    """One member of the arguments' JSON object: ``"key": value``."""
    return dumps({key: value})[1:-1]


def escaped(text: str) -> str:
    """``text`` as it appears inside a JSON string (each character escaped on its own, so the
    pieces of a value escaped one after another join into the whole value's escape)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


def without_end_newlines(value: str) -> str:
    """A value less the newline after ``<parameter=P>`` and the one before ``</parameter>``."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


class Qwen3XMLToolParser(ReparsingToolParser):
    """vLLM's class for ``qwen3_xml``. The request's ``tools`` type the values; without
    them (a caller that passes no request) every value is a string. The phases of the reading
    (each keeps its place in the text between deltas)::

        outside ─<tool_call>─> function ─<function=─> function_name ─NAME>─> parameters
        parameters ─<parameter=─> parameter_name ─P>─> value ─</parameter>─> parameters
        parameters ─</function>─> after_function ─(</tool_call>)─> outside
        parameters ─</tool_call>, or anything else─> outside (the call ends there)
        a <tool_call> without a <function=NAME> after it is text: outside again, after the tag
    """

    def __init__(self, tokenizer=None) -> None:
        super().__init__(tokenizer)
        self.phase = "outside"
        self.tag = 0                      # where the last <tool_call> began
        self.name_start = 0               # where the name being read began
        self.types: dict[str, str] = {}   # the call's parameters' types
        self.members = 0                  # members of the arguments sent whole
        self.key, self.kind = "", ""      # the parameter being read, and its type
        self.value_start = 0              # where its value began
        self.value_sent: int | None = None   # a string value streamed: up to where (None: not begun)

    def step(self, text: str, final: bool) -> bool:
        """Read on in the current phase; False: wait for more text (or the end came)."""
        at = self.at
        if self.phase == "outside":
            start = self.content_until(text, TOOL_CALL_START, final)
            if start is None:
                return False
            self.tag, self.at, self.phase = start, start + len(TOOL_CALL_START), "function"
            return True
        if self.phase in ("function", "parameters", "after_function"):
            self.at = at = skip_whitespace(text, at)   # whitespace between tags: read once
        if self.phase == "function":
            if not final and may_become(text, at, FUNCTION_START):
                return False
            if not text.startswith(FUNCTION_START, at):
                return self.not_a_call()
            self.at = self.name_start = at + len(FUNCTION_START)
            self.phase = "function_name"
            return True
        if self.phase in ("function_name", "parameter_name"):
            self.at = end = match_end(NAME, text, at)   # the name's characters, each read once
            if end == len(text) and not final:
                return False
            whole = end < len(text) and text[end] == ">" and end > self.name_start
            name = text[self.name_start:end]
            if self.phase == "function_name":
                if not whole:
                    return self.not_a_call()
                self.start_call(name)
                self.types, self.members = parameter_types(self.request, name), 0
                self.at, self.phase = end + 1, "parameters"
            elif whole:
                self.key, self.kind = name, self.types.get(name, "string")
                self.value_start = self.at = end + 1
                self.value_sent, self.phase = None, "value"
            elif end == len(text):   # final: the end cut the parameter's name off: it is left out
                self.end_call(len(text))
            else:   # not a parameter: the call ends before it, and what follows is text
                self.end_call(self.name_start - len(PARAMETER_START))
            return True
        if self.phase == "value":
            return self.read_value(text, final)
        if self.phase == "parameters":
            if text.startswith(PARAMETER_START, at):
                self.at = self.name_start = at + len(PARAMETER_START)
                self.phase = "parameter_name"
            elif not final and any(may_become(text, at, tag) for tag in (PARAMETER_START, FUNCTION_END, TOOL_CALL_END)):
                return False   # nothing more yet, or the start of a tag
            elif text.startswith(FUNCTION_END, at):   # the arguments are whole: close them now
                self.close_arguments()
                self.at, self.phase = at + len(FUNCTION_END), "after_function"
            else:   # </tool_call> ends the call too; anything else ends it and is text
                self.end_call(at + len(TOOL_CALL_END) if text.startswith(TOOL_CALL_END, at) else at)
            return True
        # after_function: </tool_call> may follow; where the text goes on is not known before
        if not final and may_become(text, at, TOOL_CALL_END):
            return False
        self.at = at + len(TOOL_CALL_END) if text.startswith(TOOL_CALL_END, at) else at
        self.phase = "outside"
        return True

    def read_value(self, text: str, final: bool) -> bool:
        """A parameter's value, up to ``</parameter>``. The search for the end tag goes on from
        where it stopped (``self.at``): never re-reading the value is what keeps a long one
        O(length) in all, not O(length) per delta."""
        end = text.find(PARAMETER_END, self.at)
        if end < 0 and not final:   # still being written
            self.at = max(self.value_start, len(text) - len(PARAMETER_END) + 1)
            if self.kind in STRING_TYPES:   # a string: its text so far is certain
                self.stream_string(text)
            return False
        end = len(text) if end < 0 else end
        value = convert_value(without_end_newlines(text[self.value_start:end]), self.kind)
        if self.value_sent is None:
            self.add_arguments(("{" if self.members == 0 else ", ") + member(self.key, value))
        else:   # the rest of the string streamed so far, and its closing quote
            self.add_arguments(escaped(value[self.value_sent - self.content_start(text):]) + '"')
        self.members += 1
        self.at, self.phase = min(end + len(PARAMETER_END), len(text)), "parameters"
        return True

    def content_start(self, text: str) -> int:
        """Where a value's text begins: after the newline that follows ``<parameter=P>``."""
        return self.value_start + 1 if text.startswith("\n", self.value_start) else self.value_start

    def stream_string(self, text: str) -> None:
        """Send what is certain of a string value still being written: all but a possible
        start of ``</parameter>`` and the newline that may be the one before it."""
        if len(text) == self.value_start:
            return   # its first character may be the newline that is not part of it
        start = self.content_start(text)
        if self.value_sent is None:   # the member begins: '"key": "'
            self.add_arguments(("{" if self.members == 0 else ", ") + member(self.key, "")[:-1])
            self.value_sent = start
        safe = len(text) - partial_tag_length(text, PARAMETER_END, start)
        if safe > start and text[safe - 1] == "\n":
            safe -= 1   # it may be the newline before </parameter>
        if safe > self.value_sent:
            self.add_arguments(escaped(text[self.value_sent:safe]))
            self.value_sent = safe

    def not_a_call(self) -> bool:
        """The last <tool_call> is not followed by a call: the tag is text, and the reading
        goes on right after it."""
        self.add_content(TOOL_CALL_START)
        self.at, self.phase = self.tag + len(TOOL_CALL_START), "outside"
        return True

    def end_call(self, at: int) -> None:
        """The call ends; the text goes on at ``at``."""
        self.close_arguments()
        self.at, self.phase = at, "outside"

    def close_arguments(self) -> None:
        self.add_arguments("}" if self.members else "{}")

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
