"""Tool-call parsers (vLLM: ``vllm/tool_parsers/``), chosen by name with
``--tool-call-parser NAME`` (``ToolParserManager``: vLLM's registry and its names).

    hermes   <tool_call>{"name": ..., "arguments": {...}}</tool_call>   Qwen2.5, Qwen3
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from microvllm.tool_parsers.registry import ParserRegistry


class ToolParserManager(ParserRegistry):
    """Tool-call parsers by name (vLLM's registry)."""

    BUILTIN = ("hermes",)
    KIND = "tool-call parser"
    FLAG = "--tool-call-parser; or load your own with --tool-parser-plugin FILE"

    @classmethod
    def load_builtins(cls) -> None:
        from microvllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser
        cls.registered.setdefault("hermes", Hermes2ProToolParser)

    @classmethod
    def get_tool_parser(cls, name: str) -> type:
        return cls.get(name)

    @classmethod
    def import_tool_parser(cls, plugin_path: str) -> None:
        """Run a file that registers a parser of its own (``--tool-parser-plugin``)."""
        path = Path(plugin_path)
        spec = importlib.util.spec_from_file_location(f"microvllm_tool_parser_plugin_{path.stem}", path)
        if spec is None or spec.loader is None:
            raise ValueError(f"--tool-parser-plugin {plugin_path!r}: not a Python file")
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
