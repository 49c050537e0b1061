"""Streaming by re-reading: the simplest way to make a stream agree with the whole message.

A format parser writes one function, ``parse(text, final)``, that reads the text so far and
returns only what can no longer change, whatever the model writes next:

    text so far                          parse(text, final=False)
    'Sure.<tool_ca'                      content 'Sure.'   ('<tool_ca' may become a tag)
    'Sure.<tool_call>\\n<function=f>'     content 'Sure.', calls [('f', '')]
    '... <parameter=a>\\n1\\n</parameter>'  calls [('f', '{"a": 1')]
    '... </function>\\n</tool_call>'       calls [('f', '{"a": 1}')]   (final=True: the same)

Each delta, ``ReparsingToolParser`` parses the whole text again and sends the difference
from what it sent before: the new end of the content, a call's name (with its ``id``) when a
new call appears, the new end of each call's arguments. ``finish_streaming`` parses with
``final=True`` (nothing more will come: an unfinished marker is text, an unfinished call is
decided) and sends the rest. So a stream, however it was cut, adds up to
``parse(whole, final=True)``, the whole-message parse, as long as ``parse`` keeps its promise:
each answer extends the previous one (the content, the calls, each call's arguments).

Cost: the whole text is read again per delta, O(length) each: fine for messages of a few
thousand tokens; vLLM's parsers keep more state between deltas to avoid it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

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

WHITESPACE = " \t\n\r"


@dataclass
class Parsed:
    """What ``parse`` found: the text outside every call, and the calls as (name, their
    arguments' JSON text: all of it once the call is finished, a beginning of it before)."""

    content: str = ""
    calls: list[tuple[str, str]] = field(default_factory=list)


def skip_whitespace(text: str, at: int) -> int:
    while at < len(text) and text[at] in WHITESPACE:
        at += 1
    return at


def may_become(text: str, marker: str) -> bool:
    """``text`` (what the model has written so far at some point) could still grow into
    ``marker``: a proper beginning of it, or nothing yet."""
    return len(text) < len(marker) and marker.startswith(text)


class ReparsingToolParser(ToolParser):
    """A subclass writes ``parse``; the whole-message and the streaming interface come from it."""

    def __init__(self, tokenizer=None) -> None:
        super().__init__(tokenizer)
        self.text = ""             # everything streamed so far
        self.content_sent = 0      # characters of the content sent
        self.ids: list[str] = []   # one per call sent (its index is its place here)
        self.arguments_sent: list[int] = []   # characters of each call's arguments sent
        self.request = None        # the request of the last delta (its tools may type values)

    def parse(self, text: str, final: bool, request=None) -> Parsed:
        """What is certain of ``text`` (``final``: the whole message). ``request``: the
        ``ChatCompletionRequest`` (its ``tools``), or None."""
        raise NotImplementedError

    def new_id(self) -> str:
        return random_tool_call_id()

    # ------------------------------------------------------------ whole message
    def extract_tool_calls(self, model_output: str, request=None) -> ExtractedToolCallInformation:
        parsed = self.parse(model_output, True, request)
        calls = [ToolCall(FunctionCall(name, arguments), id=self.new_id()) for name, arguments in parsed.calls]
        return ExtractedToolCallInformation(bool(calls), calls, parsed.content or None)

    # ------------------------------------------------------------ streaming
    def extract_tool_calls_streaming(self, previous_text: str, current_text: str, delta_text: str,
                                     previous_token_ids: Sequence[int] = (), current_token_ids: Sequence[int] = (),
                                     delta_token_ids: Sequence[int] = (), request=None) -> DeltaMessage | None:
        self.text += delta_text
        self.request = request if request is not None else self.request
        return self._send(self.parse(self.text, False, self.request))

    def finish_streaming(self) -> DeltaMessage | None:
        return self._send(self.parse(self.text, True, self.request))

    def _send(self, parsed: Parsed) -> DeltaMessage | None:
        """The difference between ``parsed`` and what was sent before."""
        delta = DeltaMessage()
        if len(parsed.content) > self.content_sent:
            delta.content = parsed.content[self.content_sent:]
            self.content_sent = len(parsed.content)
        for index, (name, arguments) in enumerate(parsed.calls):
            if index == len(self.ids):   # a new call: its name and id first, once
                self.ids.append(self.new_id())
                self.arguments_sent.append(0)
                delta.tool_calls.append(DeltaToolCall(index, DeltaFunctionCall(name=name), id=self.ids[index],
                                                      type="function"))
            if len(arguments) > self.arguments_sent[index]:
                delta.tool_calls.append(DeltaToolCall(index, DeltaFunctionCall(
                    arguments=arguments[self.arguments_sent[index]:])))
                self.arguments_sent[index] = len(arguments)
        return None if delta.is_empty() else delta
