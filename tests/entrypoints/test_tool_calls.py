"""The model's own tool calls and reasoning, parsed as vLLM's chat endpoint does
(``--enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3``), through a
real server and the openai client.

The tiny random model cannot choose to call a tool, so each request makes it write a fixed
text through structured outputs (a regex of that text): the parsers then meet real engine
output, cut into deltas wherever the engine's steps and the detokenizer cut it.
"""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from microvllm.engine.async_llm import AsyncLLM
from microvllm.entrypoints.openai.api_server import build_app, chat_parsers
from microvllm.models.tiny import make_tiny_model
from tests.support import LLM_SETTINGS, ThreadServer

WRITTEN = ('<think>Paris, then.</think>I will look.<tool_call>\n'
           '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n</tool_call>')
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "array"}}}}}]
CHAT = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("tools") / "llama", "llama", seed=3))


@pytest.fixture(scope="module")
def engine(folder):
    llm = AsyncLLM(folder, **LLM_SETTINGS)
    yield llm
    llm.shutdown()


@pytest.fixture
def own_engine(folder):
    """An engine for a test that starts and stops a server of its own (stopping the app
    shuts its engine down)."""
    llm = AsyncLLM(folder, **LLM_SETTINGS)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def client(engine):
    server = ThreadServer(build_app(engine, "tiny", enable_auto_tool_choice=True, tool_call_parser="hermes",
                                    reasoning_parser="qwen3"))
    yield openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    server.stop()


def ask(client, **kwargs):
    return client.chat.completions.create(
        model="tiny", messages=CHAT, tools=TOOLS, max_tokens=400, temperature=0,
        extra_body={"structured_outputs": {"regex": re.escape(WRITTEN)}}, **kwargs)


def test_a_whole_message_is_split_into_reasoning_content_and_a_call(client):
    choice = ask(client).choices[0]
    message = choice.message
    assert choice.finish_reason == "tool_calls"
    assert message.model_extra["reasoning"] == "Paris, then."
    assert message.content == "I will look."
    (call,) = message.tool_calls
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": [1, 2]}


@pytest.mark.parametrize("n", [1, 2])
def test_a_stream_gives_the_same_pieces(client, n):
    reasoning, content, calls, finish = [""] * n, [""] * n, [{} for _ in range(n)], [None] * n
    for chunk in ask(client, stream=True, n=n):
        for choice in chunk.choices:
            delta, i = choice.delta, choice.index
            reasoning[i] += (delta.model_extra or {}).get("reasoning") or ""
            content[i] += delta.content or ""
            assert "<" not in (delta.content or ""), f"a tag leaked into the content: {delta.content!r}"
            for call in delta.tool_calls or []:
                entry = calls[i].setdefault(call.index, {"name": None, "arguments": ""})
                if call.function.name is not None:
                    assert entry["name"] is None and call.id, "a call's name and id come once, first"
                    entry["name"] = call.function.name
                entry["arguments"] += call.function.arguments or ""
            finish[i] = choice.finish_reason or finish[i]
    for i in range(n):
        assert (reasoning[i], content[i], finish[i]) == ("Paris, then.", "I will look.", "tool_calls")
        assert list(calls[i]) == [0] and calls[i][0]["name"] == "get_weather"
        assert json.loads(calls[i][0]["arguments"]) == {"city": "Paris", "days": [1, 2]}


def test_tool_choice_none_leaves_the_text_as_content(client):
    message = ask(client, tool_choice="none").choices[0].message
    assert message.model_extra["reasoning"] == "Paris, then."
    assert message.content.startswith("I will look.<tool_call>") and not message.tool_calls


def test_without_the_flag_auto_is_refused_with_what_to_do(own_engine):
    server = ThreadServer(build_app(own_engine, "tiny"))
    try:
        response = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": CHAT, "tools": TOOLS, "max_tokens": 4})
    finally:
        server.stop()
    assert response.status_code == 400 and "--enable-auto-tool-choice" in response.text, response.text


def test_the_flags_are_checked_before_the_model_loads():
    with pytest.raises(ValueError, match="--tool-call-parser NAME"):
        chat_parsers(True, None, None)
    with pytest.raises(ValueError, match="no tool-call parser named 'nope'.*hermes"):
        chat_parsers(True, "nope", None)
    with pytest.raises(ValueError, match="no reasoning parser named 'r2'.*qwen3"):
        chat_parsers(False, None, "r2")


def test_a_template_that_leaves_the_tools_out_is_named_in_the_log_once(own_engine, caplog):
    """The tiny model's template ignores ``tools``: the server says so (once), since the model
    could not know it may call them. A template that renders them is not warned about."""
    server = ThreadServer(build_app(own_engine, "tiny", enable_auto_tool_choice=True, tool_call_parser="hermes",
                                    trust_request_chat_template=True))
    renders_tools = ("{% for tool in tools %}{{ tool['function']['name'] }}\n{% endfor %}"
                     "{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    body = {"model": "tiny", "messages": CHAT, "tools": TOOLS, "max_tokens": 2}
    try:
        with caplog.at_level("WARNING", logger="microvllm.entrypoints.openai.serving"):
            for extra in ({}, {}, {"chat_template": renders_tools}):
                response = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={**body, **extra})
                assert response.status_code == 200, response.text
    finally:
        server.stop()
    warned = [r.getMessage() for r in caplog.records if "wrote none of the tools" in r.getMessage()]
    assert len(warned) == 1 and "get_weather" in warned[0] and "--chat-template" in warned[0], warned
