"""Tool-call parsers (vLLM: ``vllm/tool_parsers/``), chosen by name with
``--tool-call-parser NAME`` (``ToolParserManager``: vLLM's registry and its names).

    hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>     Qwen2.5, Qwen3
    qwen3_xml    <tool_call><function=NAME><parameter=P>value</parameter>...   Qwen3-Coder, Qwen3.5
                 </function></tool_call>   (values typed by the tools' schemas)
    llama3_json  <|python_tag|>{"name": ..., "parameters": {...}}; {...}       Llama 3.1, 3.2, 4
    mistral      [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]          Mistral 7B v0.3
                 [TOOL_CALLS]NAME[ARGS]{...}                                   Mistral Small 3.1+
    pythonic     [get_weather(city="Paris"), get_time(tz="CET")]               Llama 3.2, ToolACE

The parsers besides hermes read each delta on from where the last one stopped (``reparse.py``);
none raises on any text: what it cannot parse is content.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from microvllm.tool_parsers.registry import ParserRegistry


class ToolParserManager(ParserRegistry):
    """Tool-call parsers by name (vLLM's registry)."""

    BUILTIN = ("hermes", "llama3_json", "llama4_json", "mistral", "pythonic", "qwen3_xml")
    KIND = "tool-call parser"
    FLAG = "--tool-call-parser; or load your own with --tool-parser-plugin FILE"

    @classmethod
    def load_builtins(cls) -> None:
        from microvllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser
        from microvllm.tool_parsers.llama_tool_parser import Llama3JsonToolParser
        from microvllm.tool_parsers.mistral_tool_parser import MistralToolParser
        from microvllm.tool_parsers.pythonic_tool_parser import PythonicToolParser
        from microvllm.tool_parsers.qwen3xml_tool_parser import Qwen3XMLToolParser
        for name, parser in (("hermes", Hermes2ProToolParser), ("llama3_json", Llama3JsonToolParser),
                             ("llama4_json", Llama3JsonToolParser), ("mistral", MistralToolParser),
                             ("pythonic", PythonicToolParser), ("qwen3_xml", Qwen3XMLToolParser)):
            cls.registered.setdefault(name, parser)

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
