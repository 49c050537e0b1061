"""``microvllm serve``: an OpenAI-compatible HTTP server on FastAPI + uvicorn
(vLLM: ``entrypoints/openai/api_server.py``).

    microvllm serve [MODEL] --host 127.0.0.1 --port 8000 [--api-key KEY] [engine flags]

    GET  /health                200 while the engine runs; 503 (with why) once it failed,
                                and then the process exits with status 1 for a supervisor
    GET  /ping  /version        liveness (vLLM's) and microvllm's version
    GET  /v1/models[/{id}]      the served model
    POST /v1/completions        prompt(s) -> text         (stream=true: server-sent events)
    POST /v1/chat/completions   messages  -> a reply      (stream=true: server-sent events)
    POST /v1/responses          input -> output items    (OpenAI's Responses API, stateless;
                                stream=true: named server-sent events)
    POST /tokenize /detokenize  text or messages <-> token ids (vLLM's)
    GET  /tokenizer_info        the tokenizer's configuration, with --enable-tokenizer-info-endpoint
                                only (vLLM's; off: 404). lm-eval reads it
    GET  /metrics               Prometheus text: queue sizes, KV usage, TTFT, ITL, tokens

Every error has OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: a bad
field, malformed JSON or a feature microvllm lacks is a 400 naming the field; a missing
or wrong API key 401; an unknown model or route 404; headers or a body slower than
``--request-header-timeout`` / ``--request-body-timeout`` 408, a body over
``--max-request-body-bytes`` 413 (``request_guard.py``); a request that failed inside the
engine 500 (the engine goes on: ``engine/fault_isolation.py``). No exception escapes to
uvicorn, so a failed request never breaks the next one on the same connection.

The engine core (the scheduler and the model) runs in a process of its own, as vLLM's
does (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: in a thread of this one): this process
tokenizes, detokenizes and speaks HTTP. A core that dies ends every stream with an
error within a second, and the server exits with status 1.

SIGTERM (or Ctrl-C): uvicorn stops accepting; open streams get ``--shutdown-timeout``
seconds, then every request still running is aborted: a stream ends with a last chunk
whose ``finish_reason`` is ``"abort"`` and ``data: [DONE]``, a plain request gets a 503.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib.metadata
import logging
import os
import re
import signal
import socket
import threading
import time
from contextlib import asynccontextmanager
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from microvllm import envs
from microvllm.engine.arg_utils import EngineArgs
from microvllm.engine.async_llm import AsyncLLM, EngineDeadError, RequestFailedError
from microvllm.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                                  LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest,
                                                   ErrorInfo, ErrorResponse, ModelCard, ModelList,
                                                   TokenizeRequest)
from microvllm.entrypoints.openai.protocol_responses import ResponsesRequest
from microvllm.entrypoints.openai.request_guard import RequestGuard, with_header_timeout
from microvllm.entrypoints.openai.request_limits import RequestLimits
from microvllm.entrypoints.openai.serving import OpenAIServing, ServerShuttingDown
from microvllm.entrypoints.openai.serving_models import (LoRAModulePath, OpenAIServingModels, check_lora_modules,
                                                         parse_lora_modules)
from microvllm.entrypoints.openai.serving_responses import OpenAIServingResponses
from microvllm.utils.gc_utils import freeze_gc_heap

logger = logging.getLogger(__name__)
EMBEDDED_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
HEALTH_STUCK_SECONDS = 60.0   # one engine step longer than this: /health says 503
ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
               405: "MethodNotAllowedError", 408: "RequestTimeoutError", 413: "RequestTooLargeError",
               500: "InternalServerError", 503: "ServiceUnavailableError"}


def error_response(status: int, message: str, kind: str | None = None, param: str | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=kind or ERROR_TYPES.get(status, "Error"),
                                         param=param, code=status))
    return JSONResponse(body.model_dump(), status_code=status)


def bad_request(error: Exception, fields) -> JSONResponse:
    """HTTP 400 with the engine's message; ``param`` is the field it starts with. The
    engine's own request ids ("request 'cmpl-…-0': ...") are internal: left out."""
    message = re.sub(r"^request '[^']*': ", "", str(error))
    first = re.match(r"[\w]+", message)
    param = first.group(0) if first and first.group(0) in fields else None
    return error_response(400, message, "BadRequestError", param)


class ClientGone(Exception):
    """The client closed its connection before the response was ready."""


async def until_disconnected(raw_request: Request, work):
    """Await ``work``, but cancel it if the client hangs up first (vLLM's ``with_cancellation``):
    a non-streamed request would otherwise keep generating for nobody. Cancelling it
    cancels its ``AsyncLLM.generate``, which aborts the request and frees its blocks."""
    async def disconnected():
        while (await raw_request.receive())["type"] != "http.disconnect":
            pass

    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait([work_task, watch_task], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch_task.cancel()
        if not work_task.done():
            work_task.cancel()
    if not work_task.done() or work_task.cancelled():
        await asyncio.gather(work_task, return_exceptions=True)
        raise ClientGone()
    return work_task.result()


class GracefulServer(uvicorn.Server):
    """uvicorn's server, plus: when a signal asks it to stop, abort whatever is still
    running ``grace`` seconds later (streams end with ``finish_reason: "abort"``)."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLM, grace: float):
        super().__init__(config)
        self.engine, self.grace = engine, grace

    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit:
            logger.info("stopping: open requests get %.0f s to finish, then are aborted", self.grace)
            timer = threading.Timer(self.grace, self.engine.abort_all)
            timer.daemon = True
            timer.start()
        super().handle_exit(sig, frame)


class CatchAll:
    """Outermost ASGI layer under Starlette's own: an exception raised before the response
    started becomes an OpenAI-shaped 500 here, and is not re-raised (Starlette's handler
    re-raises, and uvicorn then drops the keep-alive connection)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watching_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watching_send)
        except Exception:  # noqa: BLE001 - every client gets an answer
            logger.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            if not started:
                await error_response(500, "internal server error: the server logged the details")(
                    scope, receive, send)


def chat_parsers(enable_auto_tool_choice: bool, tool_call_parser: str | None,
                 reasoning_parser: str | None) -> dict:
    """The parser classes ``--enable-auto-tool-choice --tool-call-parser NAME`` and
    ``--reasoning-parser NAME`` name; ``ValueError`` saying what to change."""
    from microvllm.reasoning import ReasoningParserManager
    from microvllm.tool_parsers import ToolParserManager

    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser NAME (the model's tool-call format: "
                         f"one of {ToolParserManager.list_registered()})")
    try:
        return {"enable_auto_tool_choice": enable_auto_tool_choice,
                "tool_parser": (ToolParserManager.get_tool_parser(tool_call_parser)
                                if tool_call_parser is not None else None),
                "reasoning_parser": (ReasoningParserManager.get_reasoning_parser(reasoning_parser)
                                     if reasoning_parser else None)}
    except KeyError as error:
        raise ValueError(error.args[0]) from None


def build_app(engine: AsyncLLM, model_name: str, *, served_model_names: list[str] | None = None,
              api_key: str | None = None, chat_template: str | None = None,
              on_engine_dead=None, enable_tokenizer_info_endpoint: bool = False,
              enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None,
              reasoning_parser: str | None = None, lora_modules: list[LoRAModulePath] | None = None,
              trust_request_chat_template: bool = False) -> FastAPI:
    """The FastAPI app serving ``engine`` under ``model_name`` (and any other
    ``served_model_names``). ``on_engine_dead()`` is called once if the engine dies.
    ``enable_tokenizer_info_endpoint``: serve ``GET /tokenizer_info`` (else it is a 404).
    ``lora_modules``: LoRA adapters served by name (``--lora-modules``; the engine has
    ``enable_lora=True``), each checked here: a folder the engine cannot run is refused."""
    serving = OpenAIServing(engine, model_name, chat_template=chat_template,
                            trust_request_chat_template=trust_request_chat_template,
                            **chat_parsers(enable_auto_tool_choice, tool_call_parser, reasoning_parser))
    responses_serving = OpenAIServingResponses(serving)   # /v1/responses, over the chat path
    names = [model_name, *(served_model_names or [])]
    models = serving.models = OpenAIServingModels(names)
    for module in lora_modules or []:
        models.add(module.name, module.path, check=engine.engine.input_processor.check_lora_request)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        watcher = asyncio.create_task(watch_engine())
        yield
        watcher.cancel()
        engine.shutdown()   # after uvicorn stopped serving: abort what is left, stop the thread

    async def watch_engine():
        while engine.is_running:
            await asyncio.sleep(0.25)
        if engine.dead_error is not None and not engine.stopping:
            logger.error("the engine died (%r): the server stops so that a supervisor can restart it",
                         engine.dead_error)
            if on_engine_dead is not None:
                on_engine_dead()

    app = FastAPI(title="microvllm", lifespan=lifespan)
    app.state.engine = engine
    app.add_middleware(RequestGuard)   # body size, time and text (request_guard.py), inside CatchAll
    app.add_middleware(CatchAll)

    @app.middleware("http")
    async def authenticate(request: Request, call_next):
        if api_key is not None and request.url.path.startswith("/v1"):
            if request.headers.get("authorization", "") != f"Bearer {api_key}":
                return error_response(401, "missing or wrong API key: send `Authorization: Bearer <key>`")
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            return error_response(400, f"malformed JSON in the request body: {first.get('msg')}",
                                  "BadRequestError")
        # loc is ("body", field, index, ...), with pydantic's union member names ("str",
        # "list[int]") in between: keep the field and the indices, as a client wrote them.
        location = [str(part) for part in first.get("loc", ())[1:]
                    if isinstance(part, int) or part.isidentifier() and part not in ("str", "int", "float", "bool")]
        param = location[0] if location else None
        where = ".".join(location) or "request body"
        return error_response(400, f"{where}: {first.get('msg', 'invalid')} (got {first.get('input')!r:.80})",
                              "BadRequestError", param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException):
        message = {404: "no such route: see /docs for the routes this server has",
                   405: "this route does not take that method"}.get(exc.status_code, str(exc.detail))
        if exc.status_code == 400 and exc.__cause__ is not None:   # FastAPI's "error parsing the body"
            message = f"the request body cannot be parsed as JSON ({type(exc.__cause__).__name__}: {exc.__cause__})"
        return error_response(exc.status_code, message)

    def unknown_model(name: str | None) -> JSONResponse | None:
        if name is None or models.is_served(name):
            return None
        served = ", ".join(f"`{card['id']}`" for card in models.model_cards())
        return error_response(404, f"The model `{name}` does not exist: this server serves {served}.",
                              "NotFoundError", "model")

    async def respond(request, raw_request: Request, create):
        if (missing := unknown_model(request.model)) is not None:
            return missing
        if not engine.is_running:
            return error_response(503, "the engine is not running", "ServiceUnavailableError")
        try:
            ignored = request.check_supported()
            if ignored:
                logger.warning("these fields of the request are not used by microvllm: %s", ", ".join(ignored))
            result = await until_disconnected(raw_request, create(request))
        except ClientGone:
            return PlainTextResponse("", status_code=499)   # nobody reads it: nginx's "client closed"
        except (ValueError, TypeError) as error:
            return bad_request(error, type(request).model_fields)
        except (EngineDeadError, ServerShuttingDown) as error:
            return error_response(503, str(error), "ServiceUnavailableError")
        except RequestFailedError as error:
            return error_response(500, str(error), "InternalServerError")
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(result, media_type="text/event-stream")

    @app.get("/health")
    async def health():
        """200 only while a request sent now would be served: the engine-core thread is
        alive and has not been stuck in one pass for ``HEALTH_STUCK_SECONDS``."""
        if not engine.is_running:
            reason = f": {engine.dead_error!r}" if engine.dead_error is not None else ""
            return PlainTextResponse(f"engine not running{reason}", status_code=503)
        stuck = time.monotonic() - engine.last_heartbeat
        if stuck > HEALTH_STUCK_SECONDS:
            return PlainTextResponse(f"engine stuck: its loop has not come round for {stuck:.0f} s",
                                     status_code=503)
        return PlainTextResponse("")

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping():
        return await health()

    @app.get("/version")
    async def version():
        return {"version": importlib.metadata.version("microvllm")}

    def cards() -> list[ModelCard]:
        return [ModelCard(**card, max_model_len=serving.max_model_len) for card in models.model_cards()]

    @app.get("/v1/models")
    async def list_models():
        return ModelList(data=cards()).model_dump()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        return unknown_model(model_id) or next(c for c in cards() if c.id == model_id).model_dump()

    if envs.allow_runtime_lora_updating():   # vLLM's switch: a client chooses a folder to load
        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(request: LoadLoRAAdapterRequest):
            try:
                lora = models.new_lora_request(request.lora_name, request.lora_path)
            except ValueError as error:
                return error_response(400, str(error), "BadRequestError", "lora_name")
            try:   # reads the folder's config, tensor shapes and digest: off the event loop
                lora = await engine.run_on_tokenizer_thread(functools.partial(
                    engine.engine.input_processor.check_lora_request, lora))
            except (ValueError, TypeError, OSError) as error:   # nothing is served under the name
                return error_response(400, str(error), "BadRequestError", "lora_path")
            try:
                models.register(lora)   # only now can a request name it
            except ValueError as error:
                return error_response(400, str(error), "BadRequestError", "lora_name")
            return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' added successfully.")

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(request: UnloadLoRAAdapterRequest):
            try:
                models.remove(request.lora_name)   # running requests finish with it; new ones are refused
            except KeyError as error:
                return error_response(404, error.args[0], "NotFoundError", "lora_name")
            return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' removed successfully.")

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, raw_request: Request):
        return await respond(request, raw_request, serving.create_completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw_request: Request):
        return await respond(request, raw_request, serving.create_chat_completion)

    @app.post("/v1/responses")
    async def responses(request: ResponsesRequest, raw_request: Request):
        return await respond(request, raw_request, responses_serving.create_response)

    if envs.server_dev_mode():   # vLLM's development endpoints (VLLM_SERVER_DEV_MODE=1)
        @app.post("/reset_prefix_cache")
        async def reset_prefix_cache() -> Response:
            """Forget every cached block (tests sharing one server start cold): 200 when done,
            409 while blocks are in use."""
            reset = await engine.reset_prefix_cache()
            return Response(status_code=200 if reset else 409)

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest):
        if (missing := unknown_model(request.model)) is not None:
            return missing
        try:
            if (request.prompt is None) == (request.messages is None):
                raise ValueError("give exactly one of prompt (a string) or messages (a chat)")
            if request.messages is not None:
                chat = ChatCompletionRequest(messages=request.messages,
                                             add_generation_prompt=request.add_generation_prompt)
                serving.check_chat_size(chat)
                token_ids = (await engine.run_on_tokenizer_thread(
                    functools.partial(serving.render_chat, chat)))["prompt_token_ids"]
            else:
                tokenizer = engine.tokenizer
                if tokenizer is None:
                    raise ValueError("this model has no tokenizer")
                engine.engine.check_text_fits(len(request.prompt), "prompt")
                token_ids = await engine.run_on_tokenizer_thread(
                    functools.partial(tokenizer.encode, request.prompt, request.add_special_tokens))
        except (ValueError, TypeError) as error:
            return bad_request(error, TokenizeRequest.model_fields)
        return {"count": len(token_ids), "max_model_len": serving.max_model_len, "tokens": token_ids}

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest):
        if (missing := unknown_model(request.model)) is not None:
            return missing
        vocab_size = engine.engine.prompts.vocab_size
        outside = [t for t in request.tokens if not 0 <= t < vocab_size]
        if outside:
            return error_response(400, f"tokens contains ids {outside[:5]} outside the vocabulary [0, {vocab_size})",
                                  param="tokens")
        if engine.tokenizer is None:
            return error_response(400, "this model has no tokenizer")
        # 2M ids take over a second to decode: never on the event loop, where every stream waits.
        text = await engine.run_on_tokenizer_thread(
            functools.partial(engine.tokenizer.decode, request.tokens, skip_special_tokens=False))
        return {"prompt": text}

    if enable_tokenizer_info_endpoint:   # off by default, as in vLLM: it shows the tokenizer's whole config
        @app.get("/tokenizer_info")
        async def get_tokenizer_info():
            if engine.tokenizer is None:
                return error_response(400, "this model has no tokenizer")
            return JSONResponse(tokenizer_info(engine.tokenizer.hf_tokenizer, serving.chat_template))

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(engine.metrics.render(model_name),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def tokenizer_info(hf_tokenizer, chat_template: str | None = None) -> dict:
    """vLLM's ``/tokenizer_info`` body: the arguments the tokenizer was made with (its
    ``tokenizer_config.json``: special tokens, chat template, ...) as JSON, special tokens
    as their text, plus ``tokenizer_class``, and ``chat_template`` if the server was given
    one (``--chat-template``). Paths on the server are left out: vLLM drops ``vocab_file``
    and ``merges_file``; we also drop ``name_or_path`` (here the model's folder)."""
    def plain(value):
        if hasattr(value, "content"):   # AddedToken: its text
            return value.content
        if isinstance(value, dict):
            return {str(key): plain(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(item) for item in value]
        return value if value is None or isinstance(value, (str, int, float, bool)) else str(value)

    config = {key: value for key, value in (getattr(hf_tokenizer, "init_kwargs", None) or {}).items()
              if key not in ("vocab_file", "merges_file", "name_or_path")}
    config = plain(config)
    config["tokenizer_class"] = type(hf_tokenizer).__name__
    if chat_template:
        config["chat_template"] = chat_template
    return config


def check_port_free(host: str, port: int) -> None:
    """Fail before the model loads (seconds to minutes) if the port is taken."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as error:
            raise SystemExit(f"cannot listen on {host}:{port} ({error.strerror}): another process "
                             "uses the port; pick another with --port") from None


def read_chat_template(value: str | None) -> str | None:
    """``--chat-template``: a file's path, or the template itself (as vLLM takes it)."""
    if value is None:
        return None
    if "{" not in value and Path(value).is_file():
        return Path(value).read_text()
    if "{" not in value:
        raise SystemExit(f"--chat-template {value!r} is neither a file nor a Jinja template")
    return value


def run_server(args: argparse.Namespace) -> int:
    """Build the engine (loading the model), then serve until SIGTERM or Ctrl-C. Returns
    the exit status: 0 after a signal, 1 if the engine died."""
    check_port_free(args.host, args.port)
    if getattr(args, "tool_parser_plugin", None):
        from microvllm.tool_parsers import ToolParserManager
        ToolParserManager.import_tool_parser(args.tool_parser_plugin)
    chat_parsers(getattr(args, "enable_auto_tool_choice", False), getattr(args, "tool_call_parser", None),
                 getattr(args, "reasoning_parser", None))   # a wrong name: refused before the model loads
    chat_template = read_chat_template(getattr(args, "chat_template", None))
    lora_modules = parse_lora_modules(getattr(args, "lora_modules", None))
    if lora_modules and not getattr(args, "enable_lora", False):
        raise ValueError("--lora-modules needs --enable-lora (and --max-lora-rank at least the adapters' rank)")
    engine_args = EngineArgs.from_cli_args(args)
    if args.model_tag is not None:
        engine_args.model = args.model_tag
    check_lora_modules(lora_modules, engine_args.max_lora_rank)   # a DoRA adapter: refused before the model loads
    # The engine core in a process of its own unless VLLM_ENABLE_V1_MULTIPROCESSING=0 (with
    # --data-parallel-size N: N cores, each in its own, behind this one front end).
    engine = AsyncLLM.from_engine_args(engine_args, multiprocess=envs.enable_v1_multiprocessing(default=True))
    # From here on, whatever fails (an adapter build_app refuses, a bad limit) must stop the
    # engine: at exit, multiprocessing joins the core's process, which waits for this one to
    # end, so neither would (a server neither serving nor gone).
    previous: dict = {}
    try:
        served = args.served_model_name or [engine_args.model or EMBEDDED_MODEL_NAME]
        api_key = getattr(args, "api_key", None) or os.environ.get("VLLM_API_KEY") or None
        server: uvicorn.Server | None = None
        exit_code = 0

        def engine_dead():
            nonlocal exit_code
            exit_code = 1
            if server is not None:
                server.should_exit = True

        app = build_app(engine, served[0], served_model_names=served[1:], api_key=api_key,
                        chat_template=chat_template, on_engine_dead=engine_dead,
                        enable_tokenizer_info_endpoint=getattr(args, "enable_tokenizer_info_endpoint", False),
                        enable_auto_tool_choice=getattr(args, "enable_auto_tool_choice", False),
                        tool_call_parser=getattr(args, "tool_call_parser", None),
                        reasoning_parser=getattr(args, "reasoning_parser", None), lora_modules=lora_modules,
                        trust_request_chat_template=getattr(args, "trust_request_chat_template", False))
        limits = RequestLimits.from_cli_args(args)
        app.state.request_limits = limits   # read by RequestGuard
        freeze_gc_heap()   # the model and libraries stay: fewer GC pauses, and a quick exit
        logger.info("serving %s on http://%s:%d", served[0], args.host, args.port)
        # uvicorn waits for open connections up to its own timeout; ours aborts the requests
        # a little earlier, so every stream can still send its last chunk and [DONE].
        # uvicorn has no deadline for a request's headers: its protocol class gets one.
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                                timeout_graceful_shutdown=args.shutdown_timeout + 5,
                                http=with_header_timeout(AutoHTTPProtocol, limits.request_header_timeout))
        server = GracefulServer(config, engine, args.shutdown_timeout)
        # uvicorn catches SIGTERM / SIGINT, stops gracefully, then raises the signal again
        # with the handlers that were there before it: these make that a normal exit.
        stopped = lambda signum, frame: logger.info("stopped by signal %d", signum)  # noqa: E731
        previous = {s: signal.signal(s, stopped) for s in (signal.SIGTERM, signal.SIGINT)}
        server.run()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        engine.shutdown()              # again, or for the first time if it never started
    return exit_code
