"""Streaming by reading on from where the last delta stopped: what every format parser here
but hermes is built on (hermes is the same idea, written out by hand: exercise 21).

A format parser writes one method, ``read(final)``: read ``self.text`` from ``self.at`` and
report, in order, only what can no longer change whatever the model writes next, moving
``self.at`` past what it has read for good; stop where it cannot decide yet (a tag half
written, a value still open) and wait for the next delta. ``final``: nothing more will come,
so everything is decided::

    text so far                          read(final=False) reports
    'Sure.<tool_ca'                      content 'Sure.'        ('<tool_ca' may become a tag)
    'Sure.<tool_call>\\n<function=f>'     a call named 'f'
    '... <parameter=a>\\n1\\n</parameter>'  arguments '{"a": 1'   (an integer parameter)
    '... </function>\\n</tool_call>'       arguments '}'

It reports with ``add_content(text)``, ``start_call(name)`` and ``add_arguments(text)``; each
delta sends what was reported since the last one. A whole message is the same reading, once,
with ``final=True``: so a stream, however it was cut, adds up to the whole-message parse.

Why keep a position (``self.at``) instead of parsing the whole text again at each delta (the
simplest way, and vLLM's for most formats)? Re-reading costs O(length so far) per delta, so
O(length²) per message: a model writing 20 KB of parameters in 4-character deltas made the
server re-read 50 MB, for seconds, on the event loop every other stream waits on. Here each
character is read once: the cost of a delta is the delta (a value still open keeps its scan's
place too: ``scanning.JsonScanner``).

Whitespace alone between or around calls is not content (vLLM sends no content after the
first call): ``add_content`` holds it while the text since the last call (or the start) is
only whitespace, drops it when a call starts, and sends it on with the next other text;
at the end it is dropped if the message had calls, else it is the content.
"""

from __future__ import annotations

import re
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
from microvllm.tool_parsers.streaming import partial_tag_length

WHITESPACE = " \t\n\r"


def skip_whitespace(text: str, at: int) -> int:
    while at < len(text) and text[at] in WHITESPACE:
        at += 1
    return at


def match_end(pattern: re.Pattern[str], text: str, at: int) -> int:
    """Where ``pattern`` (one that may match nothing, like ``[a-z]*``) stops matching from ``at``."""
    found = pattern.match(text, at)
    return found.end() if found else at


def may_become(text: str, at: int, marker: str) -> bool:
    """What the model wrote from ``at`` on could still grow into ``marker``: a proper
    beginning of it, or nothing yet (reads at most ``len(marker)`` characters)."""
    return len(text) - at < len(marker) and marker.startswith(text[at:])


class ReparsingToolParser(ToolParser):
    """A subclass writes ``read``; the whole-message and the streaming interface come from it."""

    def __init__(self, tokenizer=None) -> None:
        super().__init__(tokenizer)
        self.text = ""             # everything streamed so far
        self.at = 0                # where reading goes on: the text before it is read for good
        self.request = None        # the request of the last delta (its tools may type values)
        self.calls = 0             # calls started so far
        self._content: list[str] = []                # reported since the last delta went out
        self._pieces: list[DeltaToolCall] = []
        self._blank: list[str] | None = []           # whitespace held since the last call; None: other text came

    def read(self, final: bool) -> None:
        """Read ``self.text`` from ``self.at`` as far as it is certain (``final``: all of it):
        ``step`` after ``step``, each reading on in one phase, until one says to wait."""
        text = self.text
        while self.step(text, final):
            pass

    def step(self, text: str, final: bool) -> bool:
        """Read on in the current phase; False: wait for more text (or the end came). A parser
        writes this, or ``read`` itself when its format has no phases."""
        raise NotImplementedError

    def content_until(self, text: str, tag: str, final: bool) -> int | None:
        """Send the content from ``self.at`` up to the next ``tag`` and return where the tag
        begins; None when it has not come: then all is content but a possible start of it,
        held back (``final``: nothing is held)."""
        at = self.at
        start = text.find(tag, at)
        if start < 0:
            self.at = len(text) if final else len(text) - partial_tag_length(text, tag, at)
            self.add_content(text[at:self.at])
            return None
        self.add_content(text[at:start])
        return start

    def new_id(self) -> str:
        return random_tool_call_id()

    # ------------------------------------------------------------ what ``read`` reports
    def add_content(self, text: str) -> None:
        if not text:
            return
        if self._blank is not None:   # nothing but whitespace since the last call, so far
            if text.isspace():
                self._blank.append(text)
                return
            self._content.extend(self._blank)
            self._blank = None
        self._content.append(text)

    def start_call(self, name: str) -> None:
        self._blank = []   # whitespace alone before a call is not content
        self._pieces.append(DeltaToolCall(self.calls, DeltaFunctionCall(name=name), id=self.new_id(),
                                          type="function"))
        self.calls += 1

    def add_arguments(self, text: str) -> None:
        """More of the current call's arguments' JSON text."""
        if text:
            self._pieces.append(DeltaToolCall(self.calls - 1, DeltaFunctionCall(arguments=text)))

    # ------------------------------------------------------------ streaming
    def extract_tool_calls_streaming(self, previous_text: str, current_text: str, delta_text: str,
                                     previous_token_ids: Sequence[int] = (), current_token_ids: Sequence[int] = (),
                                     delta_token_ids: Sequence[int] = (), request=None) -> DeltaMessage | None:
        # The caller's current_text is the text so far (vLLM's interface): taking it costs
        # nothing, while appending to our own copy would copy it, O(length) per delta.
        consistent = len(current_text) == len(self.text) + len(delta_text) and current_text.endswith(delta_text)
        self.text = current_text if consistent else self.text + delta_text
        self.request = request if request is not None else self.request
        self.read(final=False)
        return self._send()

    def finish_streaming(self) -> DeltaMessage | None:
        self.read(final=True)
        if self._blank and not self.calls:   # a message of whitespace only: that is its content
            self._content.extend(self._blank)
        self._blank = []
        return self._send()

    def _send(self) -> DeltaMessage | None:
        """What was reported since the last delta, as one delta (argument pieces of one call
        in a row joined)."""
        delta = DeltaMessage(content="".join(self._content) or None)
        for piece in self._pieces:
            last = delta.tool_calls[-1] if delta.tool_calls else None
            if (last is not None and piece.function.name is None and last.index == piece.index
                    and last.function.arguments is not None):
                last.function.arguments += piece.function.arguments or ""
            else:
                delta.tool_calls.append(piece)
        self._content, self._pieces = [], []
        return None if delta.is_empty() else delta

    # ------------------------------------------------------------ whole message
    def extract_tool_calls(self, model_output: str, request=None) -> ExtractedToolCallInformation:
        """The stream's reading, once: a fresh parser given the whole text and its end."""
        parser = type(self)(self.model_tokenizer)
        parser.text, parser.request = model_output, request
        delta = parser.finish_streaming() or DeltaMessage()
        calls: list[ToolCall] = []
        for piece in delta.tool_calls:
            if piece.function.name is not None:
                calls.append(ToolCall(FunctionCall(piece.function.name, ""), id=piece.id or self.new_id()))
            else:
                calls[piece.index].function.arguments += piece.function.arguments or ""
        return ExtractedToolCallInformation(bool(calls), calls, delta.content)
