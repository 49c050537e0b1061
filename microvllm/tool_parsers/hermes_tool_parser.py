"""Hermes tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (vLLM:
``vllm/tool_parsers/hermes_tool_parser.py``, ``--tool-call-parser hermes``), the format
Qwen2.5's and Qwen3's chat templates teach:

    I'll check both.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    {"name": "get_time", "arguments": {"tz": "CET"}}
    </tool_call>

Whole message: ``content`` is the text outside every call ("I'll check both."), each call a
``ToolCall`` whose ``arguments`` is the JSON text exactly as the model wrote it. Whitespace
alone between or around calls (the newline between the two above) is not content: vLLM
keeps none after the first call, and a client would show a message of one newline. A call
whose JSON does not parse stays in ``content``, tags and all, and so does one nested deeper
than ``scanning.MAX_DEPTH`` (no text the model writes makes a parser raise); a call left
open at the end of the message still counts if its JSON is whole.

Streaming: a state machine over the text, one delta at a time (``parse_delta``)::

    outside ──"<tool_call>"──> inside ──"</tool_call>"──> outside
      │ content, minus a held-back     │ the name, once its string is whole; then the
      │ possible start of the tag      │ arguments' JSON text as it arrives (while the
      │ (whitespace alone waits:       │ arguments value is still open: ``CallScan``,
      │ ``add_content``)               │ which reads each character of the body once)

Concatenating every delta's content and every call's argument fragments gives the same
content and arguments as the whole-message parse, however the text was cut into deltas
(the property ``tests/tool_parsers/test_hermes.py`` checks), given calls whose JSON is
well formed. (vLLM's whole-message parse keeps only the text before the first call.)

``parse_delta`` and ``send_call`` are exercise 21 (``python -m microvllm course build 21``
cuts their marked bodies out); ``split_held_back``, ``CallScan``, ``parse_call`` and
``add_content`` are given to the learner.
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
from microvllm.tool_parsers.scanning import JsonScanner, loads
from microvllm.tool_parsers.streaming import split_held_back

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
_DECODER = json.JSONDecoder()
_WHITESPACE = " \t\n\r"


def object_members(text: str) -> tuple[dict[str, tuple[int, int]], bool]:
    """Where each member's value of the JSON object in ``text`` lies, as far as ``text``
    goes: ({key: (start, end) of its value's text}, whether the object is closed). A value
    still being written is left out. Raises ``ValueError`` for text that is not (the start
    of) an object. It decodes each member: call it on a body ``loads`` has accepted (no
    deeper than ``MAX_DEPTH``), once, not at every delta."""
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
        except ValueError:
            return members, False   # the key is still being written (or broken: the close decides)
        at = _skip(text, at)
        if at == len(text):
            return members, False
        if text[at] != ":" or not isinstance(key, str):
            raise ValueError("not an object")
        start = _skip(text, at + 1)
        try:
            _, end = _DECODER.raw_decode(text, start)
        except ValueError:
            return members, False
        if end == len(text) and text[start] not in "{[\"tfn":   # a number may go on: 12 -> 123
            return members, False
        members[key] = (start, end)
        at = end


def _skip(text: str, at: int) -> int:
    while at < len(text) and text[at] in _WHITESPACE:
        at += 1
    return at


class CallScan:
    """What is certain of one call still being written, read as its body grows: each
    character once. ``streamable_call(body)`` is given the body so far at every delta and
    reads only what was added since the last time (from ``self.at``): parsing the whole body
    again at every delta would cost O(length) per delta, O(length²) for a long call (2,000
    arguments took seconds, on the event loop every other stream waits on).

    It follows the shape every model writes, one piece after another (``SHAPE``)::

        {  "name"  :  "get_weather"  ,  "arguments"  :  {"city": "Par...
        0    1    2        3         4       5       6  7 (the value: a JsonScanner finds its end)

    A body of another shape (the arguments first, a number as the name) streams nothing
    more from where it differs (``stuck``): the close decides (``parse_call``)."""

    SHAPE = ("{", "name", ":", "the name", ",", "arguments", ":", "the value")

    def __init__(self) -> None:
        self.at = 0                # the next character of the body to read
        self.step = 0              # which piece of SHAPE comes next
        self.string: JsonScanner | None = None   # a key or the name being read
        self.name: str | None = None
        self.arguments_start: int | None = None
        self.value: JsonScanner | None = None    # the arguments' value being read
        self.stuck = False

    def streamable_call(self, body: str) -> tuple[str | None, str | None]:
        """(the name, once its string is whole; the arguments' JSON text written so far, once
        their value has begun with {, [ or a string), None for what is not certain yet::

            {"name": "get_wea                       -> (None, None)
            {"name": "get_weather", "argu           -> ("get_weather", None)
            {"name": "get_weather", "arguments": {"ci   -> ("get_weather", '{"ci')
            {"name": "get_weather", "arguments": {"city": "Paris"}}   -> (.., '{"city": "Paris"}')

        The arguments never run past their value's end (nor past ``MAX_DEPTH`` brackets), so
        the text sent while streaming is always a beginning of what ``parse_call`` finds at
        the close."""
        while not self.stuck and self.value is None and self.read_piece(body):
            pass   # one piece of SHAPE per turn
        if self.value is None or self.arguments_start is None:
            return self.name, None
        end = self.value.scan(body)
        return self.name, body[self.arguments_start:end if end is not None else self.value.at]

    def read_piece(self, body: str) -> bool:
        """Read the next piece of SHAPE if it is whole; False: wait for more (or stuck)."""
        if self.string is None:
            self.at = _skip(body, self.at)
            if self.at == len(body):
                return False
        piece = self.SHAPE[self.step]
        if piece in ("{", ":", ","):
            self.stuck = body[self.at] != piece
            self.at += 1
        elif piece == "the value":
            self.stuck = body[self.at] not in '{["'   # a number could still grow: the close decides
            if not self.stuck:
                self.arguments_start, self.value = self.at, JsonScanner(self.at)
            return False
        else:   # a string: the key "name", the name, the key "arguments"
            if self.string is None:
                if body[self.at] != '"':
                    self.stuck = True
                    return False
                self.string = JsonScanner(self.at)
            end = self.string.scan(body)
            if end is None:
                return False
            value, self.string, self.at = _string(body[self.at:end]), None, end
            if piece == "the name":
                self.name = value
                self.stuck = value is None
            else:
                self.stuck = value != piece
        if not self.stuck:
            self.step += 1
        return not self.stuck


def _string(text: str) -> str | None:
    """A whole JSON string's text decoded, or None if it is not one."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


def streamable_call(body: str) -> tuple[str | None, str | None]:
    """``CallScan().streamable_call(body)``: what is certain of a call whose body so far is
    ``body``, read from its beginning (a stream keeps one ``CallScan`` per call instead)."""
    return CallScan().streamable_call(body)


def add_content(delta: DeltaMessage, text: str) -> None:
    """Append ``text`` to ``delta.content`` (None stays None for no text)."""
    if text:
        delta.content = (delta.content or "") + text


def parse_call(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON text) of one call's body, or None if it is not a call (not
    JSON, not a call's object, or nested deeper than ``MAX_DEPTH``)."""
    try:
        value = loads(body)
    except ValueError:
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

    def __init__(self, tokenizer=None) -> None:
        super().__init__(tokenizer)
        self.buffer = ""            # text received but not handled yet: a possible start of a tag
        self.in_call = False        # between <tool_call> and </tool_call>
        self.body = ""              # the current call's text after <tool_call>, as far as it is safe
        self.current_tool_id = -1   # index of the call being streamed (vLLM's name)
        self.current_tool_name_sent = False
        self.arguments_sent = 0     # characters of its arguments sent so far
        self.scan = CallScan()      # what is certain of the current call's body, read once
        self.blank: str | None = ""   # whitespace outside calls held back (None: other text came)
        self.blank_after = -1       # ... since the call of this index (-1: since the start)

    # ------------------------------------------------------------ whole message
    def extract_tool_calls(self, model_output: str, request=None) -> ExtractedToolCallInformation:
        gaps = [""]   # the text before, between and after the calls
        calls: list[ToolCall] = []
        at = 0
        while True:
            start = model_output.find(TOOL_CALL_START, at)
            if start < 0:
                gaps[-1] += model_output[at:]
                break
            gaps[-1] += model_output[at:start]
            body_start = start + len(TOOL_CALL_START)
            end = model_output.find(TOOL_CALL_END, body_start)
            closed = end >= 0
            end = end if closed else len(model_output)
            at = end + len(TOOL_CALL_END) if closed else end
            call = parse_call(model_output[body_start:end])
            if call is None:   # not a call after all: it stays text
                gaps[-1] += model_output[start:at]
            else:
                calls.append(ToolCall(FunctionCall(*call)))
                gaps.append("")
        text = "".join(gap for gap in gaps if not (calls and gap.isspace()))   # whitespace alone is not content
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
        if self.current_tool_id < 0 and self.blank:   # a message of whitespace only: that is its content
            add_content(delta, self.blank)
        self.blank = ""
        return None if delta.is_empty() else delta

    def add_content(self, delta: DeltaMessage, text: str) -> None:
        """Add ``text`` (outside every call) to ``delta``'s content; but whitespace alone
        between or around calls is not content (vLLM sends none after the first call; a
        client would show the newline between two calls as a message of its own). While the
        text since the last call is only whitespace it waits in ``self.blank``: a call drops
        it, other text takes it along::

            "Sure.<tool_call>..</tool_call>\\n<tool_call>..</tool_call>\\n"
             └sent┘                        └┘ dropped                 └┘ dropped
        """
        if self.blank_after != self.current_tool_id:   # a call went out since: a new gap
            self.blank, self.blank_after = "", self.current_tool_id
        if self.blank is not None:   # nothing but whitespace since the last call, so far
            if not text or text.isspace():
                self.blank += text
                return
            text, self.blank = self.blank + text, None
        add_content(delta, text)

    def parse_delta(self, delta_text: str, *, end_of_stream: bool = False) -> DeltaMessage:
        """One step of the state machine: what ``delta_text`` adds (``end_of_stream``: nothing
        more will come, so nothing may stay held back)::

            buffer += delta_text, then, until nothing more is certain:
              outside a call   "<tool_call>" in the buffer: the text before it is content
                               (self.add_content), enter the call (a fresh body and CallScan,
                               its name not sent, 0 argument characters sent); else send what
                               cannot begin the tag (split_held_back), keep the rest
              inside a call    "</tool_call>" in the buffer: the body ends before it, close
                               the call (parse_call: send what is left of it, or give the
                               whole tagged text back as content if it is not a call and
                               nothing of it was sent), go on outside with the rest; else
                               move what cannot begin the end tag into the body and send
                               what is certain of it (self.scan.streamable_call)
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
                    self.add_content(delta, safe)
                    return delta
                self.add_content(delta, self.buffer[:start])
                self.buffer = self.buffer[start + len(TOOL_CALL_START):]
                self.in_call, self.body, self.scan = True, "", CallScan()
                self.current_tool_name_sent, self.arguments_sent = False, 0
                continue
            end = self.buffer.find(TOOL_CALL_END)
            if end < 0 and not end_of_stream:
                safe, self.buffer = split_held_back(self.buffer, TOOL_CALL_END)
                self.body += safe
                self.send_call(delta, *self.scan.streamable_call(self.body))
                return delta
            closed = end >= 0
            self.body += self.buffer[:end] if closed else self.buffer
            self.buffer = self.buffer[end + len(TOOL_CALL_END):] if closed else ""
            call = parse_call(self.body)
            if call is not None:
                self.send_call(delta, *call)
            elif not self.current_tool_name_sent:   # not a call after all: it was text
                self.add_content(delta, TOOL_CALL_START + self.body + (TOOL_CALL_END if closed else ""))
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
