"""Reasoning parsers (vLLM: ``vllm/reasoning/``), chosen with ``--reasoning-parser NAME``:
they split a reasoning model's thinking from its answer (``ReasoningParserManager``).

    qwen3         <think> ... </think> answer     Qwen3, Qwen3.5 (enable_thinking honoured)
    deepseek_r1   <think> ... </think> answer     DeepSeek-R1 and its distills
"""

from __future__ import annotations

from microvllm.tool_parsers.registry import ParserRegistry


class ReasoningParserManager(ParserRegistry):
    """Reasoning parsers by name (vLLM's registry)."""

    BUILTIN = ("qwen3", "deepseek_r1")
    KIND = "reasoning parser"
    FLAG = "--reasoning-parser"

    @classmethod
    def load_builtins(cls) -> None:
        from microvllm.reasoning.deepseek_r1_reasoning_parser import DeepSeekR1ReasoningParser
        from microvllm.reasoning.qwen3_reasoning_parser import Qwen3ReasoningParser
        cls.registered.setdefault("qwen3", Qwen3ReasoningParser)
        cls.registered.setdefault("deepseek_r1", DeepSeekR1ReasoningParser)

    @classmethod
    def get_reasoning_parser(cls, name: str) -> type:
        return cls.get(name)
