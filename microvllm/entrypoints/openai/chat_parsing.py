"""One chat choice's text, parsed as vLLM's chat endpoint parses it: the reasoning first
(``--reasoning-parser``), then tool calls in what follows it (``--enable-auto-tool-choice
--tool-call-parser``)::

    generated:  <think>Paris, then.</think><tool_call>{"name": "get_weather", ...}</tool_call>
                └─ reasoning parser ─────────┘└─ the content: the tool parser's input ────────┘
    message:    {"reasoning": "Paris, then.", "content": null, "tool_calls": [{...}]}

``ChoiceParser`` holds one choice's parsers (a streaming parser keeps state between deltas):
``whole(text)`` for ``stream=False``, ``delta(text, last=...)`` per streamed piece for
``stream=True`` (the last one also flushes what the parsers held back).

A tool parser reads text a prompt can steer, and must never raise on it (vLLM's catch
everything; ours are written not to). Should one raise all the same (a plugin's,
``--tool-parser-plugin``), the error is logged and the text is content: a whole message is
answered, and a stream goes on to its end and its ``[DONE]``, never cut off in the middle.
"""

from __future__ import annotations

import logging

from microvllm.tool_parsers.abstract_tool_parser import DeltaMessage, ToolCall

logger = logging.getLogger(__name__)


class ChoiceParser:
    """``reasoning_parser`` / ``tool_parser``: the classes the server was started with (or
    None); ``parse_tools``: this request asked for tool calls the model may make itself
    (``tool_choice="auto"`` with tools)."""

    def __init__(self, reasoning_parser: type | None, tool_parser: type | None, *, parse_tools: bool,
                 chat_template_kwargs: dict | None = None, tokenizer=None, request=None):
        self.reasoning = (reasoning_parser(tokenizer, chat_template_kwargs=chat_template_kwargs)
                          if reasoning_parser is not None else None)
        self.tools = tool_parser(tokenizer) if tool_parser is not None and parse_tools else None
        self.tools_called = False
        self.request = request   # the tools' schemas type some formats' values (qwen3_xml)
        self._text = ""   # the content so far, as the tool parser was given it

    # ------------------------------------------------------------ stream=False
    def whole(self, text: str) -> tuple[str | None, str | None, list[ToolCall]]:
        """(reasoning, content, tool calls) of a whole choice."""
        reasoning, content = None, text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.extract_reasoning(text)
        calls: list[ToolCall] = []
        if self.tools is not None and content:
            try:
                info = self.tools.extract_tool_calls(content, self.request)
                content, calls = info.content, info.tool_calls
            except Exception:   # noqa: BLE001 - a parser's bug must not cost the answer
                logger.exception("tool parser %s failed on the model's output: it is returned as content",
                                 type(self.tools).__name__)
        self.tools_called = bool(calls)
        return reasoning, content, calls

    # ------------------------------------------------------------ stream=True
    def delta(self, delta_text: str, *, last: bool = False) -> DeltaMessage:
        """What one streamed piece of text adds (maybe nothing yet: a tag is held back);
        ``last``: the stream ends with it, so whatever the parsers held back comes too."""
        out = DeltaMessage(content=delta_text or None)
        if self.reasoning is not None:
            pieces = [self.reasoning.extract_reasoning_streaming("", "", delta_text)]
            if last:
                pieces.append(self.reasoning.finish_streaming())
            out = DeltaMessage(reasoning="".join(p.reasoning or "" for p in pieces if p) or None,
                               content="".join(p.content or "" for p in pieces if p) or None)
        return self._tools_of(out, finishing=last)

    def _tools_of(self, out: DeltaMessage, *, finishing: bool) -> DeltaMessage:
        """Pass ``out``'s content through the tool parser (reasoning is never parsed for calls)."""
        if self.tools is None:
            return out
        content, out.content = out.content or "", None
        parts = []
        try:
            if content:
                current = self._text + content
                parts.append(self.tools.extract_tool_calls_streaming(self._text, current, content,
                                                                      request=self.request))
                self._text = current
            if finishing:
                parts.append(self.tools.finish_streaming())
        except Exception:   # noqa: BLE001 - a parser's bug must not cut the stream off
            logger.exception("tool parser %s failed on the model's output: the rest of the choice is content",
                             type(self.tools).__name__)
            self.tools = None   # what it held back is lost; from here on the text goes out as it comes
            out.content = content or None
            return out
        for part in filter(None, parts):
            if part.content:
                out.content = (out.content or "") + part.content
            out.tool_calls += part.tool_calls
        self.tools_called = self.tools_called or bool(out.tool_calls)
        return out


def tool_call_dict(call: ToolCall) -> dict:
    """A ``ToolCall`` as the OpenAI API writes it in a message."""
    return {"id": call.id, "type": call.type, "function": {"name": call.function.name,
                                                           "arguments": call.function.arguments}}


def delta_dict(delta: DeltaMessage) -> dict:
    """A streamed ``DeltaMessage`` as a chunk's ``delta`` (only the fields it has)."""
    out: dict = {}
    if delta.reasoning:
        out["reasoning"] = delta.reasoning
    if delta.content:
        out["content"] = delta.content
    if delta.tool_calls:
        out["tool_calls"] = []
        for call in delta.tool_calls:
            function = {key: value for key, value in (("name", call.function.name),
                                                      ("arguments", call.function.arguments)) if value is not None}
            entry = {"index": call.index, "function": function}
            if call.id is not None:
                entry.update(id=call.id, type=call.type or "function")
            out["tool_calls"].append(entry)
    return out
