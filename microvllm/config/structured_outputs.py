"""``StructuredOutputsConfig``: which backend compiles grammars (vLLM:
``vllm/config/structured_outputs.py``)."""

from __future__ import annotations

from dataclasses import dataclass

BACKENDS = ("auto", "xgrammar", "course")


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """structured_outputs_backend: ``"xgrammar"`` (vLLM's default; every kind),
    ``"course"`` (the course's regex DFA: regex and choice), or ``"auto"`` (xgrammar where
    it is installed). (vLLM calls it ``backend``; here every setting keeps its
    ``EngineArgs`` name.)"""

    structured_outputs_backend: str = "auto"
