"""Hermes tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (vLLM:
``vllm/tool_parsers/hermes_tool_parser.py``, ``--tool-call-parser hermes``), the format
Qwen2.5's and Qwen3's chat templates teach:

    I'll check both.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    {"name": "get_time", "arguments": {"tz": "CET"}}
    </tool_call>

Whole message: ``content`` is the text outside every call ("I'll check both." and the
newline between the calls), each call a ``ToolCall`` whose ``arguments`` is the JSON text
exactly as the model wrote it. A call whose JSON does not parse stays in ``content``, tags
and all; a call left open at the end of the message still counts if its JSON is whole.

Streaming: a state machine over the text, one delta at a time::

    outside ──"<tool_call>"──> inside ──"</tool_call>"──> outside
      │ content, minus a held-back     │ the name, once its string is whole; then the
      │ possible start of the tag      │ arguments' JSON text as it arrives (while the
                                       │ arguments value is still open)

Concatenating every delta's content and every call's argument fragments gives the same
content and arguments as the whole-message parse, however the text was cut into deltas
(the property ``tests/tool_parsers/test_hermes.py`` checks), given calls whose JSON is
well formed. (vLLM's whole-message parse keeps only the text before the first call.)
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from microvllm.tool_parsers.abstract_tool_parser import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCallInformation,
    FunctionCall,
    ToolCall,
    ToolParser,
    random_tool_call_id,
)
from microvllm.tool_parsers.streaming import split_held_back

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
_DECODER = json.JSONDecoder()
_WHITESPACE = " \t\n\r"


def object_members(text: str) -> tuple[dict[str, tuple[int, int]], bool]:
    """Where each member's value of the JSON object in ``text`` lies, as far as ``text``
    goes: ({key: (start, end) of its value's text}, whether the object is closed). A value
    still being written is left out. Raises ``ValueError`` for text that is not (the start
    of) an object."""
    members: dict[str, tuple[int, int]] = {}
    at = _skip(text, 0)
    if at == len(text):
        return members, False
    if text[at] != "{":
        raise ValueError("not an object")
    at += 1
    while True:
        at = _skip(text, at)
        if at == len(text):
            return members, False
        if text[at] == "}":
            return members, True
        if text[at] == "," and members:
            at = _skip(text, at + 1)
            if at == len(text):
                return members, False
        try:
            key, at = _DECODER.raw_decode(text, at)
        except json.JSONDecodeError:
            return members, False   # the key is still being written (or broken: the close decides)
        at = _skip(text, at)
        if at == len(text):
            return members, False
        if text[at] != ":" or not isinstance(key, str):
            raise ValueError("not an object")
        start = _skip(text, at + 1)
        try:
            _, end = _DECODER.raw_decode(text, start)
        except json.JSONDecodeError:
            return members, False
        if end == len(text) and text[start] not in "{[\"tfn":   # a number may go on: 12 -> 123
            return members, False
        members[key] = (start, end)
        at = end


def _skip(text: str, at: int) -> int:
    while at < len(text) and text[at] in _WHITESPACE:
        at += 1
    return at


def parse_call(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON text) of one call's body, or None if it is not a call."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    members, _ = object_members(body)
    if "arguments" not in members:
        return value["name"], "{}"
    start, end = members["arguments"]
    return value["name"], body[start:end]


class Hermes2ProToolParser(ToolParser):
    """vLLM's class name for the ``hermes`` parser (``ToolParserManager`` registers it)."""

    def __init__(self, tokenizer=None):
        super().__init__(tokenizer)
        self.buffer = ""            # text not sent yet: a possible start of a tag
        self.in_call = False
        self.body = ""              # the current call's text after <tool_call>
        self.current_tool_id = -1   # index of the call being streamed (vLLM's name)
        self.current_tool_name_sent = False
        self.arguments_sent = 0     # characters of its arguments sent so far

    # ------------------------------------------------------------ whole message
    def extract_tool_calls(self, model_output: str, request=None) -> ExtractedToolCallInformation:
        content: list[str] = []
        calls: list[ToolCall] = []
        rest = model_output
        while True:
            start = rest.find(TOOL_CALL_START)
            if start < 0:
                content.append(rest)
                break
            content.append(rest[:start])
            rest = rest[start + len(TOOL_CALL_START):]
            end = rest.find(TOOL_CALL_END)
            body, rest, closed = (rest[:end], rest[end + len(TOOL_CALL_END):], True) if end >= 0 else (rest, "", False)
            call = parse_call(body)
            if call is None:   # not a call after all: it stays text
                content.append(TOOL_CALL_START + body + (TOOL_CALL_END if closed else ""))
            else:
                calls.append(ToolCall(FunctionCall(*call)))
        text = "".join(content)
        return ExtractedToolCallInformation(bool(calls), calls, text or None)

    # ------------------------------------------------------------ streaming
    def extract_tool_calls_streaming(self, previous_text: str, current_text: str, delta_text: str,
                                     previous_token_ids: Sequence[int] = (), current_token_ids: Sequence[int] = (),
                                     delta_token_ids: Sequence[int] = (), request=None) -> DeltaMessage | None:
        self.buffer += delta_text
        delta = DeltaMessage()
        while True:
            if not self.in_call:
                start = self.buffer.find(TOOL_CALL_START)
                if start < 0:
                    safe, self.buffer = split_held_back(self.buffer, TOOL_CALL_START)
                    self._add_content(delta, safe)
                    break
                self._add_content(delta, self.buffer[:start])
                self.buffer = self.buffer[start + len(TOOL_CALL_START):]
                self.in_call, self.body = True, ""
                self.current_tool_name_sent, self.arguments_sent = False, 0
            else:
                end = self.buffer.find(TOOL_CALL_END)
                if end < 0:
                    safe, self.buffer = split_held_back(self.buffer, TOOL_CALL_END)
                    self.body += safe
                    self._stream_call(delta)
                    break
                self.body += self.buffer[:end]
                self.buffer = self.buffer[end + len(TOOL_CALL_END):]
                self._close_call(delta, closed=True)
        return None if delta.is_empty() else delta

    def finish_streaming(self) -> DeltaMessage | None:
        delta = DeltaMessage()
        if self.in_call:   # left open at the end: a call if its JSON is whole
            self.body += self.buffer
            self._close_call(delta, closed=False)
        else:
            self._add_content(delta, self.buffer)
        self.buffer = ""
        return None if delta.is_empty() else delta

    def _stream_call(self, delta: DeltaMessage) -> None:
        """Send what is certain of the open call: its name once whole, then its arguments
        while their value is still being written (never past its end)."""
        try:
            members, _ = object_members(self.body)
        except ValueError:
            return   # not a call: the close decides (it becomes text)
        if not self.current_tool_name_sent:
            if not members or next(iter(members)) != "name":
                return   # the name must come first to be streamed; else all at the close
            start, end = members["name"]
            name = json.loads(self.body[start:end])
            if not isinstance(name, str):
                return
            self.current_tool_id += 1
            self.current_tool_name_sent = True
            delta.tool_calls.append(DeltaToolCall(self.current_tool_id, DeltaFunctionCall(name=name),
                                                  id=random_tool_call_id(), type="function"))
        arguments_start = self._arguments_start()
        if arguments_start is None:
            return
        value_end = members["arguments"][1] if "arguments" in members else len(self.body)
        self._send_arguments(delta, self.body[arguments_start:value_end])

    def _arguments_start(self) -> int | None:
        """Where the arguments' value starts, if the member after the name is "arguments"
        and its value has begun with {, [ or a string (a number could still grow)."""
        at = self.body.find('"arguments"')
        if at < 0:
            return None
        try:
            members, _ = object_members(self.body[:at])
        except ValueError:
            return None
        if list(members) != ["name"]:
            return None
        colon = _skip(self.body, at + len('"arguments"'))
        if colon == len(self.body) or self.body[colon] != ":":
            return None
        start = _skip(self.body, colon + 1)
        if start == len(self.body) or self.body[start] not in "{[\"":
            return None
        return start

    def _send_arguments(self, delta: DeltaMessage, arguments: str) -> None:
        new = arguments[self.arguments_sent:]
        if new:
            self.arguments_sent = len(arguments)
            delta.tool_calls.append(DeltaToolCall(self.current_tool_id, DeltaFunctionCall(arguments=new)))

    def _close_call(self, delta: DeltaMessage, *, closed: bool) -> None:
        call = parse_call(self.body)
        if call is not None and not self.current_tool_name_sent:
            self.current_tool_id += 1
            delta.tool_calls.append(DeltaToolCall(self.current_tool_id, DeltaFunctionCall(name=call[0]),
                                                  id=random_tool_call_id(), type="function"))
        if call is not None:
            self._send_arguments(delta, call[1])
        elif not self.current_tool_name_sent:   # not a call after all: it was text
            self._add_content(delta, TOOL_CALL_START + self.body + (TOOL_CALL_END if closed else ""))
        self.in_call, self.body = False, ""

    @staticmethod
    def _add_content(delta: DeltaMessage, text: str) -> None:
        if text:
            delta.content = (delta.content or "") + text
