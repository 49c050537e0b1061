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

Streaming: a state machine over the text, one delta at a time (``parse_delta``)::

    outside ──"<tool_call>"──> inside ──"</tool_call>"──> outside
      │ content, minus a held-back     │ the name, once its string is whole; then the
      │ possible start of the tag      │ arguments' JSON text as it arrives (while the
                                       │ arguments value is still open: ``streamable_call``)

Concatenating every delta's content and every call's argument fragments gives the same
content and arguments as the whole-message parse, however the text was cut into deltas
(the property ``tests/tool_parsers/test_hermes.py`` checks), given calls whose JSON is
well formed. (vLLM's whole-message parse keeps only the text before the first call.)

``parse_delta`` and ``send_call`` are exercise 21 (``python -m microvllm course build 21``
cuts their marked bodies out); ``split_held_back``, ``streamable_call`` and ``parse_call``
are given to the learner.
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
    triggered_tags,
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


def streamable_call(body: str) -> tuple[str | None, str | None]:
    """What is certain of a call still being written, ``body`` being its text so far:
    (its name, once the name's string is whole and it is the object's first member; the
    arguments' JSON text written so far, once the member after the name is "arguments" and
    its value has begun with {, [ or a string). None for what is not certain yet::

        {"name": "get_wea                       -> (None, None)
        {"name": "get_weather", "argu           -> ("get_weather", None)
        {"name": "get_weather", "arguments": {"ci   -> ("get_weather", '{"ci')
        {"name": "get_weather", "arguments": {"city": "Paris"}}   -> (.., '{"city": "Paris"}')

    The arguments never run past their value's end, so the text sent while streaming is
    always a beginning of what ``parse_call`` finds at the close."""
    try:
        members, _ = object_members(body)
    except ValueError:
        return None, None   # not a call: the close decides (it becomes text)
    if not members or next(iter(members)) != "name":
        return None, None   # the name must come first to be streamed; else all at the close
    start, end = members["name"]
    name = json.loads(body[start:end])
    if not isinstance(name, str):
        return None, None
    arguments_start = _arguments_start(body)
    if arguments_start is None:
        return name, None
    value_end = members["arguments"][1] if "arguments" in members else len(body)
    return name, body[arguments_start:value_end]


def _arguments_start(body: str) -> int | None:
    """Where the arguments' value starts, if the member after the name is "arguments"
    and its value has begun with {, [ or a string (a number could still grow)."""
    at = body.find('"arguments"')
    if at < 0:
        return None
    try:
        members, _ = object_members(body[:at])
    except ValueError:
        return None
    if list(members) != ["name"]:
        return None
    colon = _skip(body, at + len('"arguments"'))
    if colon == len(body) or body[colon] != ":":
        return None
    start = _skip(body, colon + 1)
    if start == len(body) or body[start] not in "{[\"":
        return None
    return start


def add_content(delta: DeltaMessage, text: str) -> None:
    """Append ``text`` to ``delta.content`` (None stays None for no text)."""
    if text:
        delta.content = (delta.content or "") + text


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
        self.buffer = ""            # text received but not handled yet: a possible start of a tag
        self.in_call = False        # between <tool_call> and </tool_call>
        self.body = ""              # the current call's text after <tool_call>, as far as it is safe
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

    # ------------------------------------------------------------ strict tool calls
    @classmethod
    def structural_tag(cls, functions: dict[str, dict]) -> dict:
        """After ``<tool_call>``: one function's call, its arguments under its schema."""
        return triggered_tags(TOOL_CALL_START, [
            (f'{TOOL_CALL_START}\n{{"name": {json.dumps(name)}, "arguments": ', schema, f"}}\n{TOOL_CALL_END}")
            for name, schema in functions.items()])

    # ------------------------------------------------------------ streaming
    def extract_tool_calls_streaming(self, previous_text: str, current_text: str, delta_text: str,
                                     previous_token_ids: Sequence[int] = (), current_token_ids: Sequence[int] = (),
                                     delta_token_ids: Sequence[int] = (), request=None) -> DeltaMessage | None:
        delta = self.parse_delta(delta_text)
        return None if delta.is_empty() else delta

    def finish_streaming(self) -> DeltaMessage | None:
        delta = self.parse_delta("", end_of_stream=True)
        return None if delta.is_empty() else delta

    def parse_delta(self, delta_text: str, *, end_of_stream: bool = False) -> DeltaMessage:
        """One step of the state machine: what ``delta_text`` adds (``end_of_stream``: nothing
        more will come, so nothing may stay held back)::

            buffer += delta_text, then, until nothing more is certain:
              outside a call   "<tool_call>" in the buffer: the text before it is content,
                               enter the call (a fresh body, its name not sent, 0 argument
                               characters sent); else send what cannot begin the tag
                               (split_held_back), keep the rest
              inside a call    "</tool_call>" in the buffer: the body ends before it, close
                               the call (parse_call: send what is left of it, or give the
                               whole tagged text back as content if it is not a call and
                               nothing of it was sent), go on outside with the rest; else
                               move what cannot begin the end tag into the body and send
                               what is certain of it (streamable_call)
              end of stream    a call left open closes as it is (no end tag); the text
                               held back outside a call is content after all
        """
        ### BEGIN SOLUTION
        self.buffer += delta_text
        delta = DeltaMessage()
        while True:
            if not self.in_call:
                start = self.buffer.find(TOOL_CALL_START)
                if start < 0:
                    if end_of_stream:   # it was not a tag after all
                        safe, self.buffer = self.buffer, ""
                    else:
                        safe, self.buffer = split_held_back(self.buffer, TOOL_CALL_START)
                    add_content(delta, safe)
                    return delta
                add_content(delta, self.buffer[:start])
                self.buffer = self.buffer[start + len(TOOL_CALL_START):]
                self.in_call, self.body = True, ""
                self.current_tool_name_sent, self.arguments_sent = False, 0
                continue
            end = self.buffer.find(TOOL_CALL_END)
            if end < 0 and not end_of_stream:
                safe, self.buffer = split_held_back(self.buffer, TOOL_CALL_END)
                self.body += safe
                self.send_call(delta, *streamable_call(self.body))
                return delta
            closed = end >= 0
            self.body += self.buffer[:end] if closed else self.buffer
            self.buffer = self.buffer[end + len(TOOL_CALL_END):] if closed else ""
            call = parse_call(self.body)
            if call is not None:
                self.send_call(delta, *call)
            elif not self.current_tool_name_sent:   # not a call after all: it was text
                add_content(delta, TOOL_CALL_START + self.body + (TOOL_CALL_END if closed else ""))
            self.in_call, self.body = False, ""
        ### END SOLUTION

    def send_call(self, delta: DeltaMessage, name: str | None, arguments: str | None) -> None:
        """Add to ``delta`` what is new of the current call, given what is known of it now
        (``name``, ``arguments``: None while not known): the call's first piece once, when its
        name is known (the next index, a new id, type "function", the name), then the
        characters of ``arguments`` not sent before (``arguments`` only grows)::

            known               sent before        adds
            (None, None)        nothing            nothing
            ("f", None)         nothing            DeltaToolCall(0, name="f", id=..., type="function")
            ("f", '{"a": ')     the name           DeltaToolCall(0, arguments='{"a": ')
            ("f", '{"a": 1}')   '{"a": '           DeltaToolCall(0, arguments='1}')
        """
        ### BEGIN SOLUTION
        if name is None:
            return
        if not self.current_tool_name_sent:
            self.current_tool_id += 1
            self.current_tool_name_sent = True
            delta.tool_calls.append(DeltaToolCall(self.current_tool_id, DeltaFunctionCall(name=name),
                                                  id=random_tool_call_id(), type="function"))
        new = (arguments or "")[self.arguments_sent:]
        if new:
            self.arguments_sent += len(new)
            delta.tool_calls.append(DeltaToolCall(self.current_tool_id, DeltaFunctionCall(arguments=new)))
        ### END SOLUTION
