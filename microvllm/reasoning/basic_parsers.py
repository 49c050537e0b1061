"""``BaseThinkingReasoningParser``: reasoning between a start and an end tag (vLLM:
``vllm/reasoning/basic_parsers.py``)::

    generated:  <think>\\nLet me add 2 and 3.\\n</think>\\n\\n5
                └ dropped ┘└── reasoning ────────┘└ ─ content ┘

The start tag is dropped when the output begins with it (older templates let the model
write it; newer ones put it in the prompt, so only the end tag is generated). Without an
end tag the whole output is reasoning (the answer was cut off by max_tokens), unless
thinking was switched off (``chat_template_kwargs={"enable_thinking": False}``): then it
is all content.

Streaming holds back what may be the start of a tag (``tool_parsers/streaming.py``), so
that the concatenated deltas split exactly as the whole output does.
"""

from __future__ import annotations

from collections.abc import Sequence

from microvllm.tool_parsers.abstract_tool_parser import DeltaMessage
from microvllm.tool_parsers.streaming import split_held_back


class BaseThinkingReasoningParser:
    start_token = "<think>"
    end_token = "</think>"

    def __init__(self, tokenizer=None, *, chat_template_kwargs: dict | None = None):
        self.model_tokenizer = tokenizer
        self.thinking_enabled = (chat_template_kwargs or {}).get("enable_thinking", True) is not False
        self._pending = ""               # text not sent yet
        self._start_checked = False      # past the place a start tag could be
        self._ended = not self.thinking_enabled

    # ------------------------------------------------------------ whole output
    def extract_reasoning(self, model_output: str, request=None) -> tuple[str | None, str | None]:
        """(reasoning, content), each None when empty."""
        if not self.thinking_enabled:
            return None, model_output or None
        if model_output.startswith(self.start_token):
            model_output = model_output[len(self.start_token):]
        reasoning, found, content = model_output.partition(self.end_token)
        if not found:
            return reasoning or None, None
        return reasoning or None, content or None

    # ------------------------------------------------------------ streaming
    def extract_reasoning_streaming(self, previous_text: str, current_text: str, delta_text: str,
                                    previous_token_ids: Sequence[int] = (), current_token_ids: Sequence[int] = (),
                                    delta_token_ids: Sequence[int] = ()) -> DeltaMessage | None:
        self._pending += delta_text
        delta = DeltaMessage()
        if not self._start_checked and not self._ended:
            if len(self._pending) < len(self.start_token) and self.start_token.startswith(self._pending):
                return None            # "<thi": the start tag, or not; wait
            if self._pending.startswith(self.start_token):
                self._pending = self._pending[len(self.start_token):]
            self._start_checked = True
        if not self._ended:
            end = self._pending.find(self.end_token)
            if end < 0:
                safe, self._pending = split_held_back(self._pending, self.end_token)
                delta.reasoning = safe or None
                return None if delta.is_empty() else delta
            delta.reasoning = self._pending[:end] or None
            self._pending = self._pending[end + len(self.end_token):]
            self._ended = True
        delta.content, self._pending = self._pending or None, ""
        return None if delta.is_empty() else delta

    def finish_streaming(self) -> DeltaMessage | None:
        """The stream ended: what was held back, where it belongs."""
        held, self._pending = self._pending, ""
        if not held:
            return None
        return DeltaMessage(content=held) if self._ended else DeltaMessage(reasoning=held)

    def is_reasoning_end(self, text: str) -> bool:
        """Whether ``text`` (the output so far) is past the reasoning: structured outputs
        constrain only what follows (vLLM's rule)."""
        return not self.thinking_enabled or self.end_token in text
