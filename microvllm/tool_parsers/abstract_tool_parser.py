"""What a tool parser gives back, and the interface every parser has (vLLM:
``vllm/tool_parsers/abstract_tool_parser.py``, the types from its OpenAI protocol).

A tool call is only text the model wrote in the format its chat template taught it. The
parser turns that text back into the OpenAI API's structures:

    whole message (stream=False)            a stream of deltas (stream=True)
    extract_tool_calls(text)                extract_tool_calls_streaming(prev, cur, delta)
      -> ExtractedToolCallInformation          -> DeltaMessage | None   (per delta)
           tools_called, tool_calls,              content: text outside every call
           content                                tool_calls: [DeltaToolCall(index, id,
                                                     function=DeltaFunctionCall(name,
                                                     arguments fragment))]
                                            finish_streaming()  -> what was held back

A streamed call arrives as one ``DeltaToolCall`` with its ``index``, ``id`` and name, then
fragments of its arguments (JSON text) with the same ``index``: a client concatenates them.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field


def random_tool_call_id() -> str:
    """vLLM's form of a tool call's id."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class FunctionCall:
    name: str
    arguments: str   # JSON text, as the model wrote it


@dataclass
class ToolCall:
    function: FunctionCall
    id: str = field(default_factory=random_tool_call_id)
    type: str = "function"


@dataclass
class ExtractedToolCallInformation:
    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None   # the text outside every call (None: none)


@dataclass
class DeltaFunctionCall:
    name: str | None = None
    arguments: str | None = None


@dataclass
class DeltaToolCall:
    index: int
    function: DeltaFunctionCall
    id: str | None = None      # sent with the call's first delta only
    type: str | None = None    # "function", with the first delta only


@dataclass
class DeltaMessage:
    """One streamed piece of an assistant message (vLLM's ``DeltaMessage``): text, reasoning
    text (``reasoning``, vLLM's field name), tool-call pieces."""

    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not self.content and not self.reasoning and not self.tool_calls


class ToolParser:
    """One per request (a streaming parser keeps state between deltas). ``tokenizer``: the
    model's, for parsers that look at token ids; the text parsers here do not need it."""

    def __init__(self, tokenizer=None):
        self.model_tokenizer = tokenizer

    def extract_tool_calls(self, model_output: str, request=None) -> ExtractedToolCallInformation:
        raise NotImplementedError

    def extract_tool_calls_streaming(self, previous_text: str, current_text: str, delta_text: str,
                                     previous_token_ids: Sequence[int] = (), current_token_ids: Sequence[int] = (),
                                     delta_token_ids: Sequence[int] = (), request=None) -> DeltaMessage | None:
        raise NotImplementedError

    def finish_streaming(self) -> DeltaMessage | None:
        """The stream ended: what the parser still holds back (text that looked like the
        start of a tag, a call left open), as its last delta."""
        return None

    @classmethod
    def structural_tag(cls, functions: dict[str, dict]) -> dict | None:
        """This format as xgrammar's structural tag for ``functions`` (name -> parameters
        schema): what ``tool_choice="auto"`` with ``strict`` tools is held to. None: the
        format has none here (strict is then not enforced)."""
        return None


def triggered_tags(trigger: str, calls: list[tuple[str, dict, str]]) -> dict:
    """A structural tag (xgrammar's ``triggered_tags``): the model writes freely until it
    writes ``trigger``; from there it must write one of ``calls``, each
    ``(begin, schema, end)``: the begin text (which starts with the trigger), a JSON value
    that ``schema`` validates, the end text; then it is free again::

        Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>
        └ free ────┘└ begin (one per function) ────────────────────┘└ schema ──────────┘└ end ───────┘
    """
    return {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": [trigger],
        "tags": [{"begin": begin, "content": {"type": "json_schema", "json_schema": schema}, "end": end}
                 for begin, schema, end in calls]}}
