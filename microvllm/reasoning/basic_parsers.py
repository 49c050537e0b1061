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
        self._think_ids: tuple[int, int] | None = None

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

    # ------------------------------------------------------------ the engine's gate
    # Structured outputs constrain only what follows the reasoning (vLLM's rule): the
    # engine core asks these, on token ids, whether the grammar is in force yet.
    def think_token_ids(self) -> tuple[int, int]:
        """(start, end) tags' token ids; ``ValueError`` when either is not one token of
        the model's vocabulary (the core could not see where the reasoning ends)."""
        if self._think_ids is not None:
            return self._think_ids
        vocab = self.model_tokenizer.hf_tokenizer.get_vocab() if self.model_tokenizer is not None else {}
        missing = [tag for tag in (self.start_token, self.end_token) if tag not in vocab]
        if missing:
            raise ValueError(f"{type(self).__name__}: {' and '.join(map(repr, missing))} must each be one token "
                             "of the model's vocabulary for the engine to see where the reasoning ends "
                             "(structured outputs start there): serve a model whose tokenizer has them, or "
                             "leave out --reasoning-parser")
        self._think_ids = vocab[self.start_token], vocab[self.end_token]   # get_vocab() builds a dict: once
        return self._think_ids

    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        """Whether the reasoning is over at the end of ``input_ids`` (a prompt, or a prompt and
        its output): the last think tag in them is an end tag. A template that switches
        thinking off writes ``<think>\n\n</think>`` into the prompt: over before it starts."""
        start, end = self.think_token_ids()
        for token_id in reversed(input_ids):
            if token_id == end:
                return True
            if token_id == start:
                return False
        return False

    def content_ids_after_end(self, delta_ids: Sequence[int]) -> list[int] | None:
        """The ids after an end tag in ``delta_ids`` (a step's new tokens), or None when the
        reasoning goes on through them: what the grammar takes in the step it starts."""
        end = self.think_token_ids()[1]
        for at, token_id in enumerate(delta_ids):
            if token_id == end:
                return list(delta_ids[at + 1:])
        return None
