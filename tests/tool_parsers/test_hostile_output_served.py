"""Hostile model output through a real server and the openai client (issue 66, items 4 and 12):
``--enable-auto-tool-choice --tool-call-parser hermes`` on a tiny random model, made to write
a fixed text through structured outputs (a regex of it), as ``tests/entrypoints/test_tool_calls.py``
does.

- 1,000 nested ``[`` in a call raised RecursionError in the parser: the stream stopped after
  about a thousand events with no error event and no ``data: [DONE]``; the whole message was
  a 500. Now the stream ends with ``[DONE]`` and the whole message is answered.
- A parser that raises anyway (a plugin's, here one made to fail) costs neither: its text
  comes back as content, the stream still ends with ``[DONE]``.
- A newline between two calls was content ``"\\n"``: the Agents SDK made an empty message
  item of it; pydantic-ai's ``run_stream`` returned it and ran no tool. Now there is no
  content, whole or streamed.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from microvllm.checks.hermes_parser import literal_regex
from microvllm.engine.async_llm import AsyncLLM
from microvllm.entrypoints.openai.api_server import build_app
from microvllm.models.tiny import make_tiny_model
from microvllm.tool_parsers import ToolParserManager
from microvllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser
from tests.support import ThreadServer

DEEP = '<tool_call>\n{"name": "f", "arguments": {"a": ' + "[" * 1000
CALL = '<tool_call>\n{{"name": "{}", "arguments": {{"city": "Paris"}}}}\n</tool_call>'
TWO_CALLS = CALL.format("get_weather") + "\n" + CALL.format("get_time")
TOOLS = [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
         for name in ("f", "get_weather", "get_time")]
CHAT = [{"role": "user", "content": "Weather?"}]


class FailingParser(Hermes2ProToolParser):
    """A parser with a bug: it raises on its third delta, and on any whole message."""

    def __init__(self, tokenizer=None) -> None:
        super().__init__(tokenizer)
        self.deltas = 0

    def extract_tool_calls(self, model_output, request=None):
        raise RuntimeError("a bug in a plugin's parser")

    def extract_tool_calls_streaming(self, *args, **kwargs):
        self.deltas += 1
        if self.deltas == 3:
            raise RuntimeError("a bug in a plugin's parser")
        return super().extract_tool_calls_streaming(*args, **kwargs)


@pytest.fixture(scope="module")
def urls(tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp("hostile_output") / "llama", "llama", seed=3,
                             max_position_embeddings=2048)
    engine = AsyncLLM(str(folder), max_model_len=2048, max_num_seqs=4, max_num_batched_tokens=256)
    ToolParserManager.register_module("failing-for-test")(FailingParser)
    servers = [ThreadServer(build_app(engine, "tiny", enable_auto_tool_choice=True, tool_call_parser=parser))
               for parser in ("hermes", "failing-for-test")]
    yield [server.url for server in servers]
    for server in servers:
        server.stop()
    engine.shutdown()
    ToolParserManager.registered.pop("failing-for-test", None)


def body(text: str, **extra) -> dict:
    return {"model": "tiny", "messages": CHAT, "tools": TOOLS, "temperature": 0, "max_tokens": len(text) + 8,
            "structured_outputs": {"regex": literal_regex(text)}, **extra}


def sse(url: str, text: str) -> list[str]:
    """Every ``data:`` line of a streamed request for ``text``."""
    with httpx.stream("POST", url + "/v1/chat/completions", json=body(text, stream=True), timeout=300) as response:
        assert response.status_code == 200, response.read()
        return [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]


def streamed(events: list[str]) -> tuple[str, dict[int, list[str]], str | None]:
    """(content, {call index: [name, arguments]}, finish_reason) of a stream's events."""
    content, calls, finish = "", {}, None
    for event in events[:-1]:
        chunk = json.loads(event)
        assert "error" not in chunk, chunk
        for choice in chunk["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                entry = calls.setdefault(call["index"], ["", ""])
                entry[0] += call["function"].get("name") or ""
                entry[1] += call["function"].get("arguments") or ""
            finish = choice["finish_reason"] or finish
    return content, calls, finish


@pytest.mark.slow
def test_a_call_nested_1000_deep_is_answered_and_its_stream_ends_with_done(urls):
    hermes = urls[0]
    events = sse(hermes, DEEP)
    assert events[-1] == "[DONE]", f"the stream stopped after {len(events)} events: {events[-3:]}"
    content, calls, finish = streamed(events)
    assert finish is not None and list(calls) == [0] and calls[0][0] == "f"   # the name went out before the depth
    whole = httpx.post(hermes + "/v1/chat/completions", json=body(DEEP), timeout=300)
    assert whole.status_code == 200, whole.text
    message = whole.json()["choices"][0]["message"]
    assert message["content"] == DEEP and not message["tool_calls"], "nested too deep to decode: it is text"


def test_a_parser_that_raises_leaves_the_text_as_content_and_the_stream_whole(urls):
    failing = urls[1]
    text = "Sure, the weather." + CALL.format("get_weather")
    events = sse(failing, text)
    assert events[-1] == "[DONE]"
    content, calls, finish = streamed(events)
    assert (content, calls) == (text, {}) and finish == "stop"   # from its 3rd delta on, the text as it comes
    whole = httpx.post(failing + "/v1/chat/completions", json=body(text), timeout=300)
    assert whole.status_code == 200, whole.text
    assert whole.json()["choices"][0]["message"]["content"] == text


def test_a_newline_between_two_calls_is_not_content(urls):
    client = openai.OpenAI(base_url=urls[0] + "/v1", api_key="none", max_retries=0)
    request = dict(model="tiny", messages=CHAT, tools=TOOLS, temperature=0, max_tokens=len(TWO_CALLS) + 8,
                   extra_body={"structured_outputs": {"regex": literal_regex(TWO_CALLS)}})
    choice = client.chat.completions.create(**request).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None, repr(choice.message.content)
    assert [call.function.name for call in choice.message.tool_calls] == ["get_weather", "get_time"]
    contents, names = [], []
    for chunk in client.chat.completions.create(stream=True, **request):
        for each in chunk.choices:
            contents += [each.delta.content] if each.delta.content else []
            names += [call.function.name for call in each.delta.tool_calls or [] if call.function.name]
    assert contents == [] and names == ["get_weather", "get_time"], (contents, names)
