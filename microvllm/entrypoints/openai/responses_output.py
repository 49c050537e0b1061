"""A response's output items, whole or as a stream of events (vLLM:
``entrypoints/openai/responses/utils.py`` ``build_response_output_items`` and
``responses/simple_streaming_events.py``).

One chat turn, parsed by ``ChoiceParser`` into reasoning, text and tool calls, becomes a
list of output items, each with an id of its own::

    <think>Paris.</think>I will look.<tool_call>{"name": "f", ...}</tool_call>
    output[0] {"type": "reasoning", "id": "rs_…", "content": [{"type": "reasoning_text", "text": "Paris."}]}
    output[1] {"type": "message", "id": "msg_…", "role": "assistant",
               "content": [{"type": "output_text", "text": "I will look.", "annotations": []}]}
    output[2] {"type": "function_call", "id": "fc_…", "call_id": "…", "name": "f", "arguments": "{…}"}

Streamed (``ResponseStream``), every item opens, grows and closes before the next opens;
every event carries ``sequence_number`` (0, 1, 2, … across the stream)::

    response.created, response.in_progress                       (the response, no output yet)
    response.output_item.added          output_index=0           (a reasoning item)
      response.content_part.added       content_index=0          (part: reasoning_text)
      response.reasoning_text.delta …   (one per piece)
      response.reasoning_text.done, response.content_part.done
    response.output_item.done           output_index=0
    response.output_item.added          output_index=1           (a message)
      response.content_part.added       (part: output_text), response.output_text.delta …
      response.output_text.done, response.content_part.done
    response.output_item.done           output_index=1
    response.output_item.added          output_index=2           (a function_call)
      response.function_call_arguments.delta …, response.function_call_arguments.done
    response.output_item.done           output_index=2
    response.completed                  (the whole response; status "incomplete" when
                                         max_output_tokens cut it, as vLLM sends it)

Whitespace alone never makes a message (the blank line a model writes between its
reasoning and a tool call): text waits until it holds something else.
"""

from __future__ import annotations

import uuid

from microvllm.tool_parsers.abstract_tool_parser import DeltaMessage


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(text: str, id: str | None = None) -> dict:
    return {"id": id or item_id("rs"), "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


def output_text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(text: str, id: str | None = None) -> dict:
    return {"id": id or item_id("msg"), "type": "message", "role": "assistant", "status": "completed",
            "content": [output_text_part(text)]}


def function_call_item(call_id: str, name: str, arguments: str, id: str | None = None) -> dict:
    return {"id": id or item_id("fc"), "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": "completed"}


def output_items(reasoning: str | None, content: str | None, calls: list[tuple[str, str, str]]) -> list[dict]:
    """A whole turn's items: its reasoning, its text, its calls ``(call_id, name, arguments)``."""
    items = [reasoning_item(reasoning)] if reasoning else []
    if content and not content.isspace():
        items.append(message_item(content))
    return items + [function_call_item(*call) for call in calls]


class ResponseStream:
    """The events of one streamed response, from the parsed pieces of its text
    (``feed(DeltaMessage)``). ``items`` holds every item closed so far, for the final
    ``response.completed``. One item is open at a time: ``kind`` says which."""

    def __init__(self):
        self.sequence_number = 0
        self.items: list[dict] = []
        self.kind: str | None = None      # "reasoning", "message", "function_call" or None
        self.open_item: dict = {}
        self.text = ""                    # the open item's text (or arguments) so far
        self.call_index: int | None = None
        self.blank = ""                   # whitespace held back before a message opens

    def event(self, type: str, **fields) -> dict:
        event = {"type": type, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return event

    def _where(self, content: bool = True) -> dict:
        where = {"item_id": self.open_item["id"], "output_index": len(self.items)}
        return {**where, "content_index": 0} if content else where

    # ------------------------------------------------------------ pieces
    def feed(self, delta: DeltaMessage) -> list[dict]:
        """The events one parsed piece adds (its reasoning, then text, then call pieces)."""
        events = []
        if delta.reasoning:
            if self.kind != "reasoning":
                events += self.close()
                events += self._open("reasoning", {"id": item_id("rs"), "type": "reasoning", "summary": [],
                                                   "status": "in_progress"},
                                     part={"type": "reasoning_text", "text": ""})
            self.text += delta.reasoning
            events.append(self.event("response.reasoning_text.delta", **self._where(), delta=delta.reasoning))
        if delta.content:
            events += self._text(delta.content)
        for call in delta.tool_calls:
            if self.kind != "function_call" or call.index != self.call_index:
                events += self.close()
                self.call_index = call.index
                events += self._open("function_call", {
                    "id": item_id("fc"), "type": "function_call", "call_id": call.id or item_id("call"),
                    "name": call.function.name or "", "arguments": "", "status": "in_progress"})
            if call.function.arguments:
                self.text += call.function.arguments
                events.append(self.event("response.function_call_arguments.delta", **self._where(content=False),
                                         delta=call.function.arguments))
        return events

    def _text(self, text: str) -> list[dict]:
        if self.kind != "message":
            if (self.blank + text).isspace():
                self.blank += text   # not yet a message: maybe the gap before a call
                return []
            text, self.blank = self.blank + text, ""
            events = self.close()
            events += self._open("message", {"id": item_id("msg"), "type": "message", "role": "assistant",
                                             "status": "in_progress", "content": []},
                                 part=output_text_part(""))
        else:
            events = []
        self.text += text
        events.append(self.event("response.output_text.delta", **self._where(), delta=text, logprobs=[]))
        return events

    def _open(self, kind: str, item: dict, part: dict | None = None) -> list[dict]:
        self.kind, self.open_item, self.text = kind, item, ""
        events = [self.event("response.output_item.added", output_index=len(self.items), item=item)]
        if part is not None:
            events.append(self.event("response.content_part.added", **self._where(), part=part))
        return events

    def close(self) -> list[dict]:
        """Close the open item (if any): its done events, and it joins ``items``."""
        kind, text, id = self.kind, self.text, self.open_item.get("id")
        if kind is None:
            return []
        if kind == "reasoning":
            item = reasoning_item(text, id)
            events = [self.event("response.reasoning_text.done", **self._where(), text=text),
                      self.event("response.content_part.done", **self._where(), part=item["content"][0])]
        elif kind == "message":
            item = message_item(text, id)
            events = [self.event("response.output_text.done", **self._where(), text=text, logprobs=[]),
                      self.event("response.content_part.done", **self._where(), part=item["content"][0])]
        else:
            opened = self.open_item
            item = function_call_item(opened["call_id"], opened["name"], text, id)
            events = [self.event("response.function_call_arguments.done", **self._where(content=False),
                                 name=opened["name"], arguments=text)]
        events.append(self.event("response.output_item.done", output_index=len(self.items), item=item))
        self.items.append(item)
        self.kind, self.open_item, self.text, self.call_index = None, {}, "", None
        return events
