"""``StructuredOutputsConfig``: which backend compiles grammars (vLLM:
``vllm/config/structured_outputs.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from microvllm.structured_output.limits import SpecLimits

BACKENDS = ("auto", "xgrammar", "course")


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """structured_outputs_backend: ``"xgrammar"`` (vLLM's default; every kind),
    ``"course"`` (the course's regex DFA: regex and choice), or ``"auto"`` (xgrammar where
    it is installed). (vLLM calls it ``backend``; here every setting keeps its
    ``EngineArgs`` name.)"""

    structured_outputs_backend: str = "auto"
    # The server's (AsyncLLM's) grammar compiles: in this many worker processes, each
    # within compile_timeout seconds. LLM compiles in its own thread, with no limit of time.
    compile_timeout: float = 30.0
    compile_workers: int = 1
    # Every spec is measured against these before it compiles (structured_output/limits.py).
    limits: SpecLimits = field(default_factory=SpecLimits)
