"""``--reasoning-parser deepseek_r1`` (vLLM: ``vllm/reasoning/deepseek_r1_reasoning_parser.py``):
DeepSeek-R1 thinks between ``<think>`` and ``</think>``; newer R1 templates put ``<think>``
in the prompt, so an output without an end tag is all reasoning (cut off)."""

from __future__ import annotations

from microvllm.reasoning.basic_parsers import BaseThinkingReasoningParser


class DeepSeekR1ReasoningParser(BaseThinkingReasoningParser):
    pass
