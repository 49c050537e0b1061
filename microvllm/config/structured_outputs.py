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
    # The server's (AsyncLLM's) grammar compiles: in this many worker processes, each
    # within this many seconds. LLM compiles in its own thread, with no limit of time.
    structured_outputs_compile_timeout: float = 30.0
    structured_outputs_compile_workers: int = 1
    # Every spec is measured against these before it compiles (structured_output/limits.py).
    structured_outputs_max_spec_chars: int = 262_144
    structured_outputs_max_choices: int = 4_096
    structured_outputs_max_schema_depth: int = 128
    # A reasoning parser's name (vLLM's ``reasoning_parser``, from ``--reasoning-parser``):
    # grammars are in force only after the reasoning it delimits. "": from the first token.
    reasoning_parser: str = ""
