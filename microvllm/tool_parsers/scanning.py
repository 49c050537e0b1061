"""Reading JSON that a model wrote, as hostile input: never recursing on its nesting, and
reading a growing text once (vLLM's parsers call ``json.loads`` and catch what it raises).

Two dangers, and what this module does about each:

    danger                                      here
    1,000 nested [ make Python's json recurse   ``JsonScanner`` counts depth with one integer;
    out of stack (RecursionError), and a        ``loads`` refuses more than ``MAX_DEPTH`` levels
    5,000-digit number raises ValueError        before json sees the text; every refusal is a
                                                ValueError, which a parser turns into content
    a value being written is re-read at each    ``JsonScanner`` keeps its place (``at``) and its
    delta: O(length) per delta, O(length²)      state (depth, inside a string, after a backslash)
    for the whole value                         between deltas: each character is read once

A scan knows where a value that starts with ``{``, ``[`` or ``"`` ends without decoding it::

    text so far                         at   depth  in a string   end
    {"a": [1, "]"                       13     2    no            None   (the "]" was in a string)
    {"a": [1, "]"]}                     15     0    no            15     (decode text[0:15] once)
"""

from __future__ import annotations

import json
import re
from typing import Any

MAX_DEPTH = 100   # deeper than any tool's arguments; Python's json recurses out near 1,000
_JSON_SIGNIFICANT = re.compile(r'[\[\]{}"\\]')   # all that can change a JSON scan's state


class TooDeep(ValueError):
    """The text nests deeper than ``MAX_DEPTH``: not something to decode."""


class JsonScanner:
    """Where the JSON object, array or string starting at ``start`` of a growing text ends.
    ``scan(text)`` reads what was added since the last call (``text`` only grows) and
    returns the end once it is known. A bracket inside a string is not counted; a value
    more than ``MAX_DEPTH`` deep stops the scan (``too_deep``). Valid JSON ends where the
    scan says; for text that is not JSON the scan still ends somewhere (or never), and the
    decode that follows decides."""

    def __init__(self, start: int):
        self.at = start            # the next character to read: everything before it is read
        self.depth = 0             # brackets open
        self.in_string = False
        self.escaped = False       # the last character read was a backslash inside a string
        self.end: int | None = None
        self.too_deep = False

    def scan(self, text: str) -> int | None:
        while self.end is None and not self.too_deep:
            if self.escaped:   # the character after a backslash is never special
                if self.at == len(text):
                    break
                self.at, self.escaped = self.at + 1, False
                continue
            found = _JSON_SIGNIFICANT.search(text, self.at)   # skips plain characters in C
            if found is None:
                self.at = len(text)
                break
            character, self.at = found.group(), found.end()
            if self.in_string:
                if character == "\\":
                    self.escaped = True
                elif character == '"':
                    self.in_string = False
                    if self.depth == 0:   # the value was this string
                        self.end = self.at
            elif character == '"':
                self.in_string = True
            elif character in "[{":
                self.depth += 1
                self.too_deep = self.depth > MAX_DEPTH
            elif character in "]}":
                self.depth -= 1
                if self.depth <= 0:
                    self.end = self.at
        return self.end


def nesting_depth(text: str, start: int = 0, end: int | None = None) -> int:
    """The deepest nesting of ``[`` and ``{`` in ``text[start:end]`` (outside strings), counted
    without recursion; it stops counting past ``MAX_DEPTH``."""
    end = len(text) if end is None else end
    depth = deepest = 0
    in_string = escaped = False
    at = start
    while at < end:
        if escaped:
            at, escaped = at + 1, False
            continue
        found = _JSON_SIGNIFICANT.search(text, at, end)
        if found is None:
            break
        character, at = found.group(), found.end()
        if in_string:
            escaped = character == "\\"
            in_string = character != '"'
        elif character == '"':
            in_string = True
        elif character in "[{":
            depth += 1
            deepest = max(deepest, depth)
            if deepest > MAX_DEPTH:
                break
        elif character in "]}":
            depth -= 1
    return deepest


def loads(text: str) -> Any:
    """``json.loads`` for text a model wrote: ValueError (``json.JSONDecodeError`` or
    ``TooDeep``) for anything that is not a JSON value it can safely hold, never
    RecursionError (the depth is checked first) nor the int-size ValueError's cousins."""
    if nesting_depth(text) > MAX_DEPTH:
        raise TooDeep(f"nested more than {MAX_DEPTH} levels deep")
    try:
        return json.loads(text)
    except RecursionError as error:   # not reachable under MAX_DEPTH; kept as the last guard
        raise TooDeep(str(error)) from None
    # json.loads raises ValueError itself for a number of more than 4,300 digits


def dumps(value: Any) -> str:
    """A value as JSON text for a response: non-ASCII as itself, unless the value holds a lone
    surrogate (``"\\ud800"`` decodes to one), which UTF-8 cannot carry: then everything
    non-ASCII is escaped, still the same JSON value."""
    text = json.dumps(value, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(value)
    return text
