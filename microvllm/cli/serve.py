"""``microvllm serve``'s flags (the server itself: ``entrypoints/openai/api_server.py``,
imported only when the command runs, so that ``microvllm --help`` stays fast)."""

from __future__ import annotations

import argparse
import importlib.util

SERVE_DEPENDENCIES = ("fastapi", "uvicorn")


def missing_serve_dependencies() -> list[str]:
    """The server's packages (the ``serve`` extra) that are not installed here."""
    return [name for name in SERVE_DEPENDENCIES if importlib.util.find_spec(name) is None]


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The model, where to listen, then every engine flag (vLLM's ``vllm serve``)."""
    from microvllm.engine.arg_utils import EngineArgs

    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="a model folder or a cached hub id (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="the name(s) clients send as `model`; the first is the one reported "
                             "(default: the model's path or id)")
    parser.add_argument("--api-key", default=None,
                        help="require `Authorization: Bearer <key>` on every /v1 route "
                             "(default: $VLLM_API_KEY if set, else no key)")
    parser.add_argument("--chat-template", default=None,
                        help="a Jinja chat template, or the path of a file holding one: replaces the model's")
    parser.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                        help="serve GET /tokenizer_info: the tokenizer's configuration as JSON (vLLM's flag; "
                             "off by default, as it shows the tokenizer's whole config and chat template)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="tool_choice='auto' (the default with tools): the model calls tools in its own "
                             "format, read back by --tool-call-parser")
    parser.add_argument("--tool-call-parser", default=None, metavar="NAME",
                        help="the model's tool-call format: hermes (Qwen2.5, Qwen3), or one a "
                             "--tool-parser-plugin registers")
    parser.add_argument("--tool-parser-plugin", default=None, metavar="FILE",
                        help="a Python file that registers a tool parser (ToolParserManager.register_module)")
    parser.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                        help="LoRA adapters to serve (with --enable-lora), each chosen by its name as a request's "
                             "`model`: name=path of a peft folder, or a JSON object with name, path")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
    parser.add_argument("--shutdown-timeout", type=float, default=5.0,
                        help="seconds open streams get to finish after SIGTERM before they are aborted")
    from microvllm.entrypoints.openai.request_limits import RequestLimits

    limits = RequestLimits()
    parser.add_argument("--max-request-body-bytes", type=int, default=limits.max_request_body_bytes,
                        help="a larger request body is refused with a 413, from its Content-Length at once or "
                             "when a chunked body passes it (default: %(default)s, 32 MiB)")
    parser.add_argument("--request-header-timeout", type=float, default=limits.request_header_timeout,
                        help="seconds a connection gets to send a request's headers, else a 408 and the "
                             "connection is closed (default: %(default)s)")
    parser.add_argument("--request-body-timeout", type=float, default=limits.request_body_timeout,
                        help="seconds a request's whole body gets to arrive after its headers, else a 408 and "
                             "the connection is closed (default: %(default)s)")
    EngineArgs.add_cli_args(parser.add_argument_group("engine arguments"))
    return parser
