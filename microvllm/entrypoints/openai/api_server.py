"""``microvllm serve``: an OpenAI-compatible HTTP server on FastAPI + uvicorn
(vLLM: ``entrypoints/openai/api_server.py``).

    microvllm serve [MODEL] --host 127.0.0.1 --port 8000 [engine flags]

    GET  /health                200 while the engine runs, 503 once it failed
    GET  /v1/models             the one served model
    POST /v1/completions        prompt(s) -> text         (stream=true: server-sent events)
    POST /v1/chat/completions   messages  -> a reply      (stream=true: server-sent events)
    GET  /metrics               Prometheus text: queue sizes, KV usage, TTFT, ITL, tokens

Errors have OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: a
bad field or malformed JSON is a 400 that names the field; an unknown model a 404.
SIGTERM (or Ctrl-C): uvicorn stops accepting, gives open streams a few seconds to
finish, then the engine aborts what is left and the process exits.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import re
import signal
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from microvllm.engine.arg_utils import EngineArgs
from microvllm.engine.async_llm import AsyncLLM, EngineDeadError
from microvllm.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, ErrorInfo,
                                                   ErrorResponse, ModelCard, ModelList)
from microvllm.entrypoints.openai.serving import OpenAIServing

logger = logging.getLogger(__name__)
EMBEDDED_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"


def error_response(status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=kind, param=param, code=status))
    return JSONResponse(body.model_dump(), status_code=status)


def bad_request(error: Exception, fields) -> JSONResponse:
    """HTTP 400 with the engine's message; ``param`` is the field it starts with."""
    message = str(error)
    first = re.match(r"[\w.]+", message)
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


def build_app(engine: AsyncLLM, model_name: str) -> FastAPI:
    """The FastAPI app serving ``engine`` under ``model_name``."""
    serving = OpenAIServing(engine, model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        engine.shutdown()   # after uvicorn stopped serving: abort what is left, stop the thread

    app = FastAPI(title="microvllm", lifespan=lifespan)
    app.state.engine = engine

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

    def unknown_model(name: str | None) -> JSONResponse | None:
        if name is None or name == model_name:
            return None
        return error_response(404, f"The model `{name}` does not exist: this server serves `{model_name}`.",
                              "NotFoundError", "model")

    async def respond(request, raw_request: Request, create):
        if (missing := unknown_model(request.model)) is not None:
            return missing
        if not engine.is_running:
            return error_response(503, "the engine is not running", "ServiceUnavailableError")
        try:
            result = await until_disconnected(raw_request, create(request))
        except ClientGone:
            return PlainTextResponse("", status_code=499)   # nobody reads it: nginx's "client closed"
        except (ValueError, TypeError) as error:
            return bad_request(error, type(request).model_fields)
        except EngineDeadError as error:
            return error_response(503, str(error), "ServiceUnavailableError")
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(result, media_type="text/event-stream")

    @app.get("/health")
    async def health():
        if not engine.is_running:
            return PlainTextResponse("engine not running", status_code=503)
        return PlainTextResponse("")

    @app.get("/v1/models")
    async def models():
        max_model_len = engine.engine.config.scheduler_config.max_model_len
        card = ModelCard(id=model_name, root=model_name, max_model_len=max_model_len)
        return ModelList(data=[card]).model_dump()

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, raw_request: Request):
        return await respond(request, raw_request, serving.create_completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw_request: Request):
        return await respond(request, raw_request, serving.create_chat_completion)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(engine.metrics.render(model_name),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def run_server(args: argparse.Namespace) -> int:
    """Build the engine (loading the model), then serve until SIGTERM or Ctrl-C."""
    import uvicorn

    engine_args = EngineArgs.from_cli_args(args)
    if args.model_tag is not None:
        engine_args.model = args.model_tag
    engine = AsyncLLM.from_engine_args(engine_args)
    model_name = args.served_model_name or engine_args.model or EMBEDDED_MODEL_NAME
    app = build_app(engine, model_name)
    logger.info("serving %s on http://%s:%d", model_name, args.host, args.port)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout)
    # uvicorn catches SIGTERM / SIGINT, stops gracefully, then raises the signal again
    # with the handlers that were there before it: these make that a normal exit (status 0).
    stopped = lambda signum, frame: logger.info("stopped by signal %d", signum)  # noqa: E731
    previous = {s: signal.signal(s, stopped) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        uvicorn.Server(config).run()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        engine.shutdown()              # again, in case the server never started
    return 0
