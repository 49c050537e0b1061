"""Structured outputs and tool calls through the ``openai`` client, on the embedded
SmolLM2-135M-Instruct behind a real server: ``response_format`` returns JSON that
validates, ``tool_choice="required"`` (vLLM's example request, streamed and not)
returns tool calls whose arguments validate against the tool's parameters."""

import contextlib
import json

import jsonschema
import openai
import pytest

from microvllm.engine.async_llm import AsyncLLM
from microvllm.entrypoints.openai.api_server import build_app
from tests.support import ThreadServer

pytest.importorskip("xgrammar")

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20}, "temperature_c": {"type": "integer", "minimum": -50, "maximum": 60},
    "sunny": {"type": "boolean"}}, "required": ["city", "temperature_c", "sunny"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_current_weather", "description": "Current weather in a city",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string", "maxLength": 20},
                                          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                                          "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_forecast", "description": "Forecast for some days",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string", "maxLength": 20},
                                          "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                                          "required": ["city", "days"], "additionalProperties": False}}},
]
MESSAGES = [{"role": "user", "content": "What is the weather in Dallas, and the forecast for 5 days?"}]


@contextlib.contextmanager
def openai_client(folder, **engine_args):
    """An ``openai`` client of an in-process server over ``folder`` (served as "smollm2")."""
    engine = AsyncLLM(str(folder), **engine_args)
    server = ThreadServer(build_app(engine, "smollm2"))
    try:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    finally:
        server.stop()
        engine.shutdown()


@pytest.fixture(scope="module")
def client(default_model_folder):
    with openai_client(default_model_folder, max_model_len=1024, max_num_seqs=4) as client:
        yield client


def test_response_format_json_schema_returns_json_that_validates(client):
    reply = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Describe the weather in Paris as JSON."}],
        max_tokens=120, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER}})
    choice = reply.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), WEATHER)


def test_response_format_json_object(client):
    reply = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Give a JSON object with a name and an age."}],
        max_tokens=120, temperature=0, response_format={"type": "json_object"})
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


def check_calls(calls):
    by_name = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
    assert calls
    for call in calls:
        assert call.type == "function" and call.id
        jsonschema.validate(json.loads(call.function.arguments), by_name[call.function.name])


def test_tool_choice_required_as_vllms_example_sends_it(client):
    """The requests of vLLM's openai_chat_completion_client_with_tools_required.py."""
    stream = client.chat.completions.create(messages=MESSAGES, model="smollm2", tools=TOOLS,
                                            tool_choice="required", stream=True, max_tokens=200, temperature=0)
    # The calls stream in pieces (the id and name first, then the arguments): a client joins them by index.
    pieces = [call for chunk in stream if chunk.choices and chunk.choices[0].delta.tool_calls
              for call in chunk.choices[0].delta.tool_calls]
    streamed = {}
    for piece in pieces:
        if piece.index not in streamed:
            streamed[piece.index] = piece.model_copy(deep=True)
        else:
            streamed[piece.index].function.arguments += piece.function.arguments or ""
    streamed = [streamed[index] for index in sorted(streamed)]
    check_calls(streamed)
    reply = client.chat.completions.create(messages=MESSAGES, model="smollm2", tools=TOOLS,
                                           tool_choice="required", max_tokens=200, temperature=0)
    assert reply.choices[0].finish_reason == "tool_calls"
    check_calls(reply.choices[0].message.tool_calls)
    assert [c.function.arguments for c in reply.choices[0].message.tool_calls] == \
        [c.function.arguments for c in streamed]


def test_a_named_function(client):
    reply = client.chat.completions.create(
        messages=MESSAGES, model="smollm2", tools=TOOLS, max_tokens=120, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_forecast"}})
    calls = reply.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_forecast"]
    check_calls(calls)


def test_a_bad_schema_is_a_400_and_the_server_goes_on(client):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(
            model="smollm2", messages=MESSAGES, max_tokens=5,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object",
                                                                                          "properties": 7}}})
    assert "structured_outputs.json" in str(error.value)
    assert client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=3).choices
