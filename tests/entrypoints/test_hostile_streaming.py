"""Streams with several choices, through the ``openai`` client against a real server on
127.0.0.1 over the embedded SmolLM2-135M-Instruct (issue 38, item 6).

Each step's ``RequestOutput`` carries every choice of the request, finished ones too.
A stream must still end each choice exactly once::

    step    choice 0          choice 1            events sent
     5      "Paris"  stop     "The"               0: "Paris" + stop    1: "The"
     6      (finished)        " sky"              1: " sky"            <- nothing for 0
     7      (finished)        "." stop            1: "." + stop

Re-sending a finished choice's last chunk made an agent client accumulate a tool call's
arguments twice (``{"city": "Paris"}{"city": "Paris"}``), and print 41 finish events for
3 choices.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict

import pytest

from tests.entrypoints.test_structured_serving import MESSAGES, TOOLS, openai_client

SENTENCES = "Write three short sentences about the sea."


@pytest.fixture(scope="module")
def client(default_model_folder):
    with openai_client(default_model_folder, max_model_len=1024, max_num_seqs=8) as client:
        yield client


def finishes_per_choice(chunks) -> Counter:
    """How many events carried a ``finish_reason``, per choice index."""
    return Counter(choice.index for chunk in chunks for choice in chunk.choices if choice.finish_reason)


def accumulate_tool_calls(chunks) -> dict[int, dict[int, dict]]:
    """What an agent client does with streamed tool calls (openai's ``ChatCompletionStreamState``
    and LangChain do the same): per choice, per call index, the name is set once and the
    arguments are *concatenated* across chunks."""
    calls: dict[int, dict[int, dict]] = defaultdict(dict)
    for chunk in chunks:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                call = calls[choice.index].setdefault(delta.index, {"name": "", "arguments": ""})
                call["name"] = delta.function.name or call["name"]
                call["arguments"] += delta.function.arguments or ""
    return calls


@pytest.mark.parametrize("n", [1, 2, 4])
def test_streamed_tool_calls_accumulate_to_the_non_streamed_call(client, n):
    pytest.importorskip("xgrammar")
    # Sampled with a seed, the choices differ and end at different steps (greedy ones would
    # all end together), and the streamed request repeats the non-streamed one exactly. The
    # seed is one whose every choice ends in tool calls within max_tokens (with seed 11 the
    # CPU's draw, platforms/cpu/sampling.py, repeats the call until the length limit).
    request = dict(messages=MESSAGES, model="smollm2", tools=TOOLS, tool_choice="required", n=n,
                   max_tokens=200, temperature=1.0, seed=13)
    reply = client.chat.completions.create(**request)
    chunks = list(client.chat.completions.create(**request, stream=True))
    calls = accumulate_tool_calls(chunks)
    assert sorted(calls) == list(range(n))
    for choice in reply.choices:
        expected = [(call.function.name, json.loads(call.function.arguments)) for call in choice.message.tool_calls]
        got = [(call["name"], json.loads(call["arguments"])) for _, call in sorted(calls[choice.index].items())]
        assert got == expected, f"choice {choice.index}"
    assert finishes_per_choice(chunks) == {index: 1 for index in range(n)}


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("stop", [None, ["."]])
def test_each_chat_choice_ends_once(client, n, stop):
    chunks = list(client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": SENTENCES}], n=n, stop=stop, max_tokens=40,
        temperature=1.0, seed=5, stream=True, stream_options={"include_usage": True}))
    assert finishes_per_choice(chunks) == {index: 1 for index in range(n)}
    texts = defaultdict(str)
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    usage = [chunk.usage for chunk in chunks if chunk.usage is not None]
    assert len(usage) == 1 and not chunks[-1].choices, "one usage chunk, last"
    if stop:
        assert not any("." in text for text in texts.values()), texts


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("stop", [None, ["."]])
def test_each_completion_choice_ends_once_over_several_prompts(client, n, stop):
    prompts = ["The sea is", "Once upon a time", "My favourite food"]
    stream = client.completions.create(model="smollm2", prompt=prompts, n=n, stop=stop, max_tokens=30,
                                       temperature=1.0, seed=3, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert finishes_per_choice(chunks) == {index: 1 for index in range(len(prompts) * n)}
    texts = defaultdict(str)
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    usage = [chunk.usage for chunk in chunks if chunk.usage is not None]
    assert len(usage) == 1 and not chunks[-1].choices, "one usage chunk, last"
    whole = client.completions.create(model="smollm2", prompt=prompts, n=n, stop=stop, max_tokens=30,
                                      temperature=1.0, seed=3)
    assert usage[0].completion_tokens == whole.usage.completion_tokens
    assert [texts[c.index] for c in whole.choices] == [c.text for c in whole.choices]
