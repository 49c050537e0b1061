"""Tool calls the output was constrained to: ``tool_choice="required"`` or a named function
(vLLM: ``extract_required_tool_call_streaming`` and ``extract_named_tool_call_streaming`` for a
stream, ``DelegatingParser._extract_tool_calls`` for a whole message).

The grammar (``ChatCompletionRequest.tool_call_schema``) makes the model write JSON; this reads
it back as tool calls, whole or while it grows::

    tool_choice="required": a JSON array of calls
        [{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", ...
           name complete ───────┘              └ call 0's arguments ┘
        stream:  {index: 0, id, type: "function", name: "get_weather", arguments: '{"ci'}
                                          (once its name is whole and its parameters started)
                 {index: 0, arguments: 'ty": "Paris"}'}        (each piece of the parameters)
                 {index: 1, id, type: "function", name: "get_time", arguments: ...}

    a named function, tool_choice={"type": "function", "function": {"name": "get_weather"}}:
    the parameters object alone
        {"city": "Paris"}
        stream:  {index: 0, id, type: "function", name: "get_weather", arguments: '{"ci'}
                 {index: 0, arguments: 'ty": "Paris"}'}         (each piece as it comes)

A call's ``arguments`` are its parameters' text exactly as the model wrote it, so a stream's
pieces concatenate to the whole message's ``arguments``. Cut short by ``max_tokens`` (vLLM's
rules): a stream has already sent each call as far as it got and ends with
``finish_reason="length"``; a whole message then has no call for ``"required"`` (its array
is not JSON) and, for a named function, the call with the arguments written so far.

``RequiredToolCallScanner`` reads the array in one pass: each character is looked at once
however the text is cut into deltas (its state, the bracket depth, whether it is inside a
string, which key it is reading, stays between deltas), nothing is parsed twice, and nothing
recurses, so a thousand nested brackets cost one counter.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from microvllm.tool_parsers.abstract_tool_parser import DeltaFunctionCall, DeltaToolCall, random_tool_call_id

# What a call's object expects next (the scanner at depth 2, inside {"name": ..., "parameters": ...}).
_KEY, _COLON, _VALUE, _AFTER_VALUE = range(4)
_PLAIN_STRING_RUN = re.compile(r'[^"\\]+')   # a string's characters up to its next quote or escape


@dataclass
class _Call:
    """One element of the array, as far as the scanner has read it."""

    index: int
    name: str | None = None                               # set once its string is closed and decodes
    name_text: list[str] = field(default_factory=list)    # the name's JSON text while it is read
    arguments_started: bool = False                       # the parameters' value has begun
    pending: list[str] = field(default_factory=list)      # parameters' text not sent yet
    announced: bool = False                               # its id and name went out

    def flush(self, out: list[DeltaToolCall]) -> None:
        """Send what is new: the first time (the name is whole and the parameters have begun)
        the id, the name and the arguments so far; later only the new arguments' text."""
        if not self.announced:
            if self.name is None or not self.arguments_started:
                return   # vLLM's rule too: a call is announced with its name and parameters begun
            self.announced = True
            out.append(DeltaToolCall(index=self.index, id=random_tool_call_id(), type="function",
                                     function=DeltaFunctionCall(name=self.name, arguments="".join(self.pending))))
        elif self.pending:
            out.append(DeltaToolCall(index=self.index, function=DeltaFunctionCall(arguments="".join(self.pending))))
        self.pending.clear()


class RequiredToolCallScanner:
    """Reads a ``tool_choice="required"`` array of ``{"name", "parameters"}`` objects as it
    grows: ``feed(text)`` returns the tool-call pieces that text adds, at most one per call.
    Work is proportional to ``text``; the text itself is not kept (only the name being read
    and the parameters' text not yet sent).

    Depth:  0 before the array, 1 in it, 2 in a call's object, 3 and more inside a value.
    """

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.done = False             # the array closed, or the text is not an array of objects
        self.calls: list[_Call] = []
        self.current: _Call | None = None
        self.expect = _KEY
        self.key: str | None = None   # the member being read
        self.key_text: list[str] = []
        self.value: str | None = None   # the member's value being read: "string", "container", "scalar"
        self._out: list[DeltaToolCall] = []

    def feed(self, text: str) -> list[DeltaToolCall]:
        out: list[DeltaToolCall] = []
        self._out = out
        i, end = 0, len(text)
        while i < end and not self.done:
            ch = text[i]
            if not self.in_string:
                self._structural(ch)
                i += 1
            elif self.escaped or ch == "\\":
                self.escaped = not self.escaped
                self._put(ch)
                i += 1
            elif ch == '"':
                self._put(ch)
                self.in_string = False
                self._string_closed()
                i += 1
            else:   # a run of plain characters inside a string, taken at once
                run = _PLAIN_STRING_RUN.match(text, i)
                assert run is not None
                self._put(run.group())
                i = run.end()
        if self.current is not None:
            self.current.flush(out)
        return out

    # -------------------------------------------------------------- the states
    def _sink(self) -> list[str] | None:
        """Where the character being read belongs: the parameters' text, the name's, a key's."""
        call = self.current
        if call is None:
            return None
        if self.value is not None:
            return call.pending if self.key == "parameters" else call.name_text if self.key == "name" else None
        if self.in_string and self.depth == 2 and self.expect == _KEY:
            return self.key_text
        return None

    def _put(self, text: str) -> None:
        sink = self._sink()
        if sink is not None:
            sink.append(text)

    def _structural(self, ch: str) -> None:
        """One character outside every string."""
        if self.value == "scalar" and (ch in ",]}" or ch.isspace()):
            self._end_value()   # a number, true, false or null ends before this character
        if ch == '"':
            if self.depth == 2 and self.current is not None:
                if self.expect == _VALUE:
                    self._start_value("string")
                elif self.expect == _KEY:
                    self.key_text = []
            self.in_string = True
            self._put(ch)
        elif ch in "[{":
            if (self.depth == 0 and ch != "[") or (self.depth == 1 and ch != "{"):
                self.done = True   # not an array of objects: no calls (the grammar allows none of this)
                return
            if self.depth == 1:
                self.current = _Call(index=len(self.calls))
                self.calls.append(self.current)
                self.expect, self.key = _KEY, None
            elif self.depth == 2 and self.expect == _VALUE:
                self._start_value("container")
            self._put(ch)
            self.depth += 1
        elif ch in "]}":
            self._put(ch)
            self.depth -= 1
            if self.depth == 2 and self.value == "container":
                self._end_value()
            elif self.depth == 1 and self.current is not None:   # a call's object closed
                self.current.flush(self._out)
                self.current = None
            elif self.depth <= 0:
                self.done = True   # the array closed
        elif self.value is not None:
            self._put(ch)   # inside a container value, or a scalar
        elif self.depth == 2 and self.current is not None:
            if ch == ":" and self.expect == _COLON:
                self.expect = _VALUE
            elif ch == ",":
                self.expect, self.key = _KEY, None
            elif self.expect == _VALUE and not ch.isspace():
                self._start_value("scalar")
                self._put(ch)
        elif self.depth <= 1 and not ch.isspace() and ch != ",":
            self.done = True   # text outside the array, or an element that is not an object

    def _string_closed(self) -> None:
        if self.depth != 2 or self.current is None:
            return
        if self.expect == _KEY:
            try:
                self.key = json.loads("".join(self.key_text))
            except ValueError:
                self.key = None
            self.expect = _COLON
        elif self.value == "string":
            self._end_value()

    def _start_value(self, kind: str) -> None:
        self.value = kind
        if self.key == "parameters" and self.current is not None:
            self.current.arguments_started = True

    def _end_value(self) -> None:
        call = self.current
        if self.key == "name" and call is not None and call.name is None:
            try:
                name = json.loads("".join(call.name_text))
            except ValueError:
                name = None
            call.name = name if isinstance(name, str) else None
        self.value, self.expect = None, _AFTER_VALUE


class NamedToolCallStream:
    """A named function's call: the output is its parameters, so each piece of text is a
    piece of the arguments; the first piece also carries the call's id and the name."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.announced = False

    def feed(self, text: str) -> list[DeltaToolCall]:
        if not text:
            return []
        if self.announced:
            return [DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=text))]
        self.announced = True
        return [DeltaToolCall(index=0, id=random_tool_call_id(), type="function",
                              function=DeltaFunctionCall(name=self.name, arguments=text))]


class ForcedToolCallStream:
    """One streamed choice's forced calls (``tool_choice`` required or named)."""

    def __init__(self, function_name: str | None) -> None:
        self.named = function_name is not None
        self.reader = NamedToolCallStream(function_name) if function_name is not None else RequiredToolCallScanner()
        self.called = False   # a call's name went out

    def feed(self, text: str) -> list[DeltaToolCall]:
        pieces = self.reader.feed(text)
        self.called = self.called or any(piece.id is not None for piece in pieces)
        return pieces

    def finish_reason(self, finish_reason: str | None) -> str | None:
        """OpenAI's (and vLLM's): "tool_calls" when required calls ended normally; a named
        function's call ends with "stop"; a call cut by max_tokens with "length"."""
        if finish_reason == "stop" and self.called and not self.named:
            return "tool_calls"
        return finish_reason


def forced_tool_calls(function_name: str | None, text: str) -> list[dict]:
    """A whole choice's calls, as the API writes them in a message.

    Named: one call whose arguments are the text (none if there is only whitespace).
    Required: the array's calls; none if the text is not a complete array of
    ``{"name": ..., "parameters": ...}`` objects (cut by max_tokens), as in vLLM."""
    if function_name is not None:
        pieces = NamedToolCallStream(function_name).feed(text) if text.strip() else []
    else:
        try:
            value = json.loads(text)
        except (ValueError, RecursionError):   # cut short; or nested past Python's recursion limit
            return []
        if not (isinstance(value, list) and all(isinstance(call, dict) and isinstance(call.get("name"), str)
                                                and "parameters" in call for call in value)):
            return []
        pieces = RequiredToolCallScanner().feed(text)   # one piece per call: the whole of it
    return [{"id": piece.id, "type": "function",
             "function": {"name": piece.function.name, "arguments": piece.function.arguments}} for piece in pieces]
