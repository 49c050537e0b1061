"""Llama 3 JSON tool calls (vLLM: ``vllm/tool_parsers/llama_tool_parser.py``,
``--tool-call-parser llama3_json``), the format of vLLM's Llama 3.1/3.2 JSON chat templates:
the whole message is the calls, each a JSON object, several separated by ``;``, maybe
after the ``<|python_tag|>`` token::

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "f", "parameters": {}}
    └─ dropped ──┘└─ call 0 ────────────────────────────────────────────┘  └─ call 1 ─────────────────┘

The message holds calls if it begins (after whitespace) with ``<|python_tag|>`` or ``{``;
otherwise all of it is content. Calls are read one after another; a call is an object with
a string ``name`` and an object ``parameters`` (or ``arguments``), whose JSON is the call's
arguments. The first thing that is not a call (a malformed object, text after the calls)
is content from there to the end; if the first one is not a call, the whole message is
content. (vLLM's whole-message parse looks for objects anywhere in the text and drops the
text around them; its stream reads calls only from the start, as this one does.)

Streaming (``ReparsingToolParser``): a call is sent whole, name then arguments, the moment
its object closes (a ``JsonScanner`` reads the object once as it grows, so nothing is decoded
before it is whole, and only once); text at the start waits until it is clear whether calls
begin; an object still open when the stream ends is text, since its arguments are not known;
so is one nested deeper than ``scanning.MAX_DEPTH`` or not JSON at all.
"""

from __future__ import annotations

from microvllm.tool_parsers.reparse import ReparsingToolParser, may_become, skip_whitespace
from microvllm.tool_parsers.scanning import JsonScanner, dumps, loads

PYTHON_TAG = "<|python_tag|>"


def read_call(text: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of one whole call object's text, or None if it is not a call."""
    try:
        value = loads(text)
    except ValueError:   # not JSON, or nested too deep to decode safely
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("parameters", value.get("arguments"))
    return (value["name"], dumps(arguments)) if isinstance(arguments, dict) else None


class Llama3JsonToolParser(ReparsingToolParser):
    """vLLM's class for ``llama3_json`` (and ``llama4_json``)."""

    def __init__(self, tokenizer=None) -> None:
        super().__init__(tokenizer)
        self.phase = "start"   # start: may calls begin?  call: an object next  after: ";" next  text: content
        self.scanner: JsonScanner | None = None   # the call object being written, read so far

    def read(self, final: bool) -> None:
        text = self.text
        while True:
            if self.phase == "text":
                self.add_content(text[self.at:])
                self.at = len(text)
                return
            self.at = skip_whitespace(text, self.at)   # whitespace is never read twice either
            at = self.at
            if self.phase == "start":
                if text.startswith(PYTHON_TAG, at):
                    self.at, self.phase = at + len(PYTHON_TAG), "call"
                elif text.startswith("{", at):
                    self.phase = "call"
                elif not final and may_become(text, at, PYTHON_TAG):
                    return   # calls may still begin: hold the text back
                else:
                    self.to_text(at)
            elif at == len(text):
                if final and not self.calls:   # a tag and no call: the message is text
                    self.to_text(0)
                    continue
                return   # nothing more yet (final: the calls end here)
            elif self.phase == "after":
                if text[at] == ";":
                    self.at, self.phase = at + 1, "call"
                else:
                    self.to_text(at)
            elif self.scanner is None and text[at] != "{":
                self.to_text(at)
            else:
                self.scanner = self.scanner or JsonScanner(at)
                end = self.scanner.scan(text)
                if end is None and not self.scanner.too_deep and not final:
                    return   # an object still being written
                self.scanner = None
                call = read_call(text[at:end]) if end is not None else None
                if end is None or call is None:   # not a call (or nested too deep): text from here on
                    self.to_text(at)
                    continue
                self.start_call(call[0])
                self.add_arguments(call[1])
                self.at, self.phase = end, "after"

    def to_text(self, at: int) -> None:
        """The rest of the message is content: from ``at``, or all of it if no call came before."""
        self.at, self.phase = (at if self.calls else 0), "text"
