"""Forced tool calls stream as vLLM streams them, and ``parallel_tool_calls: false`` leaves one
call (issue 66, items 10 and 11), through the openai client against a real ``microvllm serve``
process (``--enable-auto-tool-choice --tool-call-parser hermes``) over a tiny random Llama.

``tool_choice="required"`` or a named function constrains the output to the tools' JSON; each
tool here allows one value only (an ``enum``), and the request allows no token with whitespace
(``allowed_token_ids``), so the random model can only write the one JSON text, in whatever
tokens it picks::

    required:  [{"name":"get_weather","parameters":{"city":"Paris-Texas-United-States-of-America"}}]
    named:     {"city":"Paris-Texas-United-States-of-America"}

A stream then sends the call's id and name first, its arguments in pieces after, as vLLM's
``extract_tool_call_required_streaming`` does; the pieces concatenate to the whole message's
``arguments``.
"""

from __future__ import annotations

import json
import re

import openai
import pytest

from microvllm.models.tiny import make_tiny_model
from tests.support import SETTINGS, Server, wait_for

pytest.importorskip("xgrammar")
pytestmark = pytest.mark.slow   # a server process starts (about 30 s on 2 busy cores)

CITY = "Paris-Texas-United-States-of-America"
ARGUMENTS = {"city": CITY}


def tool(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "enum": [CITY]}},
        "required": ["city"], "additionalProperties": False}}}


TOOLS = [tool("get_weather")]
TWO_TOOLS = [tool("get_weather"), tool("get_time")]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
CHAT = [{"role": "user", "content": "Weather in Paris?"}]
COMMA = "14"   # the tiny tokenizer's "," (checked in the fixture)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(the openai client, the token ids without whitespace and the end token)."""
    root = tmp_path_factory.mktemp("forced")
    folder = make_tiny_model(root / "llama", "llama", seed=3)
    vocab = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]
    assert vocab[","] == int(COMMA)
    # Byte-level BPE: Ġ Ċ ĉ č are a space, a newline, a tab, a carriage return.
    no_whitespace = sorted(i for token, i in vocab.items() if not re.search("[ĠĊĉč]", token) and i > 2)
    server = Server(folder, root / "server.log", [*SETTINGS, "--served-model-name", "tiny",
                                                  "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    try:
        wait_for(server.healthy, 180, "the server's /health")
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        yield client, no_whitespace + [2]   # 2: <|im_end|>, the end of the turn
    finally:
        server.stop()


def ask(served, tool_choice, tools=TOOLS, **kwargs):
    client, allowed = served
    extra_body = {"allowed_token_ids": allowed, **kwargs.pop("extra_body", {})}
    return client.chat.completions.create(model="tiny", messages=CHAT, tools=tools, tool_choice=tool_choice,
                                          max_tokens=kwargs.pop("max_tokens", 200), temperature=0,
                                          extra_body=extra_body, **kwargs)


def tool_call_chunks(stream) -> tuple[list, list]:
    """(every chunk, the deltas' tool-call pieces in order as (chunk number, piece))."""
    chunks = list(stream)
    pieces = [(n, call) for n, chunk in enumerate(chunks) for choice in chunk.choices
              for call in choice.delta.tool_calls or []]
    return chunks, pieces


def finish_reason(chunks) -> str | None:
    (reason,) = [choice.finish_reason for chunk in chunks for choice in chunk.choices if choice.finish_reason]
    return reason


@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_a_forced_call_streams_its_name_first_then_its_arguments(served, tool_choice):
    whole = ask(served, tool_choice).choices[0]
    (call,) = whole.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == ARGUMENTS
    assert call.id.startswith("chatcmpl-tool-") and whole.message.content is None
    # OpenAI's (and vLLM's) finish reasons: "tool_calls" for required calls, "stop" for a named one
    assert whole.finish_reason == ("tool_calls" if tool_choice == "required" else "stop")

    chunks, pieces = tool_call_chunks(ask(served, tool_choice, stream=True))
    assert len(pieces) > 1, f"the call came in {len(pieces)} chunk(s): {pieces}"
    first = pieces[0][1]
    assert (first.index, first.type, first.function.name) == (0, "function", "get_weather") and first.id
    assert all(piece.index == 0 and piece.id is None and piece.function.name is None for _, piece in pieces[1:])
    assert "".join(piece.function.arguments or "" for _, piece in pieces) == call.function.arguments
    # the name went out while the arguments were still being written
    assert pieces[0][0] < pieces[-1][0]
    assert finish_reason(chunks) == whole.finish_reason


@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_a_call_cut_by_max_tokens_streams_as_far_as_it_got(served, tool_choice):
    """vLLM's rules: the stream sends the call as far as it got, with finish_reason "length";
    a whole message has the named call's arguments so far, and no call for "required" (its
    array is not JSON)."""
    full = ask(served, tool_choice)
    arguments = full.choices[0].message.tool_calls[0].function.arguments
    cut = full.usage.completion_tokens - 6   # inside the city's long name
    chunks, pieces = tool_call_chunks(ask(served, tool_choice, stream=True, max_tokens=cut))
    assert finish_reason(chunks) == "length"
    assert pieces and pieces[0][1].function.name == "get_weather" and pieces[0][1].id
    streamed = "".join(piece.function.arguments or "" for _, piece in pieces)
    assert arguments.startswith(streamed) and len(streamed) < len(arguments), (streamed, arguments)
    assert not "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)

    whole = ask(served, tool_choice, max_tokens=cut).choices[0]
    assert whole.finish_reason == "length" and whole.message.content is None
    if tool_choice == "required":
        assert not whole.message.tool_calls
    else:
        assert [(c.function.name, c.function.arguments) for c in whole.message.tool_calls] == \
            [("get_weather", streamed)]


# ------------------------------------------------------------ parallel_tool_calls: false
TWO_HERMES_CALLS = "".join(f'<tool_call>\n{{"name": "{name}", "arguments": {{"city": "Paris"}}}}\n</tool_call>\n'
                           for name in ("get_weather", "get_time"))


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_tool_calls_false_keeps_the_first_of_the_models_calls(served, stream):
    """``tool_choice="auto"``: the model wrote two Hermes calls; vLLM returns the first only."""
    def names(parallel_tool_calls):
        forced = {"structured_outputs": {"regex": re.escape(TWO_HERMES_CALLS)}, "allowed_token_ids": None}
        reply = ask(served, "auto", TWO_TOOLS, stream=stream, parallel_tool_calls=parallel_tool_calls,
                    extra_body=forced)
        if not stream:
            assert reply.choices[0].finish_reason == "tool_calls"
            return [call.function.name for call in reply.choices[0].message.tool_calls]
        chunks, pieces = tool_call_chunks(reply)
        assert finish_reason(chunks) == "tool_calls"
        return [piece.function.name for _, piece in pieces if piece.function.name]

    assert names(True) == ["get_weather", "get_time"]
    assert names(False) == ["get_weather"]


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_tool_calls_false_makes_required_write_one_call(served, stream):
    """``tool_choice="required"``: the array may hold one call only (maxItems 1), so a model that
    would go on calling (here: "," pushed up wherever the grammar allows one) stops after one."""
    bias = {"logit_bias": {COMMA: 100}}
    if not stream:
        reply = ask(served, "required", TWO_TOOLS, parallel_tool_calls=False, extra_body=bias).choices[0]
        assert reply.finish_reason == "tool_calls" and len(reply.message.tool_calls) == 1, reply
        assert json.loads(reply.message.tool_calls[0].function.arguments) == ARGUMENTS
        return
    chunks, pieces = tool_call_chunks(ask(served, "required", TWO_TOOLS, parallel_tool_calls=False,
                                          stream=True, extra_body=bias))
    assert finish_reason(chunks) == "tool_calls"
    assert {piece.index for _, piece in pieces} == {0}
    assert json.loads("".join(piece.function.arguments or "" for _, piece in pieces)) == ARGUMENTS
