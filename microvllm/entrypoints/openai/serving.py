"""``/v1/completions`` and ``/v1/chat/completions`` over ``AsyncLLM`` (vLLM:
``serving_completion.py``, ``serving_chat.py``).

One request, one or more engine requests (one per prompt), each an async generator
of ``RequestOutput``s. ``merge`` interleaves them as they come::

    prompt 0 ── out, out, out (finished)  ─┐
    prompt 1 ── out, out (finished)       ─┼─> (0, out) (1, out) (0, out) ...
                                           ┘
    stream=false: keep the last output of each, answer once
    stream=true:  one SSE event per output ("data: {...}\\n\\n"), then "data: [DONE]"

A choice's index is ``prompt_index * n + sample_index``, as in vLLM. If the client goes
away, the response's task is cancelled, ``merge`` cancels its generators, and each
``AsyncLLM.generate`` aborts its request (its KV blocks are freed).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

from microvllm.engine.async_llm import AsyncLLM
from microvllm.engine.outputs import CompletionOutput, RequestOutput
from microvllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, random_id


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
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


class OpenAIServing:
    """The two generation endpoints of one served model."""

    def __init__(self, engine: AsyncLLM, model_name: str):
        self.engine = engine
        self.model_name = model_name

    # ------------------------------------------------------- completions
    async def create_completion(self, request: CompletionRequest):
        """A response dict, or (stream) an async generator of SSE strings. Raises
        ValueError/TypeError for a bad request before anything is generated."""
        params = request.to_sampling_params()
        prompts = request.prompts()
        if not prompts:
            raise ValueError("prompt must not be empty")
        request_id = random_id("cmpl")
        generators = [self.engine.generate(p, params, f"{request_id}-{i}") for i, p in enumerate(prompts)]
        results = merge(generators)
        first = await _first(results)   # a bad prompt raises here, before any response starts
        if request.stream:
            return _closing(self._completion_events(request, request_id, first, results, params.n), results)
        finals: dict[int, RequestOutput] = {}
        async for index, out in _chain_async(first, results):
            finals[index] = out
        choices, prompt_tokens, completion_tokens = [], 0, 0
        for index in sorted(finals):
            out = finals[index]
            prompt_tokens += len(out.prompt_token_ids)
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                text = (out.prompt or "") + c.text if request.echo else c.text
                choices.append({"index": index * params.n + c.index, "text": text,
                                "logprobs": _completion_logprobs(c, 0) if params.logprobs is not None else None,
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        return {"id": request_id, "object": "text_completion", "created": int(time.time()),
                "model": self.model_name, "choices": choices,
                "usage": _usage(prompt_tokens, completion_tokens)}

    async def _completion_events(self, request, request_id, first, results, n) -> AsyncIterator[str]:
        created, prompt_tokens, completion_tokens = int(time.time()), {}, {}
        sent: dict[tuple[int, int], int] = {}   # (prompt, sample) -> tokens already sent
        async for index, out in _chain_async(first, results):
            prompt_tokens[index] = len(out.prompt_token_ids)
            choices = []
            for c in out.outputs:
                key = (index, c.index)
                start = sent.get(key, 0)
                if len(c.token_ids) == start and c.finish_reason is None:
                    continue
                sent[key] = len(c.token_ids)
                completion_tokens[key] = len(c.token_ids)
                text = c.delta_text
                if request.echo and start == 0:
                    text = (out.prompt or "") + text
                choices.append({"index": index * n + c.index, "text": text,
                                "logprobs": _completion_logprobs(c, start) if c.logprobs is not None else None,
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
            if choices:
                yield sse({"id": request_id, "object": "text_completion", "created": created,
                           "model": self.model_name, "choices": choices, "usage": None})
        if request.stream_options is not None and request.stream_options.include_usage:
            yield sse({"id": request_id, "object": "text_completion", "created": created,
                       "model": self.model_name, "choices": [],
                       "usage": _usage(sum(prompt_tokens.values()), sum(completion_tokens.values()))})
        yield sse("[DONE]")

    # -------------------------------------------------------------- chat
    def render_chat(self, request: ChatCompletionRequest) -> dict:
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError("this model has no tokenizer, so chat messages cannot be rendered")
        if not request.messages:
            raise ValueError("messages must hold at least one message")
        messages = [m.model_dump(exclude_none=True) for m in request.messages]
        return tokenizer.chat_prompt(
            messages, request.add_generation_prompt, chat_template=request.chat_template,
            continue_final_message=request.continue_final_message,
            chat_template_kwargs=request.chat_template_kwargs)

    async def create_chat_completion(self, request: ChatCompletionRequest):
        params = request.to_sampling_params()
        prompt = self.render_chat(request)
        request_id = random_id("chatcmpl")
        results = merge([self.engine.generate(prompt, params, request_id)])
        first = await _first(results)
        if request.stream:
            return _closing(self._chat_events(request, request_id, first, results, params.logprobs), results)
        out = first[1]
        async for _, out in results:
            pass
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": _chat_logprobs(c, 0, params.logprobs) if params.logprobs is not None else None,
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                   for c in out.outputs]
        return {"id": request_id, "object": "chat.completion", "created": int(time.time()),
                "model": self.model_name, "choices": choices,
                "usage": _usage(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs))}

    async def _chat_events(self, request, request_id, first, results, top_n) -> AsyncIterator[str]:
        created = int(time.time())
        head = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": self.model_name}
        n = request.n
        yield sse({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None} for i in range(n)]})
        sent: dict[int, int] = {}
        out = first[1]
        async for _, out in _chain_async(first, results):
            choices = []
            for c in out.outputs:
                start = sent.get(c.index, 0)
                if len(c.token_ids) == start and c.finish_reason is None:
                    continue
                sent[c.index] = len(c.token_ids)
                choices.append({"index": c.index, "delta": {"content": c.delta_text},
                                "logprobs": _chat_logprobs(c, start, top_n) if top_n is not None else None,
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
            if choices:
                yield sse({**head, "choices": choices, "usage": None})
        if request.stream_options is not None and request.stream_options.include_usage:
            yield sse({**head, "choices": [], "usage": _usage(
                len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs))})
        yield sse("[DONE]")


# ------------------------------------------------------------------ helpers
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


def _completion_logprobs(c: CompletionOutput, start: int) -> dict:
    """OpenAI's legacy completions form for tokens ``start:`` of ``c``."""
    tokens, token_logprobs, top, offsets, offset = [], [], [], [], 0
    for token_id, row in zip(c.token_ids[start:], (c.logprobs or [])[start:]):
        chosen = row.get(token_id)
        tokens.append(chosen.decoded_token if chosen else "")
        token_logprobs.append(chosen.logprob if chosen else None)
        top.append({lp.decoded_token: lp.logprob for lp in row.values()})
        offsets.append(offset)
        offset += len(tokens[-1] or "")
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def _chat_logprobs(c: CompletionOutput, start: int, top_n: int) -> dict:
    """OpenAI's chat form for tokens ``start:`` of ``c``:
    ``{"content": [{token, logprob, bytes, top_logprobs: [the top_n, by rank]}]}``."""
    def entry(lp) -> dict:
        token = lp.decoded_token or ""
        return {"token": token, "logprob": lp.logprob, "bytes": list(token.encode())}

    content = []
    for token_id, row in zip(c.token_ids[start:], (c.logprobs or [])[start:]):
        top = sorted((lp for lp in row.values() if lp.rank is not None and lp.rank <= top_n),
                     key=lambda lp: lp.rank)
        content.append({**entry(row[token_id]), "top_logprobs": [entry(lp) for lp in top]})
    return {"content": content}
