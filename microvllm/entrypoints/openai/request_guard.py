"""The request limits (``request_limits.py``), enforced.

uvicorn reads headers without a deadline (its keep-alive timer stops at a connection's
first byte) and hands the body to the app as it comes, however slowly and however much.
Two pieces close that, one per phase of a request::

    connect ─── headers ─────────────┬── body ───────────────────────┬── route
          HeaderTimeout (protocol):      RequestGuard (ASGI middleware):
          408 written to the socket,     408 / 413 as OpenAI errors, then the
          then the connection closed     connection closed; 400 for a body whose
                                         text is broken (json_text.py)

The header timer must live in the protocol: no ASGI code runs until the headers are
complete. The body is read whole by ``RequestGuard`` (FastAPI reads it whole anyway) and
replayed to the app, so its size and time limits hold for every route, before parsing.
"""

from __future__ import annotations

import asyncio
import json

from starlette.responses import JSONResponse

from microvllm.entrypoints.openai.json_text import find_body_problem
from microvllm.entrypoints.openai.protocol import ErrorInfo, ErrorResponse
from microvllm.entrypoints.openai.request_limits import RequestLimits


def _error(status: int, kind: str, message: str, param: str | None = None, close: bool = False) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=kind, param=param, code=status))
    # "connection: close": uvicorn closes after the response, and the unread rest of the body with it
    return JSONResponse(body.model_dump(), status_code=status, headers={"connection": "close"} if close else None)


def _is_json(scope) -> bool:
    """Whether FastAPI will parse this body as JSON (no content type, or ``*/json``, ``*/*+json``)."""
    content_type = dict(scope["headers"]).get(b"content-type", b"").split(b";")[0].strip().lower()
    return not content_type or content_type.endswith((b"/json", b"+json"))


class RequestGuard:
    """ASGI middleware: read the whole body under the size and time limits, check its text,
    then call the app with the body replayed (later ``receive`` calls pass through, so the
    app still hears ``http.disconnect``). The limits are ``app.state.request_limits``
    (``run_server`` sets them from the flags), else the defaults."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limits = getattr(scope["app"].state, "request_limits", None) or RequestLimits()
        limit = limits.max_request_body_bytes
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            return await _too_large(f"the request body is {int(declared)} bytes (Content-Length)", limit)(
                scope, receive, send)
        chunks, size = [], 0
        deadline = asyncio.get_running_loop().time() + limits.request_body_timeout
        while True:
            try:
                message = await asyncio.wait_for(receive(), deadline - asyncio.get_running_loop().time())
            except asyncio.TimeoutError:
                timeout = limits.request_body_timeout
                return await _error(408, "RequestTimeoutError",
                                    f"the request body did not arrive within {timeout:g} s "
                                    f"(--request-body-timeout): {size} bytes came", close=True)(scope, receive, send)
            if message["type"] == "http.disconnect":
                return                          # the client left: nobody to answer
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                return await _too_large(f"the request body passed {limit} bytes", limit)(scope, receive, send)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        problem = find_body_problem(body) if body and _is_json(scope) else None
        if problem is not None:
            return await _error(400, "BadRequestError", problem.message, problem.param)(scope, receive, send)

        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


def _too_large(what: str, limit: int) -> JSONResponse:
    return _error(413, "RequestTooLargeError", f"{what}, more than this server's limit of {limit} bytes "
                  "(--max-request-body-bytes): send less, or raise the limit", close=True)


def with_header_timeout(protocol_class: type, seconds: float) -> type:
    """``protocol_class`` (uvicorn's H11Protocol or HttpToolsProtocol) whose connections
    must deliver a request's headers within ``seconds``: from the connection's start, or
    from the first byte of the next request on a kept-alive one. Both protocols make a new
    ``self.cycle`` when headers complete: that is the signal the timer watches for."""

    class HeaderTimeout(protocol_class):
        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm_header_timer()

        def data_received(self, data: bytes) -> None:
            between_requests = self.cycle is None or self.cycle.response_complete
            cycle = self.cycle
            super().data_received(data)
            if self.cycle is not cycle:                       # a request's headers completed
                self._cancel_header_timer()
            elif between_requests and getattr(self, "_header_timer", None) is None:
                self._arm_header_timer()                      # the next request's headers began

        def connection_lost(self, exc) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

        def _arm_header_timer(self) -> None:
            self._header_timer = self.loop.call_later(seconds, self._headers_too_slow, self.cycle)

        def _cancel_header_timer(self) -> None:
            timer, self._header_timer = getattr(self, "_header_timer", None), None
            if timer is not None:
                timer.cancel()

        def _headers_too_slow(self, cycle) -> None:
            self._header_timer = None
            if self.cycle is not cycle or self.transport.is_closing():
                return                                        # headers came (pipelined), or it is over
            body = json.dumps(ErrorResponse(error=ErrorInfo(
                message=f"the request headers did not arrive within {seconds:g} s (--request-header-timeout)",
                type="RequestTimeoutError", code=408)).model_dump()).encode()
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                                 b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
            self.transport.close()

    HeaderTimeout.__name__ = HeaderTimeout.__qualname__ = f"HeaderTimeout{protocol_class.__name__}"
    return HeaderTimeout
