"""Each tool-call format besides hermes (``--tool-call-parser qwen3_xml | llama3_json |
mistral | pythonic``) through a real server and the openai client, whole and streamed.

As in ``test_tool_calls.py``, the tiny random model is made to write a fixed text in the
parser's format by structured outputs (a regex of that text), so each parser meets real
engine output, cut into deltas wherever the engine's steps and the detokenizer cut it.
"""

from __future__ import annotations

import json
import re

import openai
import pytest

from microvllm.engine.async_llm import AsyncLLM
from microvllm.entrypoints.openai.api_server import build_app
from microvllm.models.tiny import make_tiny_model
from tests.support import LLM_SETTINGS, ThreadServer

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "unit": {"type": "string"}, "days": {"type": "array"}}}}}]
CHAT = [{"role": "user", "content": "Weather in Paris?"}]
ARGUMENTS = {"city": "Paris", "days": [1, 2]}
# parser: (what the model writes, the content a client gets, the arguments, the markers that must never be content)
WRITTEN = {
    # strings only: whether qwen3_xml types a value depends on the server handing it the
    # request (see test_qwen3_xml_values_are_typed_by_the_requests_schema)
    "qwen3_xml": ("I will look.<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                  "<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>", "I will look.",
                  {"city": "Paris", "unit": "celsius"}, "<"),
    "llama3_json": ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": [1, 2]}}',
                    None, ARGUMENTS, "<{"),
    "mistral": ('I will look.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": [1, 2]}', "I will look.",
                ARGUMENTS, "[{"),
    "pythonic": ('[get_weather(city="Paris", days=[1, 2])]', None, ARGUMENTS, "[("),
}

@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp("formats") / "llama", "llama", seed=3)
    llm = AsyncLLM(str(folder), **LLM_SETTINGS)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def clients(engine):
    """{parser name: an openai client of a server started with that parser}, all on one
    engine; stopped together at the end (stopping an app shuts its engine down)."""
    servers = {parser: ThreadServer(build_app(engine, "tiny", enable_auto_tool_choice=True, tool_call_parser=parser))
               for parser in WRITTEN}
    yield {parser: openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
           for parser, server in servers.items()}
    for server in servers.values():
        server.stop()


@pytest.fixture(params=sorted(WRITTEN))
def served(request, clients):
    """(parser name, its server's client)."""
    return request.param, clients[request.param]


def ask(client, parser: str, written: str | None = None, **kwargs):
    return client.chat.completions.create(
        model="tiny", messages=CHAT, tools=TOOLS, max_tokens=300, temperature=0,
        extra_body={"structured_outputs": {"regex": re.escape(written or WRITTEN[parser][0])}}, **kwargs)


def test_a_whole_message(served):
    parser, client = served
    choice = ask(client, parser).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == WRITTEN[parser][1]
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id and call.function.name == "get_weather"
    if parser == "mistral":
        assert len(call.id) == 9 and call.id.isalnum(), call.id
    assert json.loads(call.function.arguments) == WRITTEN[parser][2]


def test_a_stream_gives_the_same_pieces(served):
    parser, client = served
    content, calls, finish = "", {}, None
    for chunk in ask(client, parser, stream=True):
        (choice,) = chunk.choices
        piece = choice.delta.content or ""
        assert not any(c in piece for c in WRITTEN[parser][3]), f"a marker leaked into the content: {piece!r}"
        content += piece
        for call in choice.delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"name": None, "arguments": ""})
            if call.function.name is not None:
                assert entry["name"] is None and call.id, "a call's name and id come once, first"
                entry["name"] = call.function.name
            entry["arguments"] += call.function.arguments or ""
        finish = choice.finish_reason or finish
    assert (content or None, finish) == (WRITTEN[parser][1], "tool_calls")
    assert list(calls) == [0] and calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == WRITTEN[parser][2]


def test_qwen3_xml_values_are_typed_by_the_requests_schema(clients):
    written = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
               "<parameter=days>\n[1, 2]\n</parameter>\n</function>\n</tool_call>")
    call = ask(clients["qwen3_xml"], "qwen3_xml", written).choices[0].message.tool_calls[0]
    assert json.loads(call.function.arguments) == ARGUMENTS
