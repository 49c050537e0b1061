"""``forced_tool_calls.py`` on its own: a required array or a named function's parameters read
as tool calls, whole and cut into deltas at every place, and hostile text that never raises."""

from __future__ import annotations

import json
import random

import pytest

from microvllm.entrypoints.openai.forced_tool_calls import (
    ForcedToolCallStream,
    NamedToolCallStream,
    RequiredToolCallScanner,
    forced_tool_calls,
)

TWO_CALLS = ('[{"name": "get_weather", "parameters": {"city": "Pa\\"ris, [FR]", "days": [1, {"x": null}]}},\n'
             ' {"parameters": {"tz": "CET"}, "name": "get_time"}]')
ARGUMENTS = ['{"city": "Pa\\"ris, [FR]", "days": [1, {"x": null}]}', '{"tz": "CET"}']


def streamed(reader, pieces: list[str]) -> dict[int, dict]:
    """What a client makes of the deltas: per index, the name once (with the id), the arguments joined."""
    calls: dict[int, dict] = {}
    for text in pieces:
        for delta in reader.feed(text):
            if delta.id is not None:
                assert delta.index not in calls and delta.function.name and delta.type == "function", delta
                calls[delta.index] = {"name": delta.function.name, "arguments": ""}
            else:
                assert delta.function.name is None, "the name goes out once, with the id"
            calls[delta.index]["arguments"] += delta.function.arguments or ""
    return calls


def test_a_whole_array_gives_each_call_with_its_arguments_as_written():
    calls = forced_tool_calls(None, TWO_CALLS)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == \
        [("get_weather", ARGUMENTS[0]), ("get_time", ARGUMENTS[1])]
    assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function" for c in calls)
    assert [json.loads(a) for a in ARGUMENTS] == [json.loads(TWO_CALLS)[0]["parameters"], {"tz": "CET"}]


@pytest.mark.parametrize("cut", range(1, len(TWO_CALLS)))
def test_any_two_deltas_give_the_whole_arrays_calls(cut):
    calls = streamed(RequiredToolCallScanner(), [TWO_CALLS[:cut], TWO_CALLS[cut:]])
    assert calls == {0: {"name": "get_weather", "arguments": ARGUMENTS[0]},
                     1: {"name": "get_time", "arguments": ARGUMENTS[1]}}


def test_one_character_at_a_time_announces_each_name_before_its_arguments_end():
    reader, announced_at = RequiredToolCallScanner(), {}
    for position, ch in enumerate(TWO_CALLS):
        for delta in reader.feed(ch):
            if delta.id is not None:
                announced_at[delta.index] = position
    # call 0: once its name is closed and its parameters begun; call 1 wrote its parameters first
    assert announced_at[0] == TWO_CALLS.index('{"city"')
    assert announced_at[1] == TWO_CALLS.index('"get_time"') + len('"get_time"') - 1


def test_random_cuts_give_the_same_calls():
    rng = random.Random(7)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(TWO_CALLS)), rng.randint(1, 12)))
        pieces = [TWO_CALLS[a:b] for a, b in zip([0, *cuts], [*cuts, len(TWO_CALLS)])]
        assert [c["arguments"] for c in streamed(RequiredToolCallScanner(), pieces).values()] == ARGUMENTS


def test_a_cut_array_streams_as_far_as_it_got_but_a_whole_one_has_no_call():
    cut = TWO_CALLS[:TWO_CALLS.index("FR")]
    assert streamed(RequiredToolCallScanner(), [cut]) == {0: {"name": "get_weather",
                                                              "arguments": '{"city": "Pa\\"ris, ['}}
    assert forced_tool_calls(None, cut) == []   # vLLM: the array is not JSON, so no call


def test_a_named_function_streams_every_piece_as_arguments():
    calls = streamed(NamedToolCallStream("get_weather"), ['{"ci', "", 'ty": ', '"Paris"}'])
    assert calls == {0: {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    (whole,) = forced_tool_calls("get_weather", '{"city": "Paris"}')
    assert whole["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert forced_tool_calls("get_weather", "  \n") == []


def test_finish_reasons_are_openais():
    required, named = ForcedToolCallStream(None), ForcedToolCallStream("get_weather")
    assert required.finish_reason("stop") == "stop"   # no call went out
    required.feed(TWO_CALLS)
    named.feed("{}")
    assert (required.finish_reason("stop"), required.finish_reason("length")) == ("tool_calls", "length")
    assert named.finish_reason("stop") == "stop"


@pytest.mark.parametrize("text", [
    "[" * 20_000, "[{" * 10_000, '[{"name": "f", "parameters": ' + "[" * 20_000,
    '[{"name": "f", "parameters": ' + "{" * 20_000 + "}" * 20_000 + "}]",
    "not json", "{}", "[1, 2]", '["a"]', "]]]}}}", '[{"name": 7, "parameters": {}}]', '[{"name": "\\ud800"',
    '[{"name": "f", "parameters": 12 }]', '[{"na\\"me": "f", "parameters": true}]', "\\" * 1000])
def test_hostile_text_never_raises(text):
    """What the grammar should rule out, and deep nesting, which costs a counter (no recursion)."""
    for cut in (1, 7, len(text)):
        reader = RequiredToolCallScanner()
        for start in range(0, len(text), cut):
            reader.feed(text[start:start + cut])
    assert isinstance(forced_tool_calls(None, text), list)


def test_deep_parameters_stream_in_full():
    parameters = "[" * 5_000 + "]" * 5_000
    text = '[{"name": "f", "parameters": ' + parameters + "}]"
    assert streamed(RequiredToolCallScanner(), [text[i:i + 3] for i in range(0, len(text), 3)]) == \
        {0: {"name": "f", "arguments": parameters}}
    # json.loads gives up past Python's recursion limit: the whole message has no call then, and no error
    assert forced_tool_calls(None, text) == []
