"""``microvllm serve``'s flags (the server itself: ``entrypoints/openai/api_server.py``,
imported only when the command runs, so that ``microvllm --help`` stays fast)."""

from __future__ import annotations

import argparse
import importlib.util
import logging

SERVE_DEPENDENCIES = ("fastapi", "uvicorn")
logger = logging.getLogger(__name__)


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
    parser.add_argument("--trust-request-chat-template", action="store_true",
                        help="let a request bring its own chat_template (vLLM's flag; off by default: a template "
                             "is a program, refused with a 400). Trusted ones render in a child process bounded "
                             "in memory and in time ($VLLM_CHAT_TEMPLATE_RENDER_TIMEOUT, default 30 s)")
    parser.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                        help="serve GET /tokenizer_info: the tokenizer's configuration as JSON (vLLM's flag; "
                             "off by default, as it shows the tokenizer's whole config and chat template)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="tool_choice='auto' (the default with tools): the model calls tools in its own "
                             "format, read back by --tool-call-parser")
    from microvllm.tool_parsers import ToolParserManager  # light: the parsers load when one is asked for

    parser.add_argument("--tool-call-parser", default=None, metavar="NAME",
                        help="the model's tool-call format: one of "
                             f"{', '.join(ToolParserManager.list_registered())} (microvllm/tool_parsers/ "
                             "draws each), or one a --tool-parser-plugin registers")
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


def size_cpu_token_budget(args: argparse.Namespace) -> None:
    """A server on a CPU with no ``--max-num-batched-tokens`` gets a budget sized from this
    machine's measured GEMM rate and the model's FLOPs per token
    (``bench/roofline.py``, ``serving_token_budget``: about half a second of projections
    per step), not ``LLM``'s fixed 1024. vLLM, too, gives its API server other defaults
    than its ``LLM`` class (on a CPU: 2048 and 4096 tokens)."""
    from microvllm.engine.arg_utils import EngineArgs
    from microvllm.models.hub import resolve_model_path
    from microvllm.platforms import get_platform

    engine_args = EngineArgs.from_cli_args(args)
    if args.model_tag is not None:
        engine_args.model = args.model_tag
    if engine_args.max_num_batched_tokens is not None or not engine_args.enable_chunked_prefill:
        return
    platform = get_platform(engine_args.device)
    if str(platform.device) != "cpu":
        return
    import torch

    from microvllm.bench.roofline import ModelCost, matmul_rate, serving_token_budget

    dtype = getattr(torch, platform.resolve_dtype(engine_args.dtype))
    try:
        cost = ModelCost.from_folder(resolve_model_path(engine_args.model), dtype)
    except (OSError, KeyError, ValueError) as error:   # GGUF weights, an unusual folder: the default
        logger.info("max_num_batched_tokens: the engine's default (not sized from the model: %s)", error)
        return
    if cost.body_params == 0:   # no safetensors weights to count (GGUF): the default
        logger.info("max_num_batched_tokens: the engine's default (no safetensors weights to size it from)")
        return
    rate = matmul_rate(dtype, n=1024, repeats=3)
    args.max_num_batched_tokens = serving_token_budget(cost, rate)
    logger.info("max_num_batched_tokens=%d: about half a second of projections per step on this CPU "
                "(%.0f GFLOP/s measured, %.2f GFLOP per token); --max-num-batched-tokens sets it",
                args.max_num_batched_tokens, rate / 1e9, 2 * cost.body_params / 1e9)
