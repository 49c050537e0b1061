"""``POST /v1/responses`` (OpenAI's Responses API, stateless) through a real server and the
``openai`` client: string and item input, the response object, the stream's events in
order, a function tool's round trip, ``text.format``, forced tool calls, reasoning items,
and the 400s for what a stateless server cannot do.

Two servers share one engine: "plain" (no parsers) and "parsing" (``--enable-auto-tool-choice
--tool-call-parser hermes --reasoning-parser qwen3``), both with a hermes-style template
that renders tools, calls and tool results. The tiny random model writes what a test needs
through vLLM's ``structured_outputs`` extra field (a regex of the text), as in
test_tool_calls.py.
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
from tests.support import LLM_SETTINGS, ThreadServer, assert_400

# Qwen's layout, cut down: the tools in a system turn, calls as <tool_call> JSON, results as
# <tool_response> in a user turn, reasoning as <think>.
TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n"
    "{% endfor %}</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant\n"
    "{% if m.reasoning %}<think>{{ m.reasoning }}</think>{% endif %}{{ m.content }}"
    "{% for call in m.tool_calls or [] %}<tool_call>\n"
    "{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WRITTEN = ('<think>Paris, then.</think>I will look.<tool_call>\n'
           '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n</tool_call>')
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "array"}}}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": WEATHER}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                                 "parameters": WEATHER}}]
SHORT = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                          "days": {"type": "integer", "minimum": 1, "maximum": 9}},
         "required": ["city", "days"], "additionalProperties": False}
# JSON the tiny model writes: sampled (seeded), since greedy picks the grammar's whitespace forever.
SAMPLED = {"temperature": 1.0, "extra_body": {"seed": 1}}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    # enforce_eager: the sampler's plain draw, under which the seeds below were chosen (the
    # CPU platform's draw takes other tokens from the same seeds).
    llm = AsyncLLM(str(make_tiny_model(tmp_path_factory.mktemp("responses") / "llama", "llama", seed=3)),
                   enforce_eager=True, **LLM_SETTINGS)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def servers(engine):
    plain = ThreadServer(build_app(engine, "tiny", chat_template=TEMPLATE))
    parsing = ThreadServer(build_app(engine, "tiny", chat_template=TEMPLATE, enable_auto_tool_choice=True,
                                     tool_call_parser="hermes", reasoning_parser="qwen3"))
    yield {"plain": plain, "parsing": parsing}
    parsing.stop()
    plain.stop()


def client_of(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def plain(servers):
    return client_of(servers["plain"])


@pytest.fixture(scope="module")
def parsing(servers):
    return client_of(servers["parsing"])


def writes(text: str) -> dict:
    """Make the model write exactly ``text``."""
    return {"structured_outputs": {"regex": re.escape(text)}}


def rendered(engine, messages: list[dict], tools: list[dict] | None = None) -> dict:
    """The prompt the server's template makes of chat ``messages``, rendered here."""
    return engine.tokenizer.chat_prompt(messages, True, chat_template=TEMPLATE,
                                        chat_template_kwargs={"tools": tools} if tools else None)


# ---------------------------------------------------------------- whole responses
def test_a_string_input_gives_one_message_and_its_usage(plain, engine):
    response = plain.responses.create(model="tiny", input="Hello", max_output_tokens=40, temperature=0,
                                      store=False, extra_body=writes("Hello, world!"))
    assert response.id.startswith("resp_") and response.object == "response", response
    assert response.status == "completed" and response.incomplete_details is None
    (item,) = response.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert response.output_text == "Hello, world!"
    prompt = rendered(engine, [{"role": "user", "content": "Hello"}])
    usage = response.usage
    assert usage.input_tokens == len(prompt["prompt_token_ids"])
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    # The same turn asked through the chat endpoint: the same engine call, the same tokens.
    chat = plain.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello"}],
                                         max_tokens=40, temperature=0, extra_body=writes("Hello, world!"))
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (usage.input_tokens, usage.output_tokens)


def test_instructions_and_message_items_are_the_chat_messages(plain, engine):
    """instructions -> a system message; content parts (input_text) -> their text; the
    default store=True is accepted (and nothing is stored)."""
    response = plain.responses.create(model="tiny", instructions="Be brief.", max_output_tokens=5, temperature=0,
                                      input=[{"role": "user", "content": [{"type": "input_text", "text": "Hi"},
                                                                          {"type": "input_text", "text": "there"}]},
                                             {"type": "message", "role": "assistant", "content": [
                                                 {"type": "output_text", "text": "Yes?"}]},
                                             {"role": "developer", "content": "Go on."}])
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi\nthere"},
            {"role": "assistant", "content": "Yes?"}, {"role": "developer", "content": "Go on."}]
    assert response.usage.input_tokens == len(rendered(engine, chat)["prompt_token_ids"])
    assert response.instructions == "Be brief."


def test_max_output_tokens_makes_the_response_incomplete(plain):
    response = plain.responses.create(model="tiny", input="Count", max_output_tokens=3, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3 and response.max_output_tokens == 3


# ---------------------------------------------------------------------- streams
def events_of(client, **kwargs) -> list:
    events = list(client.responses.create(model="tiny", stream=True, **{"temperature": 0, **kwargs}))
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type == "response.completed"
    return events


def grouped(events) -> list[tuple[str, ...]]:
    """The events between response.in_progress and response.completed, as one tuple of
    types per output item (a run of deltas written once, as "…delta*"), checking that every
    event of an item names that item and its index."""
    items, current, item_id = [], [], None
    for event in events[2:-1]:
        if event.type == "response.output_item.added":
            assert event.output_index == len(items)
            current, item_id = [], event.item.id
        else:
            assert event.output_index == len(items)
            assert getattr(event, "item_id", item_id) == item_id
        name = event.type.removeprefix("response.") + ("*" if event.type.endswith(".delta") else "")
        if not (current and current[-1] == name and name.endswith("*")):
            current.append(name)
        if event.type == "response.output_item.done":
            assert event.item.id == item_id
            items.append(tuple(current))
    return items


def test_a_stream_opens_grows_and_closes_one_message(plain):
    events = events_of(plain, input="Hello", max_output_tokens=40, extra_body=writes("Hello, world!"))
    assert grouped(events) == [("output_item.added", "content_part.added", "output_text.delta*",
                                "output_text.done", "content_part.done", "output_item.done")]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    final = events[-1].response
    assert deltas == done.text == final.output_text == "Hello, world!"
    assert final.status == "completed" and final.usage.output_tokens > 0
    assert events[0].response.status == "in_progress" and events[0].response.id == final.id


def test_the_model_s_reasoning_text_and_call_come_as_three_items(parsing):
    whole = parsing.responses.create(model="tiny", input="Weather in Paris?", tools=TOOLS, max_output_tokens=400,
                                     temperature=0, extra_body=writes(WRITTEN))
    assert [item.type for item in whole.output] == ["reasoning", "message", "function_call"]
    reasoning, message, call = whole.output
    assert reasoning.content[0].type == "reasoning_text" and reasoning.content[0].text == "Paris, then."
    assert message.content[0].text == "I will look." and whole.output_text == "I will look."
    assert call.name == "get_weather" and call.call_id and call.id.startswith("fc_")
    assert json.loads(call.arguments) == {"city": "Paris", "days": [1, 2]}

    events = events_of(parsing, input="Weather in Paris?", tools=TOOLS, max_output_tokens=400,
                       extra_body=writes(WRITTEN))
    assert grouped(events) == [
        ("output_item.added", "content_part.added", "reasoning_text.delta*", "reasoning_text.done",
         "content_part.done", "output_item.done"),
        ("output_item.added", "content_part.added", "output_text.delta*", "output_text.done",
         "content_part.done", "output_item.done"),
        ("output_item.added", "function_call_arguments.delta*", "function_call_arguments.done", "output_item.done")]
    streamed = events[-1].response.output
    assert [(i.type, i.model_dump(exclude={"id", "call_id"})) for i in streamed] == \
        [(i.type, i.model_dump(exclude={"id", "call_id"})) for i in whole.output]
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(arguments) == {"city": "Paris", "days": [1, 2]}
    assert next(e for e in events if e.type == "response.content_part.added").part.type == "reasoning_text"
    # The client's own stream helper checks every item's identity as it accumulates them.
    with parsing.responses.stream(model="tiny", input="Weather in Paris?", tools=TOOLS, max_output_tokens=400,
                                  temperature=0, extra_body=writes(WRITTEN)) as helper:
        final = helper.get_final_response()
    assert [i.type for i in final.output] == ["reasoning", "message", "function_call"]
    assert final.output_text == "I will look." and final.output[2].arguments == whole.output[2].arguments


# ------------------------------------------------------------------------- tools
def test_a_function_call_round_trip_renders_the_call_and_its_result(parsing, engine):
    """First turn: the model's function_call item. Second turn: the earlier items sent back
    with a function_call_output; the template sees an assistant turn with the call and a
    tool message with the result (a hermes <tool_response>)."""
    first = parsing.responses.create(model="tiny", input="Weather in Paris?", tools=TOOLS, max_output_tokens=400,
                                     temperature=0, extra_body=writes(WRITTEN))
    call = first.output[-1]
    history = [{"role": "user", "content": "Weather in Paris?"},
               *(item.model_dump(exclude_none=True) for item in first.output),
               {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 21}'}]
    second = parsing.responses.create(model="tiny", input=history, tools=TOOLS, max_output_tokens=40,
                                      temperature=0, extra_body=writes("<think>Warm.</think>It is 21."))
    assert second.output_text == "It is 21."
    chat = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "reasoning": "Paris, then.", "content": "I will look.", "tool_calls": [
                {"id": call.call_id, "type": "function",
                 "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": '{"temp": 21}'}]
    prompt = rendered(engine, chat, CHAT_TOOLS)
    assert '<tool_response>\n{"temp": 21}\n</tool_response>' in prompt["prompt"]
    assert '<think>Paris, then.</think>I will look.<tool_call>\n{"name": "get_weather"' in prompt["prompt"]
    assert second.usage.input_tokens == len(prompt["prompt_token_ids"])


def test_a_named_tool_choice_forces_that_call(plain):
    tools = [{"type": "function", "name": "plan", "parameters": SHORT, "strict": True}, TOOLS[0]]
    response = plain.responses.create(model="tiny", input="Plan a trip", tools=tools, max_output_tokens=100,
                                      tool_choice={"type": "function", "name": "plan"}, **SAMPLED)
    (call,) = response.output
    assert call.type == "function_call" and call.name == "plan"
    arguments = json.loads(call.arguments)
    assert arguments["city"] in ("Paris", "Rome") and 1 <= arguments["days"] <= 9


def test_a_required_call_streams_as_one_function_call_item(plain):
    tools = [{"type": "function", "name": "plan", "parameters": SHORT}]
    events = events_of(plain, input="Plan a trip", tools=tools, tool_choice="required", max_output_tokens=200,
                       temperature=1.0, extra_body={"seed": 0})   # a seed whose list of calls ends in time
    assert grouped(events) == [("output_item.added", "function_call_arguments.delta*",
                                "function_call_arguments.done", "output_item.done")]
    done = next(e for e in events if e.type == "response.output_item.done").item
    assert done.name == "plan" and set(json.loads(done.arguments)) == {"city", "days"}
    assert events[-1].response.output[0].arguments == done.arguments


def test_text_format_json_schema_gives_json_that_follows_it(plain):
    pytest.importorskip("xgrammar")
    response = plain.responses.create(model="tiny", input="A trip, as JSON", max_output_tokens=100, **SAMPLED,
                                      text={"format": {"type": "json_schema", "name": "trip", "schema": SHORT,
                                                       "strict": True}})
    assert response.status == "completed", response
    value = json.loads(response.output_text)
    assert value["city"] in ("Paris", "Rome") and 1 <= value["days"] <= 9 and set(value) == {"city", "days"}
    assert response.text.format.type == "json_schema"


# ------------------------------------------------------------------------ the 400s
@pytest.mark.parametrize("body, field, words", [
    ({"previous_response_id": "resp_1"}, "previous_response_id", ["stores none", "input"]),
    ({"background": True}, "background", ["stores none"]),
    ({"tools": CHAT_TOOLS}, "tools[0]", ["flat", "nested"]),
    ({"tools": [{"type": "web_search_preview"}]}, "tools[0]", ["function tools only"]),
    ({"tools": TOOLS}, "tool_choice", ["--enable-auto-tool-choice"]),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", ["'nope'"]),
    ({"tools": TOOLS, "tool_choice": {"type": "mcp"}}, "tool_choice", ["{'type': 'function', 'name': ...}"]),
    ({"text": {"format": {"type": "json_schema", "json_schema": {"schema": SHORT}}}}, "text.format", ["'schema'"]),
    ({"text": {"format": {"type": "json_schema", "schema": SHORT}}, "structured_outputs": {"regex": "a"}},
     "structured_outputs", ["one constraint", "text.format"]),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]", ["stores none"]),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]",
     ["text parts"]),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", ["user, system, developer, assistant"]),
    ({"input": [{"type": "reasoning", "encrypted_content": "xyz", "summary": []}]}, "input[0]", ["encrypted"]),
    ({"input": []}, "input", ["empty"]),
    ({"max_output_tokens": 0}, "max_output_tokens", ["at least 1"]),
    ({"include": ["message.output_text.logprobs"]}, "include", ["logprobs"]),
    ({"truncation": "auto"}, "truncation", ["shorten the input"]),
])
def test_what_a_stateless_server_cannot_do_is_a_400_that_says_what_to_change(servers, body, field, words):
    response = httpx.post(servers["plain"].url + "/v1/responses", timeout=60,
                          json={"model": "tiny", "input": "Hi", "max_output_tokens": 4, **body})
    assert_400(response, field, *words)
    assert response.json()["error"]["message"].startswith(field)


def test_store_false_and_true_are_both_served(servers):
    for store in (False, True):
        response = httpx.post(servers["plain"].url + "/v1/responses", timeout=60,
                              json={"model": "tiny", "input": "Hi", "max_output_tokens": 2, "store": store})
        assert response.status_code == 200 and response.json()["object"] == "response", response.text
