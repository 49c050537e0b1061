"""``--reasoning-parser qwen3`` (vLLM: ``vllm/reasoning/qwen3_reasoning_parser.py``):
``<think>`` ... ``</think>``; Qwen3.5's template writes ``<think>`` into the prompt, older
Qwen3 models generate it; ``enable_thinking=False`` makes every token content."""

from __future__ import annotations

from microvllm.reasoning.basic_parsers import BaseThinkingReasoningParser


class Qwen3ReasoningParser(BaseThinkingReasoningParser):
    pass
