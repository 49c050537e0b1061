"""Agent frameworks run unchanged on microvllm's server (``--enable-auto-tool-choice
--tool-call-parser hermes --reasoning-parser qwen3``): the OpenAI Agents SDK's agent loop
(its chat-completions model, two tools: the model calls one, the SDK runs it and sends the
result back, the model answers) and LangChain's ``bind_tools`` with ``tool_choice="auto"``.

The tiny random model cannot decide to call a tool, so each turn makes it write a fixed
text through structured outputs (vLLM's ``structured_outputs`` extra body field, a regex of
that text): a Hermes tool call after some reasoning in the first turn, a plain answer in the
second. Everything else (the request each framework builds, the parsers, the stream, the
messages that carry the tool's result back) is the frameworks' and the server's own.
"""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from microvllm.engine.async_llm import AsyncLLM
from microvllm.entrypoints.openai.api_server import build_app
from microvllm.models.tiny import make_tiny_model
from tests.support import LLM_SETTINGS, ThreadServer

agents = pytest.importorskip("agents")
langchain_openai = pytest.importorskip("langchain_openai")

CALL = ('<think>The weather tool knows.</think><tool_call>\n'
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
# LangChain names a tool after its function
LC_CALL = CALL.replace("get_weather", "weather")
ANSWER = "It is sunny in Paris."
# A Qwen3 model thinks before it answers, too: without the end tag the reasoning parser
# would take the whole turn for reasoning cut off by max_tokens (vLLM's rule).
ANSWER_TURN = "<think>Sunny, says the tool.</think>" + ANSWER


def forced(text: str) -> dict:
    """The request body's extra field that makes the tiny model write ``text`` (a regex of
    it: only the regex's own characters escaped, as xgrammar warns of needless escapes)."""
    return {"structured_outputs": {"regex": re.sub(r"([.^$*+?{}\[\]\\|()])", r"\\\1", text)}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp("agents") / "llama", "llama", seed=3)
    engine = AsyncLLM(str(folder), **LLM_SETTINGS)
    served = ThreadServer(build_app(engine, "tiny", enable_auto_tool_choice=True, tool_call_parser="hermes",
                                    reasoning_parser="qwen3"))
    yield served
    served.stop()
    engine.shutdown()


def weather(city: str) -> str:
    """Today's weather in a city."""
    return f"sunny in {city}"


def local_time(timezone: str) -> str:
    """The time now in a time zone."""
    return "12:00"


# ------------------------------------------------------------- the OpenAI Agents SDK
@pytest.mark.parametrize("streamed", [False, True])
@pytest.mark.parametrize("api", ["chat", "responses"])
def test_the_agents_sdk_runs_its_loop(server, streamed, api):
    """Its chat-completions model on /v1/chat/completions, its (default) Responses model on
    /v1/responses: the same loop."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        RunHooks,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from agents.items import MessageOutputItem, ReasoningItem, ToolCallItem, ToolCallOutputItem

    set_tracing_disabled(True)   # the SDK's traces would go to OpenAI's servers
    sent: list[dict] = []

    async def record(request: httpx.Request) -> None:
        sent.append(json.loads(request.content))

    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                                http_client=httpx.AsyncClient(event_hooks={"request": [record]}, timeout=60))

    class AnswerAfterTheTool(RunHooks):
        """The second turn (after the tool ran) writes the answer instead of a call."""

        async def on_tool_end(self, context, agent, tool, result):
            agent.model_settings = ModelSettings(temperature=0, max_tokens=300, extra_body=forced(ANSWER_TURN))

    agent = Agent(name="weather", instructions="Answer with the tools.",
                  model=(OpenAIChatCompletionsModel if api == "chat" else OpenAIResponsesModel)(
                      model="tiny", openai_client=client),
                  tools=[function_tool(weather, name_override="get_weather"),
                         function_tool(local_time, name_override="get_time")],
                  model_settings=ModelSettings(temperature=0, max_tokens=300, extra_body=forced(CALL)))
    hooks = AnswerAfterTheTool()
    if streamed:
        async def run():
            result = Runner.run_streamed(agent, "Weather in Paris?", hooks=hooks)
            events = [event async for event in result.stream_events()]
            return result, events

        import asyncio

        result, events = asyncio.run(run())
        assert any(event.type == "raw_response_event" for event in events)
    else:
        result = Runner.run_sync(agent, "Weather in Paris?", hooks=hooks)

    assert result.final_output == ANSWER
    kinds = [type(item) for item in result.new_items]
    assert kinds == [ReasoningItem, ToolCallItem, ToolCallOutputItem, ReasoningItem, MessageOutputItem], kinds
    thoughts = [item.raw_item.content[0].text for item in result.new_items if isinstance(item, ReasoningItem)]
    assert thoughts == ["The weather tool knows.", "Sunny, says the tool."]
    call = result.new_items[1].raw_item
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert result.new_items[2].output == "sunny in Paris"
    # Both turns reached the server with the two tools; the second carries the call back and
    # its result (chat: the assistant's tool_calls and a tool message; responses: the
    # function_call item and a function_call_output item).
    assert len(sent) == 2
    if api == "chat":
        assert all({t["function"]["name"] for t in body["tools"]} == {"get_weather", "get_time"} for body in sent)
        messages = sent[1]["messages"]
        (assistant,) = [m for m in messages if m["role"] == "assistant"]
        assert assistant["tool_calls"][0]["function"]["name"] == "get_weather"
        (tool,) = [m for m in messages if m["role"] == "tool"]
        assert tool["content"] == "sunny in Paris" and tool["tool_call_id"] == assistant["tool_calls"][0]["id"]
    else:
        assert all({t["name"] for t in body["tools"]} == {"get_weather", "get_time"} for body in sent)
        items = sent[1]["input"]
        (called,) = [item for item in items if item.get("type") == "function_call"]
        (output,) = [item for item in items if item.get("type") == "function_call_output"]
        assert called["name"] == "get_weather" and output["call_id"] == called["call_id"]
        assert output["output"] == "sunny in Paris"


# ------------------------------------------------------------- LangChain
def test_langchain_bind_tools_calls_and_answers(server):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    tools = [tool(weather), tool(local_time)]

    def model(text: str):
        return ChatOpenAI(model="tiny", base_url=server.url + "/v1", api_key="none", temperature=0,
                          max_tokens=300, max_retries=0, extra_body=forced(text)).bind_tools(tools, tool_choice="auto")

    question = [HumanMessage("Weather in Paris?")]
    message = model(LC_CALL).invoke(question)
    assert message.content == "" and len(message.tool_calls) == 1, message
    call = message.tool_calls[0]
    assert (call["name"], call["args"]) == ("weather", {"city": "Paris"}), call
    # Streamed: LangChain merges the tool-call chunks (name first, then argument pieces).
    chunks = list(model(LC_CALL).stream(question))
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged = merged + chunk
    assert [(c["name"], c["args"]) for c in merged.tool_calls] == [(call["name"], call["args"])]
    assert "<" not in "".join(str(chunk.content) for chunk in chunks), "a tag leaked into the content"
    # The round trip: the tool's result goes back, the model answers.
    answer = model(ANSWER_TURN).invoke(question + [message, ToolMessage("sunny in Paris", tool_call_id=call["id"])])
    assert answer.content == ANSWER and not answer.tool_calls


# The model writes two calls in one turn; the agent asked for one at a time.
TWO_CALLS = ('<think>Both tools.</think><tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
             '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"timezone": "CET"}}\n</tool_call>')


@pytest.mark.parametrize("streamed", [False, True])
def test_the_agents_sdk_with_parallel_tool_calls_false_gets_one_call(server, streamed):
    """``ModelSettings(parallel_tool_calls=False)``: the SDK sends the field, and as from vLLM
    (issue 66, item 11) only the model's first call comes back, so the SDK runs one tool."""
    import asyncio

    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        RunHooks,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from agents.items import ToolCallItem

    set_tracing_disabled(True)
    sent: list[dict] = []

    async def record(request: httpx.Request) -> None:
        sent.append(json.loads(request.content))

    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                                http_client=httpx.AsyncClient(event_hooks={"request": [record]}, timeout=60))
    settings = dict(temperature=0, max_tokens=300, parallel_tool_calls=False)

    class AnswerAfterTheTool(RunHooks):
        async def on_tool_end(self, context, agent, tool, result):
            agent.model_settings = ModelSettings(**settings, extra_body=forced(ANSWER_TURN))

    agent = Agent(name="weather", instructions="Answer with the tools.",
                  model=OpenAIChatCompletionsModel(model="tiny", openai_client=client),
                  tools=[function_tool(weather, name_override="get_weather"),
                         function_tool(local_time, name_override="get_time")],
                  model_settings=ModelSettings(**settings, extra_body=forced(TWO_CALLS)))
    if streamed:
        async def run():
            result = Runner.run_streamed(agent, "Weather in Paris?", hooks=AnswerAfterTheTool())
            async for _ in result.stream_events():
                pass
            return result

        result = asyncio.run(run())
    else:
        result = Runner.run_sync(agent, "Weather in Paris?", hooks=AnswerAfterTheTool())

    assert sent[0]["parallel_tool_calls"] is False
    calls = [item.raw_item for item in result.new_items if isinstance(item, ToolCallItem)]
    assert [(call.name, json.loads(call.arguments)) for call in calls] == [("get_weather", {"city": "Paris"})]
    assert result.final_output == ANSWER
