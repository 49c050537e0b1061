"""``/v1/completions`` and ``/v1/chat/completions`` over ``AsyncLLM`` (vLLM:
``serving_completion.py``, ``serving_chat.py``).

One request, one or more engine requests (one per prompt), each an async generator
of ``RequestOutput``s. ``merge`` interleaves them as they come::

    prompt 0 ── out, out, out (finished)  ─┐
    prompt 1 ── out, out (finished)       ─┼─> (0, out) (1, out) (0, out) ...
                                           ┘
    stream=false: keep the last output of each, answer once
    stream=true:  one SSE event per output ("data: {...}\\n\\n"), then "data: [DONE]"

Before anything reaches the engine, every prompt is tokenized off the engine's thread
(``AsyncLLM.process_prompt``) and checked against the context: a request for more
tokens than ``max_model_len`` leaves is a 400, as in vLLM. A choice's index is
``prompt_index * n + sample_index``. If the client goes away, the response's task is
cancelled, ``merge`` cancels its generators, and each ``AsyncLLM.generate`` aborts its
request (its KV blocks are freed). A stream that fails midway ends with an error event
and ``data: [DONE]``; one the server aborts (shutting down) with ``finish_reason: "abort"``.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import time
from collections.abc import AsyncIterator

import jinja2

from microvllm import envs
from microvllm.engine.async_llm import AsyncLLM, EngineDeadError, RequestFailedError
from microvllm.engine.outputs import CompletionOutput, RequestOutput
from microvllm.entrypoints.openai.chat_parsing import ChoiceParser, delta_dict, tool_call_dict
from microvllm.entrypoints.openai.chat_utils import parse_chat_messages
from microvllm.entrypoints.openai.forced_tool_calls import ForcedToolCallStream, forced_tool_calls
from microvllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, random_id
from microvllm.entrypoints.openai.request_template import RenderError, render_bounded, request_chat_template
from microvllm.entrypoints.openai.serving_models import OpenAIServingModels
from microvllm.lora.request import LoRARequest
from microvllm.sampling_params import SamplingParams
from microvllm.structured_output.limits import check_spec
from microvllm.tool_parsers.abstract_tool_parser import DeltaMessage

logger = logging.getLogger(__name__)


async def merge(generators: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """Yield ``(index, item)`` from several async generators as items arrive."""
    if len(generators) == 1:
        try:
            async for item in generators[0]:
                yield 0, item
        finally:
            await generators[0].aclose()   # closed early (client gone): abort at once, not at GC
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def drain(index, gen):
        try:
            async for item in gen:
                await queue.put((index, item))
            await queue.put((index, done))
        except Exception as error:  # noqa: BLE001 - re-raised below, in the consumer
            await queue.put((index, error))

    tasks = [asyncio.create_task(drain(i, g)) for i, g in enumerate(generators)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def sse(data: dict | str) -> str:
    """One server-sent event. ``allow_nan=False``: Python's json would write NaN or
    -Infinity, which no JSON parser reads; a non-finite float raises here instead (the
    non-streamed path, Starlette's ``JSONResponse``, refuses them the same way)."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, allow_nan=False)}\n\n"


# JSON has no NaN or Infinity. Logprobs are the model's raw ones (before any grammar or
# other rule), finite whenever its logits are; but a model can still give -inf (a logit
# of -inf, or a probability below float32's range) or NaN (a broken forward pass). Such a
# value is reported as vLLM's floor, -9999.0: "no chance at all", and valid JSON.
LOGPROB_FLOOR = -9999.0


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else LOGPROB_FLOOR


class OpenAIServing:
    """The two generation endpoints of one served model."""

    def __init__(self, engine: AsyncLLM, model_name: str, chat_template: str | None = None, *,
                 enable_auto_tool_choice: bool = False, tool_parser: type | None = None,
                 reasoning_parser: type | None = None, trust_request_chat_template: bool = False):
        self.engine = engine
        self.model_name = model_name
        self.chat_template = chat_template   # --chat-template: replaces the model's
        # --trust-request-chat-template: a request may bring its own (rendered bounded)
        self.trust_request_chat_template = trust_request_chat_template
        self.max_model_len = engine.engine.config.scheduler_config.max_model_len
        # The longest text that could fit the context (what a rendered chat may be)
        self.max_text_chars = engine.engine.input_processor.max_text_chars()
        # --enable-auto-tool-choice --tool-call-parser NAME, --reasoning-parser NAME (chat_parsing.py)
        self.enable_auto_tool_choice, self.tool_parser = enable_auto_tool_choice, tool_parser
        self.reasoning_parser = reasoning_parser
        # The served names: the base model's and LoRA adapters' (build_app sets it).
        self.models: OpenAIServingModels | None = None
        self._templates_warned: set[str | None] = set()   # templates that dropped the tools (warned once)

    def lora_request(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's ``model`` names (None: the base model)."""
        return self.models.lora_request(model) if self.models is not None else None

    def _choice_parser(self, request: ChatCompletionRequest) -> ChoiceParser | None:
        """One choice's parsers, or None when the server has none for this request."""
        parse_tools = request.parses_tool_calls()
        if self.reasoning_parser is None and not parse_tools:
            return None
        return ChoiceParser(self.reasoning_parser, self.tool_parser, parse_tools=parse_tools,
                            chat_template_kwargs=request.chat_template_kwargs, request=request)

    def _decode_one(self, token_id: int) -> str:
        tokenizer = self.engine.tokenizer
        return tokenizer.decode([token_id], skip_special_tokens=False) if tokenizer is not None else ""

    # ---------------------------------------------------------- prompts
    def check_request_size(self, params: SamplingParams) -> None:
        """Work one request may ask for, checked before any of it is done: ``n`` at most
        ``$VLLM_MAX_N_SEQUENCES`` (vLLM's name; default 64 here); a constraint on the output
        (``response_format``, required tools, strict tools' structural tag) within the
        grammar limits (``structured_output/limits.py``), before the chat is even rendered."""
        max_n = envs.max_n_sequences()
        if params.n > max_n:
            raise ValueError(f"n={params.n} is more than this server allows ({max_n}, set by "
                             "$VLLM_MAX_N_SEQUENCES): ask for fewer samples per request")
        structured = params.structured_outputs
        if structured is not None:
            check_spec(structured, structured.spec, self.engine.engine.config.structured_outputs_config)

    async def _prepare(self, prompt, params: SamplingParams, max_tokens: int | None, where: str,
                       max_tokens_field: str = "max_tokens") -> dict:
        """Tokenize off the engine thread, then check the request fits the context. ``where``:
        the request's field that holds the prompt ("prompt", "messages", "input");
        ``max_tokens_field``: the one that holds ``max_tokens``, as the client named it."""
        processed = await self.engine.process_prompt(prompt, params)
        num_prompt_tokens = len(processed["prompt_token_ids"])
        if num_prompt_tokens >= self.max_model_len:
            raise ValueError(f"{where}: the {where} has {num_prompt_tokens} tokens but this model's maximum "
                             f"context length (max_model_len) is {self.max_model_len}, with room needed for "
                             f"at least one new token: shorten the {where}")
        if max_tokens is not None and num_prompt_tokens + max_tokens > self.max_model_len:
            raise ValueError(
                f"{max_tokens_field}: this model's maximum context length is {self.max_model_len} tokens; you "
                f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the {where}, "
                f"{max_tokens} in the completion): reduce the length of the {where} or {max_tokens_field}")
        return processed

    # ------------------------------------------------------- completions
    async def create_completion(self, request: CompletionRequest):
        """A response dict, or (stream) an async generator of SSE strings. Raises
        ValueError/TypeError for a bad request before anything is generated."""
        params = request.to_sampling_params()
        prompts = request.prompts()
        if not prompts:
            raise ValueError("prompt must not be empty")
        self.check_request_size(params)
        scoring_only = request.max_tokens == 0
        prepared = [await self._prepare(p, params, None if scoring_only else request.max_tokens, "prompt")
                    for p in prompts]
        request_id = random_id("cmpl")
        lora = self.lora_request(request.model)
        generators = [self.engine.generate(p, params, f"{request_id}-{i}", lora_request=lora)
                      for i, p in enumerate(prepared)]
        results = merge(generators)
        first = await _first(results)   # a bad prompt raises here, before any response starts
        if request.stream:
            return _closing(self._completion_events(request, request_id, first, results, params.n), results)
        finals: dict[int, RequestOutput] = {}
        async for index, out in _chain_async(first, results):
            finals[index] = out
        _raise_if_aborted(finals.values())
        choices, prompt_tokens, completion_tokens = [], 0, 0
        for index in sorted(finals):
            out = finals[index]
            prompt_tokens += len(out.prompt_token_ids)
            for c in out.outputs:
                token_ids = [] if scoring_only else c.token_ids
                completion_tokens += len(token_ids)
                text = "" if scoring_only else c.text
                logprobs = None
                if params.logprobs is not None:
                    logprobs = _completion_logprobs(c, 0, out if request.echo else None, scoring_only,
                                                    self._decode_one)
                choices.append({"index": index * params.n + c.index,
                                "text": (out.prompt or "") + text if request.echo else text,
                                "logprobs": logprobs,
                                "finish_reason": "length" if scoring_only else c.finish_reason,
                                "stop_reason": None if scoring_only else c.stop_reason,
                                # 0 is on (each prompt token's own logprob), as in vLLM
                                "prompt_logprobs": (_prompt_logprobs(out) if request.prompt_logprobs is not None
                                                    else None)})
        response = {"id": request_id, "object": "text_completion", "created": int(time.time()),
                    "model": self.model_name, "choices": choices,
                    "usage": _usage(prompt_tokens, completion_tokens)}
        if finals[min(finals)].kv_transfer_params is not None:   # a prefill instance: where its KV waits
            response["kv_transfer_params"] = finals[min(finals)].kv_transfer_params
        return response

    def _completion_events(self, request, request_id, first, results, n) -> AsyncIterator[str]:
        created, prompt_tokens, completion_tokens = int(time.time()), {}, {}
        progress = StreamProgress()   # keyed by (prompt, sample)
        head = {"id": request_id, "object": "text_completion", "created": created, "model": self.model_name}
        continuous = _continuous_usage(request.stream_options)

        def usage() -> dict:   # so far: every prompt and every choice seen until now
            return _usage(sum(prompt_tokens.values()), sum(completion_tokens.values()))

        async def chunks():
            async for index, out in _chain_async(first, results):
                prompt_tokens[index] = len(out.prompt_token_ids)
                choices = []
                for c in out.outputs:
                    key = (index, c.index)
                    start = progress.advance(key, c)
                    if start is None:
                        continue
                    completion_tokens[key] = len(c.token_ids)
                    echo = request.echo and start == 0
                    text = ((out.prompt or "") if echo else "") + c.delta_text
                    logprobs = None
                    if c.logprobs is not None:
                        logprobs = _completion_logprobs(c, start, out if echo else None, decode=self._decode_one)
                    choices.append({"index": index * n + c.index, "text": text, "logprobs": logprobs,
                                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
                if choices:
                    yield {**head, "choices": choices, "usage": usage() if continuous else None}

        return _sse_stream(chunks(), head, request.stream_options, usage)

    # -------------------------------------------------------------- chat
    def render_chat(self, request: ChatCompletionRequest, where: str = "messages") -> dict:
        """The chat as text and token ids; raises ``ValueError`` naming what to change (``where``:
        the field the client wrote the chat in, "messages" or /v1/responses' "input").

        What the client sent is measured before anything runs on it, and what the template
        made is measured before the tokenizer sees it::

            (before: check_chat_size, the messages' text and the tools' JSON)
            a template in the request     -> refused unless --trust-request-chat-template,
                                             then rendered bounded (request_template.py)
            the rendered text             -> check_text_fits   (a template can make any length)
            tokenize
        """
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError("this model has no tokenizer, so chat messages cannot be rendered")
        messages = parse_chat_messages([m.model_dump(exclude_none=True) for m in request.messages])
        template_kwargs = dict(request.chat_template_kwargs or {})
        request_template = request_chat_template(request.chat_template, template_kwargs.pop("chat_template", None),
                                                 self.trust_request_chat_template)
        chat_template = request_template or self.chat_template
        if request.tools and request.tool_choice != "none":
            template_kwargs.setdefault("tools", request.tools)   # templates that know tools list them
        render = functools.partial(tokenizer.render_chat_template, messages, request.add_generation_prompt,
                                   chat_template=chat_template,
                                   continue_final_message=request.continue_final_message,
                                   chat_template_kwargs=template_kwargs)
        which = "the chat_template given" if request_template else (
            "the server's --chat-template" if chat_template else "the model's chat template")
        try:
            text = render_bounded(render, self.max_text_chars) if request_template is not None else render()
        except (jinja2.TemplateSyntaxError, RenderError) as error:
            if isinstance(error, jinja2.TemplateSyntaxError) or error.kind == "TemplateSyntaxError":
                raise ValueError(f"chat_template is not a valid Jinja template (line {error.lineno}: "
                                 f"{error.message}): fix or remove chat_template") from None
            raise ValueError(f"{where}: {which} cannot render these messages ({error.kind}: {error.message}): "
                             f"change the {where} or pass another chat_template") from None
        except (jinja2.TemplateError, TypeError, KeyError, IndexError, AttributeError) as error:
            raise ValueError(f"{where}: {which} cannot render these messages ({type(error).__name__}: "
                             f"{error}): change the {where} or pass another chat_template") from None
        self.engine.engine.check_text_fits(len(text), f"{where}: the chat as {which} rendered it", f"the {where}")
        if request.parses_tool_calls():
            self._warn_if_tools_unseen(request, text, chat_template)
        # The template wrote the special tokens itself: none are added when encoding.
        return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}

    def check_chat_size(self, request: ChatCompletionRequest, where: str = "messages") -> None:
        """``ValueError`` if the chat's text and its tools' JSON could not fit the context,
        known before anything renders them: 8 MB of messages or 10 MB of tools once took
        seconds and gigabytes to render and tokenize (and a grammar compile, 20 GB)."""
        chat_chars = sum(_text_chars(m.content) for m in request.messages)
        tools_chars = len(json.dumps(request.tools)) if request.tools else 0
        if not tools_chars:
            self.engine.engine.check_text_fits(chat_chars, f"{where}: the chat")
            return
        self.engine.engine.check_text_fits(
            chat_chars + tools_chars, f"tools: the chat with its {len(request.tools):,} tools "
            f"({tools_chars:,} characters of tools)", f"the {where} or send fewer or shorter tools")

    def _warn_if_tools_unseen(self, request: ChatCompletionRequest, prompt: str, chat_template: str | None) -> None:
        """A template that leaves ``tools`` out of the prompt: the model cannot know it may
        call them and answers in plain text. Said once per template, in the server's log."""
        names = [tool["function"]["name"] for tool in request.tools or []]
        if any(name in prompt for name in names) or chat_template in self._templates_warned:
            return
        self._templates_warned.add(chat_template)
        logger.warning("tool_choice='auto': the chat template wrote none of the tools (%s) into the prompt, so the "
                       "model cannot know it may call them and will answer in plain text; serve with a "
                       "--chat-template that renders `tools`", ", ".join(names))

    async def create_chat_completion(self, request: ChatCompletionRequest):
        if self.enable_auto_tool_choice:
            request.enable_auto_tool_choice(self.tool_parser)
        self.check_chat_size(request)
        params = request.to_sampling_params()
        self.check_request_size(params)
        prompt = await self.engine.run_on_tokenizer_thread(functools.partial(self.render_chat, request))
        prompt = await self._prepare(prompt, params, request.requested_max_tokens, "messages")
        request_id = random_id("chatcmpl")
        results = merge([self.engine.generate(prompt, params, request_id,
                                              lora_request=self.lora_request(request.model),
                                              reasoning_parser_kwargs=request.chat_template_kwargs)])
        first = await _first(results)
        if request.stream:
            return _closing(self._chat_events(request, request_id, first, results, params.logprobs), results)
        out = first[1]
        async for _, out in results:
            pass
        _raise_if_aborted([out])
        choices = []
        for c in out.outputs:
            parser = self._choice_parser(request)
            reasoning, content, tool_calls = parse_choice(request, parser, c.text)
            message = {"role": "assistant", "content": content}
            if parser is not None:   # reasoning, then the model's own tool calls in the rest
                message.update(reasoning=reasoning, tool_calls=tool_calls)
            elif tool_calls:
                message["tool_calls"] = tool_calls
            # OpenAI's (and vLLM's): "tool_calls" when calls ended the turn, but "stop" for a named function's
            named = request.called_function() is not None
            finish_reason = "tool_calls" if tool_calls and c.finish_reason == "stop" and not named else c.finish_reason
            choices.append({"index": c.index, "message": message,
                            "logprobs": _chat_logprobs(c, 0, params.logprobs) if params.logprobs is not None else None,
                            "finish_reason": finish_reason, "stop_reason": c.stop_reason})
        response = {"id": request_id, "object": "chat.completion", "created": int(time.time()),
                    "model": self.model_name, "choices": choices,
                    "usage": _usage(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs))}
        if request.prompt_logprobs is not None:   # 0 is on: each prompt token's own logprob (vLLM)
            response["prompt_logprobs"] = _prompt_logprobs(out)
        if out.kv_transfer_params is not None:   # a prefill instance: where its KV waits
            response["kv_transfer_params"] = out.kv_transfer_params
        return response

    def _chat_events(self, request, request_id, first, results, top_n) -> AsyncIterator[str]:
        """The chat stream: per choice, each piece of text as reasoning, content or tool-call
        pieces (``delta_dict``); a forced call (``tool_choice`` required or named) streams its
        name, then its arguments, as the JSON grows (``forced_tool_calls.py``)."""
        created = int(time.time())
        head = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": self.model_name}
        last = {"out": first[1]}
        continuous = _continuous_usage(request.stream_options)
        parsers = {i: self._choice_parser(request) for i in range(request.n)}
        forced = ({i: ForcedToolCallStream(request.called_function()) for i in range(request.n)}
                  if request.tool_call_schema() is not None else None)

        async def chunks():
            role = {**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                         "logprobs": None, "finish_reason": None} for i in range(request.n)]}
            if continuous:   # vLLM's first chunk: no completion token yet
                role["usage"] = _usage(len(first[1].prompt_token_ids), 0)
            yield role
            progress = StreamProgress()   # keyed by the choice's index
            async for _, out in _chain_async(first, results):
                last["out"] = out
                choices = []
                for c in out.outputs:
                    start = progress.advance(c.index, c)
                    if start is None:
                        continue
                    logprobs = _chat_logprobs(c, start, top_n) if top_n is not None else None
                    parser, finish_reason = parsers[c.index], c.finish_reason
                    if parser is None and forced is None:   # plain text
                        choices.append({"index": c.index, "delta": {"content": c.delta_text}, "logprobs": logprobs,
                                        "finish_reason": finish_reason, "stop_reason": c.stop_reason})
                        continue
                    if parser is not None:   # reasoning, content and (auto) tool-call pieces
                        piece = parser.delta(c.delta_text, last=finish_reason is not None)
                        if parser.tools_called and finish_reason == "stop":
                            finish_reason = "tool_calls"
                    else:
                        piece = DeltaMessage(content=c.delta_text or None)
                    if forced is not None:   # the content is the calls' JSON: read as calls
                        calls = forced[c.index]
                        piece = DeltaMessage(reasoning=piece.reasoning, tool_calls=calls.feed(piece.content or ""))
                        finish_reason = calls.finish_reason(finish_reason)
                    if request.parallel_tool_calls is False:   # vLLM: only the first call goes out
                        piece.tool_calls = [call for call in piece.tool_calls if call.index == 0]
                    fields = delta_dict(piece)
                    if not fields and finish_reason is None and logprobs is None:
                        continue   # nothing to send yet (a tag held back, a call's name not whole)
                    choices.append({"index": c.index, "delta": fields, "logprobs": logprobs,
                                    "finish_reason": finish_reason, "stop_reason": c.stop_reason})
                if choices:
                    yield {**head, "choices": choices, "usage": usage() if continuous else None}

        def usage() -> dict:
            out = last["out"]
            return _usage(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs))

        return _sse_stream(chunks(), head, request.stream_options, usage)


# ------------------------------------------------------------------ helpers
def _text_chars(content) -> int:
    """Characters of text in a message's content: a string, or a list of parts."""
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(_text_chars(part.get("text")) if isinstance(part, dict) else _text_chars(part)
                   for part in content)
    return 0


class StreamProgress:
    """What each choice of a stream has sent, so that every token goes out once and every
    choice ends once. Each ``RequestOutput`` of an n > 1 request carries all n choices,
    the finished ones too, unchanged, until the last one finishes::

        output   choice 0 (tokens, finish)    choice 1          advance() says
          1      [a b]      None              [x]      None     0: from 0    1: from 0
          2      [a b c]    "stop"            [x y]    None     0: from 2    1: from 1
          3      [a b c]    "stop"  (again)   [x y z]  "stop"   0: None      1: from 2
                                  ^ already ended: sending it again repeats its last
                                    chunk (a tool call's arguments twice, a 2nd finish)
    """

    def __init__(self):
        self.sent: dict = {}      # key -> number of tokens already sent
        self.ended: set = set()   # keys whose finish_reason was sent

    def advance(self, key, c: CompletionOutput) -> int | None:
        """The index of ``c``'s first unsent token, or None if ``c`` has nothing to send
        (no new token and no finish yet, or it has already ended)."""
        start = self.sent.get(key, 0)
        if key in self.ended or (len(c.token_ids) == start and c.finish_reason is None):
            return None
        self.sent[key] = len(c.token_ids)
        if c.finish_reason is not None:
            self.ended.add(key)
        return start


def _continuous_usage(stream_options) -> bool:
    """``stream_options: {"include_usage": true, "continuous_usage_stats": true}`` (vLLM's):
    every chunk carries the usage so far (the request's prompt tokens and the completion
    tokens sent up to and with it), besides the usage chunk at the end."""
    return stream_options is not None and stream_options.include_usage and stream_options.continuous_usage_stats


async def _sse_stream(chunks: AsyncIterator[dict], head: dict, stream_options, usage) -> AsyncIterator[str]:
    """Server-sent events: each chunk; then the usage chunk if asked for; a stream that
    fails midway ends with an error event instead; always ``data: [DONE]`` last."""
    try:
        async for chunk in chunks:
            yield sse(chunk)
    except (RequestFailedError, EngineDeadError) as error:
        yield sse(error_event(error))
    else:
        if stream_options is not None and stream_options.include_usage:
            yield sse({**head, "choices": [], "usage": usage()})
    yield sse("[DONE]")


def parse_choice(request: ChatCompletionRequest, parser: ChoiceParser | None,
                 text: str) -> tuple[str | None, str | None, list[dict]]:
    """A whole choice's (reasoning, content, tool calls as the API writes them): the
    reasoning split off first (``--reasoning-parser``); then the calls the model wrote in
    its own format (``tool_choice="auto"``, the tool parser) or, when a call was required,
    the JSON the content was constrained to (``forced_tool_calls``). With
    ``parallel_tool_calls: false`` only the first call is kept (vLLM's rule)."""
    reasoning, content, calls = None, text, []
    if parser is not None:
        reasoning, content, parsed = parser.whole(text)
        calls = [tool_call_dict(call) for call in parsed]
    if request.tool_call_schema() is not None:
        content, calls = None, forced_tool_calls(request.called_function(), content or "")
    if request.parallel_tool_calls is False:
        calls = calls[:1]
    return reasoning, content, calls


class ServerShuttingDown(RuntimeError):
    """A non-streamed request the server aborted because it is shutting down."""


def error_event(error: Exception) -> dict:
    """The last event of a stream that failed midway (vLLM sends the same shape)."""
    if isinstance(error, EngineDeadError):
        kind, code = "ServiceUnavailableError", 503
    elif isinstance(error, ValueError):   # RequestRejectedError: the request's own fault (its grammar)
        kind, code = "BadRequestError", 400
    else:
        kind, code = "InternalServerError", 500
    return {"error": {"message": str(error), "type": kind, "param": None, "code": code}}


def _raise_if_aborted(outputs) -> None:
    if any(c.finish_reason == "abort" for out in outputs for c in out.outputs):
        raise ServerShuttingDown("the server is shutting down and aborted this request: retry it")


async def _closing(events: AsyncIterator[str], results) -> AsyncIterator[str]:
    """Stream ``events``; however the stream ends, close ``results``: when the client went
    away mid-stream, that aborts its requests now."""
    try:
        async for event in events:
            yield event
    finally:
        await results.aclose()


async def _first(results):
    try:
        return await results.__anext__()
    except StopAsyncIteration:
        raise RuntimeError("the engine returned no output for the request") from None


async def _chain_async(first, results):
    yield first
    async for item in results:
        yield item


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _completion_logprobs(c: CompletionOutput, start: int, echoed: RequestOutput | None = None,
                         scoring_only: bool = False, decode=None) -> dict:
    """OpenAI's legacy completions form for tokens ``start:`` of ``c``; with ``echoed``
    (echo=true), the prompt's tokens first (the very first has no logprob: None).
    ``text_offset[i]`` is where token i's text starts in the choice's ``text``."""
    tokens, token_logprobs, top = [], [], []
    if echoed is not None:
        for position, token_id in enumerate(echoed.prompt_token_ids):
            row = echoed.prompt_logprobs[position] if echoed.prompt_logprobs else None
            # The first prompt token has no row (nothing predicts it): decode it alone.
            tokens.append(_token_text(row, token_id) if row or decode is None else decode(token_id))
            token_logprobs.append(_finite(row[token_id].logprob) if row else None)
            top.append({lp.decoded_token: _finite(lp.logprob) for lp in row.values()} if row else None)
    if not scoring_only:
        for token_id, row in zip(c.token_ids[start:], (c.logprobs or [])[start:]):
            tokens.append(_token_text(row, token_id))
            token_logprobs.append(_finite(row[token_id].logprob) if token_id in row else None)
            top.append({lp.decoded_token: _finite(lp.logprob) for lp in row.values()})
    offsets, offset = [], 0
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def _token_text(row, token_id: int) -> str:
    chosen = row.get(token_id) if row else None
    return (chosen.decoded_token if chosen else "") or ""


def _prompt_logprobs(out: RequestOutput) -> list | None:
    """vLLM's ``prompt_logprobs`` in JSON: per position ``{id: {logprob, rank, decoded_token}}``."""
    if out.prompt_logprobs is None:
        return None
    return [None if row is None else {str(t): {"logprob": _finite(lp.logprob), "rank": lp.rank,
                                               "decoded_token": lp.decoded_token}
                                      for t, lp in row.items()}
            for row in out.prompt_logprobs]


def _chat_logprobs(c: CompletionOutput, start: int, top_n: int) -> dict:
    """OpenAI's chat form for tokens ``start:`` of ``c``:
    ``{"content": [{token, logprob, bytes, top_logprobs: [the top_n, by rank]}]}``."""
    def entry(lp) -> dict:
        token = lp.decoded_token or ""
        return {"token": token, "logprob": _finite(lp.logprob), "bytes": list(token.encode())}

    content = []
    for token_id, row in zip(c.token_ids[start:], (c.logprobs or [])[start:]):
        top = sorted((lp for lp in row.values() if lp.rank is not None and lp.rank <= top_n),
                     key=lambda lp: lp.rank)
        content.append({**entry(row[token_id]), "top_logprobs": [entry(lp) for lp in top]})
    return {"content": content}
