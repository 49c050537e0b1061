"""Mistral tool calls (vLLM: ``vllm/tool_parsers/mistral_tool_parser.py``,
``--tool-call-parser mistral``): content, then the ``[TOOL_CALLS]`` token and the calls, in
either of the forms Mistral's tokenizers have used::

    before v11 (Mistral 7B v0.3):  Sure.[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"name": "g"}]
    v11 and later (Mistral Small 3.1+, Devstral, Ministral 3), one token per call:
                                   Sure.[TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g[ARGS]{}
                                   Sure.[TOOL_CALLS]f[CALL_ID]a1b2c3d4e[ARGS]{"a": 1}
                                   Sure.[TOOL_CALLS]f{"a": 1}          (v11 without [ARGS])

After each ``[TOOL_CALLS]``: a JSON list of ``{"name", "arguments"}`` objects if a ``[``
comes first, else a name (letters, digits, ``_``, ``-``, ``.``), an optional ``[CALL_ID]``
(skipped: as vLLM does, the server makes its own ids), an optional ``[ARGS]`` and the
arguments' JSON object. Text between calls and after them is content. The first
``[TOOL_CALLS]`` whose calls do not parse makes the rest of the message content, marker and
all. All forms are read from the text, so the special tokens must be in it (vLLM's
``adjust_request`` sets ``skip_special_tokens=False`` for this; a v11+ ``MistralTokenizer``
lets vLLM stream from the token ids instead, which this parser does not need).

Mistral's chat templates accept only ids of 9 letters and digits (``MistralToolCall``), so
the calls get such ids. Streaming (``ReparsingToolParser``): content is sent as it comes,
less a possible start of ``[TOOL_CALLS]``; each call is sent whole (name, then arguments)
once its JSON closes (the list form: all of its calls when the list closes; a
``JsonScanner`` reads the JSON once as it grows, and it is decoded once, when whole); a call
still open when the stream ends is content, since its arguments are not known, and so is
JSON nested deeper than ``scanning.MAX_DEPTH``.
"""

from __future__ import annotations

import random
import re
import string

from microvllm.tool_parsers.reparse import ReparsingToolParser, match_end, may_become, skip_whitespace
from microvllm.tool_parsers.scanning import JsonScanner, dumps, loads

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
NAME = re.compile(r"[A-Za-z0-9_.-]*")   # a function's name (the v11+ form)


def read_list(text: str) -> list[tuple[str, str]] | None:
    """The calls of a whole JSON list's text, or None if it is not a list of calls."""
    try:
        value = loads(text)
    except ValueError:   # not JSON, or nested too deep to decode safely
        return None
    if not isinstance(value, list) or not value:
        return None
    calls = []
    for call in value:
        if not (isinstance(call, dict) and isinstance(call.get("name"), str)
                and isinstance(call.get("arguments", {}), dict)):
            return None
        calls.append((call["name"], dumps(call.get("arguments", {}))))
    return calls


class MistralToolParser(ReparsingToolParser):
    """vLLM's class for ``mistral``. After each ``[TOOL_CALLS]`` the reading goes through
    these phases (each keeps its place in the text between deltas)::

        outside ─[TOOL_CALLS]─> marker ─"["──> json (a list) ─────────────────────────> outside
                                  └─a name─> name ─> after_name ─[CALL_ID]─> id ─┐
                                                        └──────────────────────> args
        args ─([ARGS])─> object ─"{"─> json (the arguments) ─> outside
        anything else: text (the rest of the message, from the marker on, is content)
    """

    def __init__(self, tokenizer=None) -> None:
        super().__init__(tokenizer)
        self.phase = "outside"
        self.marker = 0        # where the last [TOOL_CALLS] began
        self.name_start = 0    # the v11+ form: where the call's name began
        self.name = ""
        self.scanner: JsonScanner | None = None   # the JSON being written, read so far

    def step(self, text: str, final: bool) -> bool:
        """Read on in the current phase; False: wait for more text (or the end came)."""
        at = self.at
        if self.phase == "text":
            self.add_content(text[at:])
            self.at = len(text)
            return False
        if self.phase == "outside":
            marker = self.content_until(text, TOOL_CALLS, final)
            if marker is None:
                return False
            self.marker, self.at, self.phase = marker, marker + len(TOOL_CALLS), "marker"
            return True
        if self.phase == "marker":
            self.at = at = skip_whitespace(text, at)
            if at < len(text):
                self.phase, self.name_start = "json" if text[at] == "[" else "name", at
                return True
        elif self.phase == "name":
            self.at = at = match_end(NAME, text, at)   # the name's characters, each read once
            if at < len(text):
                self.name = text[self.name_start:at]
                if self.name:
                    self.phase = "after_name"
                else:
                    self.to_text()
                return True
        elif self.phase == "after_name":
            if text.startswith(CALL_ID, at):
                self.at, self.phase = at + len(CALL_ID), "id"
                return True
            if not may_become(text, at, CALL_ID):
                self.phase = "args"
                return True
        elif self.phase == "id":   # skipped: the server makes its own ids
            while at < len(text) and text[at].isalnum():
                at += 1
            self.at = at
            if at < len(text):
                self.phase = "args"
                return True
        elif self.phase == "args":   # an optional [ARGS]
            if not (may_become(text, at, CALL_ID) or may_become(text, at, ARGS)):
                self.at = at + len(ARGS) if text.startswith(ARGS, at) else at
                self.phase = "object"
                return True
        elif self.phase == "object":   # the arguments' object must begin here
            if at < len(text):
                if text[at] == "{":
                    self.phase = "json"
                else:
                    self.to_text()
                return True
        else:   # "json": the list, or the object of arguments, being written
            self.scanner = self.scanner or JsonScanner(at)
            end = self.scanner.scan(text)
            if end is not None or self.scanner.too_deep:
                self.scanner = None
                calls = self.calls_in(text[at:end]) if end is not None else None
                if end is None or calls is None:
                    self.to_text()
                    return True
                for name, arguments in calls:
                    self.start_call(name)
                    self.add_arguments(arguments)
                self.at, self.phase = end, "outside"
                return True
        if final:   # the end came before the calls were whole: they are text
            self.to_text()
            return True
        return False   # the calls after the marker are still being written

    def calls_in(self, json_text: str) -> list[tuple[str, str]] | None:
        """The calls of the whole JSON after a marker (a list, or the v11+ form's arguments)."""
        if json_text.startswith("["):
            return read_list(json_text)
        try:
            arguments = loads(json_text)
        except ValueError:   # not JSON, or nested too deep to decode safely
            return None
        return [(self.name, dumps(arguments))]

    def to_text(self) -> None:
        """The marker's calls do not parse: the rest of the message, from the marker, is content."""
        self.at, self.phase = self.marker, "text"

    def new_id(self) -> str:
        """Nine letters and digits, the only ids Mistral's templates accept (vLLM:
        ``MistralToolCall.generate_random_id``)."""
        return "".join(random.choices(string.ascii_letters + string.digits, k=9))

