"""``POST /v1/responses``: OpenAI's Responses API, stateless, over the chat path (vLLM:
``entrypoints/openai/responses/serving.py`` ``OpenAIServingResponses``).

Nothing here generates or parses on its own; each step is the chat endpoint's::

    ResponsesRequest ── to_chat_request() ──> ChatCompletionRequest      (protocol_responses.py)
        ── OpenAIServing.render_chat ──> prompt ── _prepare ──> engine.generate
        ── ChoiceParser (reasoning, then tool calls) ──> output items / events  (responses_output.py)

    stream=false   {"id": "resp_…", "object": "response", "status": "completed" | "incomplete",
                    "output": [items], "usage": {"input_tokens", "output_tokens", "total_tokens"}, …}
    stream=true    "event: <type>\\ndata: {…}\\n\\n" per event, ending with response.completed
                   (no [DONE]: the Responses API has none)

``status`` is "incomplete" with ``incomplete_details: {"reason": "max_output_tokens"}`` when
the turn was cut by ``max_output_tokens`` (or the context's end). A forced tool call
(``tool_choice`` "required" or a named function) is constrained to the tools' JSON schema,
as in the chat endpoint, and its calls come whole when the JSON is complete.
"""

from __future__ import annotations

import functools
import json
import time
import uuid
from collections.abc import AsyncIterator

from microvllm.engine.async_llm import EngineDeadError, RequestFailedError
from microvllm.engine.outputs import CompletionOutput, RequestOutput
from microvllm.entrypoints.openai.protocol import ChatCompletionRequest
from microvllm.entrypoints.openai.protocol_responses import ResponsesRequest
from microvllm.entrypoints.openai.responses_output import ResponseStream, output_items
from microvllm.entrypoints.openai.serving import (
    OpenAIServing,
    ServerShuttingDown,
    _chain_async,
    _closing,
    _first,
    _raise_if_aborted,
    error_event,
    merge,
    parse_choice,
)
from microvllm.sampling_params import SamplingParams
from microvllm.tool_parsers.abstract_tool_parser import DeltaFunctionCall, DeltaMessage, DeltaToolCall


class OpenAIServingResponses:
    """``/v1/responses`` for the model ``serving`` (the chat endpoint's object) serves."""

    def __init__(self, serving: OpenAIServing):
        self.serving = serving

    async def create_response(self, request: ResponsesRequest):
        """A response dict, or (stream) an async generator of SSE strings. Raises
        ValueError/TypeError for a bad request before anything is generated."""
        serving, engine = self.serving, self.serving.engine
        if request.max_output_tokens is not None and request.max_output_tokens < 1:
            raise ValueError(f"max_output_tokens must be at least 1, got {request.max_output_tokens}")
        chat = request.to_chat_request()
        if serving.enable_auto_tool_choice:   # as create_chat_completion does
            chat.enable_auto_tool_choice(serving.tool_parser)
        serving.check_chat_size(chat, "input")   # what the chat and its tools hold, before they render
        params = chat.to_sampling_params()
        serving.check_request_size(params)      # n and the output's constraint
        prompt = await engine.run_on_tokenizer_thread(functools.partial(serving.render_chat, chat, "input"))
        prompt = await serving._prepare(prompt, params, request.max_output_tokens, "input", "max_output_tokens")
        response_id = f"resp_{uuid.uuid4().hex}"
        results = merge([engine.generate(prompt, params, response_id,
                                         lora_request=self.serving.lora_request(request.model),
                                         reasoning_parser_kwargs=chat.chat_template_kwargs)])
        first = await _first(results)   # a bad prompt raises here, before any response starts
        head = self._head(request, response_id, params)
        if request.stream:
            return _closing(self._events(chat, head, first, results), results)
        out = first[1]
        async for _, out in results:
            pass
        _raise_if_aborted([out])
        return _finished(head, self._whole_items(chat, out.outputs[0]), out)

    def _head(self, request: ResponsesRequest, response_id: str, params: SamplingParams) -> dict:
        """The response object's fields that do not depend on the output (vLLM's ``from_request``)."""
        return {"id": response_id, "object": "response", "created_at": int(time.time()), "model":
                self.serving.model_name, "status": "in_progress", "error": None, "incomplete_details": None,
                "instructions": request.instructions, "metadata": request.metadata, "output": [],
                "parallel_tool_calls": request.parallel_tool_calls, "temperature": params.temperature,
                "top_p": params.top_p, "tool_choice": request.tool_choice, "tools": request.tools,
                "text": request.text or {"format": {"type": "text"}}, "reasoning": request.reasoning,
                "max_output_tokens": request.max_output_tokens, "previous_response_id": None,
                "background": False, "service_tier": request.service_tier, "truncation": "disabled",
                "user": request.user, "usage": None}

    def _whole_items(self, chat: ChatCompletionRequest, c: CompletionOutput) -> list[dict]:
        reasoning, content, calls = parse_choice(chat, self.serving._choice_parser(chat), c.text)
        return output_items(reasoning, content, [(call["id"], call["function"]["name"], call["function"]["arguments"])
                                                 for call in calls])

    async def _events(self, chat: ChatCompletionRequest, head: dict, first, results) -> AsyncIterator[str]:
        stream = ResponseStream()
        forced = chat.tool_call_schema() is not None
        parser = None if forced else self.serving._choice_parser(chat)
        yield _sse(stream.event("response.created", response=head))
        yield _sse(stream.event("response.in_progress", response=head))
        try:
            out = first[1]
            async for _, out in _chain_async(first, results):
                c = out.outputs[0]
                last = c.finish_reason is not None
                if forced:   # the calls' JSON is only known whole: sent at the end
                    pieces = [_as_delta(i, item) for i, item in enumerate(self._whole_items(chat, c))] if last else []
                elif parser is not None:
                    pieces = [parser.delta(c.delta_text, last=last)]
                else:
                    pieces = [DeltaMessage(content=c.delta_text or None)]
                for piece in pieces:
                    for event in stream.feed(piece):
                        yield _sse(event)
            _raise_if_aborted([out])
            for event in stream.close():
                yield _sse(event)
            yield _sse(stream.event("response.completed", response=_finished(head, stream.items, out)))
        except (RequestFailedError, EngineDeadError, ServerShuttingDown) as error:
            yield _sse(_error_event(stream, error))


def _finished(head: dict, items: list[dict], out: RequestOutput) -> dict:
    """The whole response: ``head`` with its output, status and usage."""
    c = out.outputs[0]
    cut = c.finish_reason == "length"
    input_tokens, output_tokens = len(out.prompt_token_ids), len(c.token_ids)
    return {**head, "status": "incomplete" if cut else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None, "output": items,
            "usage": {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
                      "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": input_tokens + output_tokens}}


def _as_delta(index: int, item: dict) -> DeltaMessage:
    """A whole item (the ``index``-th) as one parsed piece, for ``ResponseStream.feed``."""
    if item["type"] == "function_call":
        return DeltaMessage(tool_calls=[DeltaToolCall(index=index, id=item["call_id"], type="function", function=(
            DeltaFunctionCall(name=item["name"], arguments=item["arguments"])))])
    return DeltaMessage(content=item["content"][0]["text"])


def _error_event(stream: ResponseStream, error: Exception) -> dict:
    """The Responses API's ``error`` event for a stream that failed midway (the chat
    endpoint's ``error_event``, in this API's shape)."""
    body = error_event(error)["error"]
    kind = "ServiceUnavailableError" if isinstance(error, ServerShuttingDown) else body["type"]
    return stream.event("error", code=kind, message=body["message"], param=None)


def _sse(event: dict) -> str:
    """One named server-sent event, as vLLM and OpenAI send the Responses API's."""
    return f"event: {event['type']}\ndata: {json.dumps(event, allow_nan=False)}\n\n"
