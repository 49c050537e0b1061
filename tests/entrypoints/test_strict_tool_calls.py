"""Strict tool calls under ``tool_choice="auto"`` (as vLLM does by default, its
``resolve_tool_strictness``): a tool with ``"strict": true``
makes the server hold the model to the tool parser's structural tag (xgrammar's
``triggered_tags``): it writes freely, but once it writes ``<tool_call>`` what follows must
be a call of one of the tools, its arguments valid under that tool's schema.

The tiny random model is pushed to start calls (``logit_bias`` on its ``<tool_call>`` token,
one token here as in Qwen's vocabulary) and then left to itself: with strict tools every
call it starts parses and validates; without, what it writes after the tag is noise.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from microvllm.engine.async_llm import AsyncLLM
from microvllm.entrypoints.openai.api_server import build_app
from microvllm.entrypoints.openai.protocol import ChatCompletionRequest
from microvllm.models.tiny import make_tiny_model
from microvllm.tokenizer import Tokenizer
from microvllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser
from tests.support import LLM_SETTINGS, ThreadServer

pytest.importorskip("xgrammar")

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}},
        "required": ["city"], "additionalProperties": False}
DAYS = {"type": "object", "properties": {"days": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["days"], "additionalProperties": False}


def tools(strict: bool) -> list[dict]:
    return [{"type": "function", "function": {"name": name, "parameters": schema, "strict": strict}}
            for name, schema in (("get_weather", CITY), ("get_forecast", DAYS))]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("strict") / "llama", "llama", seed=11,
                               added_tokens=("<tool_call>", "</tool_call>")))


@pytest.fixture(scope="module")
def engine(folder):
    llm = AsyncLLM(folder, **LLM_SETTINGS)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module", params=["hermes", "qwen3_xml"])
def client(request, engine):
    """A server per format, on one engine (stopping a server would shut its engine down:
    each is stopped with the module)."""
    server = ThreadServer(build_app(engine, "tiny", enable_auto_tool_choice=True, tool_call_parser=request.param))
    servers.append(server)
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


servers: list = []


@pytest.fixture(scope="module", autouse=True)
def stop_servers():
    yield
    for server in servers:
        server.stop()


def ask(client, folder, strict: bool):
    """Six sampled answers, pushed towards ``<tool_call>`` and away from whitespace (JSON lets
    a random model wander in it until max_tokens; a trained one does not)."""
    tokenizer = Tokenizer.from_pretrained(folder)
    bias = {str(token_id): -8.0 for token_id in range(tokenizer.vocab_size)
            if not tokenizer.decode([token_id]).strip()}
    bias[str(tokenizer.hf_tokenizer.get_vocab()["<tool_call>"])] = 6.0
    return client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Weather?"}], tools=tools(strict), n=6, seed=1,
        temperature=1.0, max_tokens=120, logit_bias=bias)


def test_strict_tools_make_every_call_the_model_starts_valid(client, folder):
    calls = 0
    for choice in ask(client, folder, strict=True).choices:
        content = choice.message.content or ""
        if "<tool_call>" in content:   # only a call that max_tokens cut off stays text
            assert choice.finish_reason == "length" and content.count("<tool_call>") == 1, choice
        made = choice.message.tool_calls or []
        if choice.finish_reason == "length":   # the last call may be one max_tokens cut off, which
            made = made[:-1]                    # qwen3_xml keeps (a call with what was written)
        for call in made:
            schema = {"get_weather": CITY, "get_forecast": DAYS}[call.function.name]
            jsonschema.validate(json.loads(call.function.arguments), schema)
            calls += 1
    assert calls >= 3, "the biased model should have started calls"


def test_without_strict_the_model_writes_noise_after_the_tag(client, folder):
    choices = ask(client, folder, strict=False).choices
    assert all("<tool_call>" in (choice.message.content or "") for choice in choices)
    assert not any(choice.message.tool_calls for choice in choices)


def test_the_structural_tag_is_used_only_when_nothing_else_constrains_the_output():
    def request(**body):
        chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **body)
        chat.enable_auto_tool_choice(Hermes2ProToolParser)
        return chat.structured_outputs_params()

    tag = request(tools=tools(True))
    assert tag.kind == "structural_tag"
    begins = [t["begin"] for t in tag.structural_tag["format"]["tags"]]
    assert begins == ['<tool_call>\n{"name": "get_weather", "arguments": ',
                      '<tool_call>\n{"name": "get_forecast", "arguments": ']
    assert request(tools=tools(False)) is None
    assert request(tools=tools(True), tool_choice="none") is None
    assert request(tools=tools(True), response_format={"type": "json_object"}).kind == "json_object"
    assert request(tools=tools(True), tool_choice="required").kind == "json"
