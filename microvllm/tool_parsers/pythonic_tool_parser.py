"""Pythonic tool calls (vLLM: ``vllm/tool_parsers/pythonic_tool_parser.py``,
``--tool-call-parser pythonic``), the format of Llama 3.2's and ToolACE's templates: the
message is a Python list of calls with keyword arguments, whose values are Python literals::

    [get_weather(city="Paris", days=[1, 2]), get_time(tz='CET', dst=True)]
     └─ call 0: {"city": "Paris", "days": [1, 2]} ┘└─ call 1: {"tz": "CET", "dst": true} ┘

The message holds calls if it begins (after whitespace) with ``[``; otherwise all of it is
content. The calls are read one after another: ``name(key=literal, ...)`` (a plain name;
keywords only; each value something ``ast.literal_eval`` reads: strings, numbers,
``True``/``False``/``None``, lists, tuples, dicts), its arguments turned into a JSON object
(``True`` -> ``true``, ``None`` -> ``null``, tuples -> lists). The first thing that is not a
call is content from there on (if it is the first, the whole message is), and so is text
after the closing ``]``. (vLLM's whole-message parse takes the message only if all of it is
one such list.)

Streaming (``ReparsingToolParser``): the arguments are not JSON as written, so a call is
sent once its closing ``)`` is written: its name, then its JSON arguments whole. A
``PythonScanner`` finds that ``)`` reading each character once (a ``)`` inside a string or a
comment, or closing a nested bracket, is not it), and the call is parsed once, when whole. A
call still open when the stream ends is content; the calls before it stand (a list left open
after a whole call is simply the calls so far; a message with no call at all is content).
"""

from __future__ import annotations

import ast
import re

from microvllm.tool_parsers.reparse import ReparsingToolParser, skip_whitespace
from microvllm.tool_parsers.scanning import MAX_DEPTH, dumps

_PYTHON_SIGNIFICANT = re.compile(r"""[()\[\]{}'"#\\]""")


class PythonScanner:
    """Where the bracket that opens at ``start`` of a growing text closes, as Python reads it:
    brackets inside strings (``'...'``, ``"..."``, triple-quoted, with backslash escapes) and
    comments do not count. ``scan(text, final)`` reads what was added since the last call
    (each character once) and returns the end once known; more than ``MAX_DEPTH`` brackets
    deep stops it (``too_deep``)."""

    def __init__(self, start: int):
        self.at = start          # the next character to read
        self.depth = 0
        self.quote = ""          # the open string's quote: ', ", \'\'\' or \"\"\" ("" outside a string)
        self.escaped = False     # the last character read was a backslash inside a string
        self.in_comment = False
        self.end: int | None = None
        self.too_deep = False

    def scan(self, text: str, final: bool) -> int | None:
        while self.end is None and not self.too_deep and self.at < len(text):
            if self.escaped:
                self.at, self.escaped = self.at + 1, False
                continue
            if self.in_comment:   # to the end of the line
                newline = text.find("\n", self.at)
                self.at, self.in_comment = (len(text), True) if newline < 0 else (newline + 1, False)
                continue
            found = _PYTHON_SIGNIFICANT.search(text, self.at)
            if found is None:
                self.at = len(text)
                break
            at, character = found.start(), found.group()
            if character in "'\"" and not final and len(text) - at < 3 and (character * 3).startswith(text[at:]):
                self.at = at   # a quote at the very end: one, or the start of three? the next delta says
                break
            self.at = at + 1
            if self.quote:
                if character == "\\":
                    self.escaped = True
                elif text.startswith(self.quote, at):
                    self.at, self.quote = at + len(self.quote), ""
            elif character in "'\"":
                self.quote = character * 3 if text.startswith(character * 3, at) else character
                self.at = at + len(self.quote)
            elif character == "#":
                self.in_comment = True
            elif character in "([{":
                self.depth += 1
                self.too_deep = self.depth > MAX_DEPTH
            elif character in ")]}":
                self.depth -= 1
                if self.depth <= 0:
                    self.end = self.at
        return self.end


def parse_call(text: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of one whole call's text, ``name(key=literal, ...)``, or None if
    it is not such a call."""
    try:
        expression = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    if not (isinstance(expression, ast.Call) and isinstance(expression.func, ast.Name)) or expression.args:
        return None
    arguments = {}
    for keyword in expression.keywords:
        if keyword.arg is None:   # **kwargs
            return None
        try:
            arguments[keyword.arg] = ast.literal_eval(keyword.value)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return None
    try:
        return expression.func.id, dumps(arguments)
    except (TypeError, ValueError, RecursionError):   # a set, bytes, a complex number: not JSON
        return None


class PythonicToolParser(ReparsingToolParser):
    """vLLM's class for ``pythonic``. The phases of the reading (each keeps its place in the
    text between deltas)::

        start ─"["─> first ─> call ─name(...)─> after_call ─","─> after_comma ─> call ...
                                                    └─"]"─> text (content from there on)
        anything else: text (from there on; all of the message if no call came before)
    """

    def __init__(self, tokenizer=None) -> None:
        super().__init__(tokenizer)
        self.phase = "start"
        self.call_start = 0    # where the call being read began
        self.scanner: PythonScanner | None = None   # its arguments, once its "(" is written

    def read(self, final: bool) -> None:
        text = self.text
        while self.step(text, final):
            pass   # each step reads on in one phase, or says to wait

    def step(self, text: str, final: bool) -> bool:
        """Read on in the current phase; False: wait for more text (or the end came)."""
        if self.phase == "text":
            self.add_content(text[self.at:])
            self.at = len(text)
            return False
        if self.phase == "call":
            return self.read_call(text, final)
        self.at = at = skip_whitespace(text, self.at)   # around the list's items: never content
        if at == len(text):
            if final and not self.calls:   # no call at all: the message is text
                self.to_text(0)
                return True
            return False   # nothing more yet (final: the list was left open after its calls)
        if self.phase == "start":
            self.at, self.phase = (at + 1, "first") if text[at] == "[" else (0, "text")
        elif self.phase == "after_call" and text[at] in "],":
            self.at, self.phase = at + 1, ("text" if text[at] == "]" else "after_comma")
        elif self.phase == "after_call":
            self.to_text(at)
        elif self.phase == "after_comma" and text[at] == "]":   # a comma after the last call
            self.at, self.phase = at + 1, "text"
        else:   # first, after_comma: a call begins here
            self.call_start, self.phase = at, "call"
        return True

    def read_call(self, text: str, final: bool) -> bool:
        scanner = self.scanner
        if scanner is None:   # the name, up to its "("
            while self.at < len(text) and (text[self.at].isalnum() or text[self.at] == "_"):
                self.at += 1
            if self.at == len(text):
                return self.wait_or_text(final)
            if not text[self.call_start:self.at].isidentifier() or text[self.at] != "(":
                self.to_text(self.call_start)   # decided at once: "[1, 2]" or "[see below]" is text
                return True
            scanner = self.scanner = PythonScanner(self.at)
        end = scanner.scan(text, final)
        if end is None and not scanner.too_deep:
            return self.wait_or_text(final)   # no ")" closes it yet
        self.scanner = None
        call = parse_call(text[self.call_start:end]) if end is not None else None
        if end is None or call is None:   # not a call (or nested too deep): text from here on
            self.to_text(self.call_start)
            return True
        self.start_call(call[0])
        self.add_arguments(call[1])
        self.at, self.phase = end, "after_call"
        return True

    def wait_or_text(self, final: bool) -> bool:
        """A call still being written: wait for more text; at the end it is text."""
        if final:
            self.to_text(self.call_start)
        return final

    def to_text(self, at: int) -> None:
        """The rest of the message is content: from ``at``, or all of it if no call came before."""
        self.at, self.phase = (at if self.calls else 0), "text"
