"""Structured outputs after the reasoning (vLLM's rule, ``reasoning_parser="qwen3"``): the
model thinks freely, and the grammar is in force from the token after ``</think>``.

The tiny random model never chooses to stop thinking, so ``logit_bias`` on the ``</think>``
token (one token of its vocabulary here, as in Qwen3's) makes it do so after a few tokens
of sampled "reasoning". The grammar is the only thing that keeps what follows on track.
"""

from __future__ import annotations

import re

import pytest

from microvllm import LLM, SamplingParams
from microvllm.models.tiny import make_tiny_model
from microvllm.sampling_params import StructuredOutputsParams
from microvllm.structured_output import StructuredOutputManager
from microvllm.tokenizer import Tokenizer

THINK = ("<think>", "</think>")
PATTERN = "[0-9]{3}"
SETTINGS = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, structured_outputs_backend="course")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("gate") / "llama", "llama", seed=5, added_tokens=THINK))


@pytest.fixture(scope="module")
def end_id(folder):
    return Tokenizer.from_pretrained(folder).hf_tokenizer.get_vocab()["</think>"]


def params(end_id: int, seed: int, **extra) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=60, logit_bias={end_id: 4.0},
                          structured_outputs=StructuredOutputsParams(regex=PATTERN), **extra)


PROMPTS = ["The capital of France is", "Once upon a time", "1 2 3 4", "Hello, world!"]


def run(llm: LLM, end_id: int) -> list[str]:
    outputs = llm.generate(PROMPTS, [params(end_id, seed) for seed in range(len(PROMPTS))], use_tqdm=False)
    return [out.outputs[0].text for out in outputs]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_grammar_holds_only_after_the_reasoning(folder, end_id, async_scheduling):
    llm = LLM(folder, reasoning_parser="qwen3", async_scheduling=async_scheduling, **SETTINGS)
    texts = run(llm, end_id)
    reasonings = []
    for text in texts:
        reasoning, end, answer = text.partition("</think>")
        assert end, f"the biased model never ended its reasoning: {text!r}"
        assert re.fullmatch(PATTERN, answer), f"what follows the reasoning breaks the grammar: {text!r}"
        reasonings.append(reasoning)
    # The reasoning was free: some of it is text the grammar would have refused.
    assert any(reasoning and not re.fullmatch("[0-9]*", reasoning) for reasoning in reasonings), reasonings
    assert not llm.llm_engine.structured_output_manager.reasoning_ended, "the finished requests' gates were kept"


def test_async_scheduling_gives_the_same_answers(folder, end_id):
    """With async scheduling a step is planned before the last one's token is known: a step
    that ends the reasoning must be seen before the next one is masked (or not)."""
    assert (run(LLM(folder, reasoning_parser="qwen3", **SETTINGS), end_id)
            == run(LLM(folder, reasoning_parser="qwen3", async_scheduling=True, **SETTINGS), end_id))


def test_without_a_reasoning_parser_the_grammar_holds_from_the_first_token(folder, end_id):
    for text in run(LLM(folder, **SETTINGS), end_id):
        assert re.fullmatch(PATTERN, text), text


def test_a_prompt_that_ends_the_reasoning_puts_the_grammar_in_force_at_once(folder, end_id):
    """Qwen3's template with ``enable_thinking=False`` writes an empty ``<think></think>``
    into the prompt: the answer is under the grammar from its first token."""
    llm = LLM(folder, reasoning_parser="qwen3", **SETTINGS)
    out = llm.generate(["Answer:<think>\n\n</think>\n\n"], params(end_id, 0), use_tqdm=False)[0]
    assert re.fullmatch(PATTERN, out.outputs[0].text), out.outputs[0].text


def test_the_gate_step_by_step(folder, end_id):
    """The manager's bookkeeping: no mask and nothing taken while reasoning; in the step that
    ends it, only the tokens after the end tag."""
    tokenizer = Tokenizer.from_pretrained(folder)
    start_id = tokenizer.hf_tokenizer.get_vocab()["<think>"]
    manager = StructuredOutputManager(tokenizer, 512, "course", reasoning_parser="qwen3")
    grammar = manager.compile(params(end_id, 0), 1)[0]
    manager.add("r", grammar, prompt_token_ids=[5, 6, start_id])
    assert not manager.should_fill_bitmask("r")
    assert manager.tokens_for_grammar("r", [40, 41]) == []
    seven, eight = tokenizer.encode("7", add_special_tokens=False), tokenizer.encode("8", add_special_tokens=False)
    assert manager.tokens_for_grammar("r", [42, end_id, *seven]) == seven
    assert manager.should_fill_bitmask("r")
    assert manager.tokens_for_grammar("r", eight) == eight
    manager.remove("r")
    assert "r" not in manager.reasoning_ended
    # A prompt whose last think tag is an end tag; a prompt with no think tag at all.
    manager.add("off", grammar, prompt_token_ids=[start_id, end_id, 9])
    manager.add("none", grammar, prompt_token_ids=[9, 10])
    assert manager.should_fill_bitmask("off") and not manager.should_fill_bitmask("none")


def test_a_model_without_think_tokens_is_refused_at_start(tmp_path):
    folder = make_tiny_model(tmp_path / "plain", "llama", seed=5)
    with pytest.raises(ValueError, match=r"'<think>' and '</think>' must each be one token.*--reasoning-parser"):
        LLM(str(folder), reasoning_parser="qwen3", **SETTINGS)


def test_serve_flag_sets_the_engines_gate():
    """``microvllm serve --reasoning-parser qwen3``: one flag for both the engine's gate
    (an ``EngineArgs`` setting, as in vLLM) and the server's split of the message."""
    import argparse

    from microvllm.cli.serve import add_serve_args
    from microvllm.engine.arg_utils import EngineArgs

    args = add_serve_args(argparse.ArgumentParser()).parse_args(["m", "--reasoning-parser", "qwen3"])
    assert EngineArgs.from_cli_args(args).reasoning_parser == "qwen3"
    with pytest.raises(ValueError, match="no reasoning parser named 'r1'.*deepseek_r1"):
        EngineArgs(reasoning_parser="r1").create_engine_config()


@pytest.mark.parametrize("stream", [False, True])
def test_a_required_tool_call_after_the_reasoning_through_the_server(folder, end_id, stream):
    """A required call (``tool_choice`` names the function) on a server run with ``--reasoning-parser qwen3``: the model
    thinks freely, then writes the calls' JSON under the grammar; the message carries the
    reasoning and the calls (not the JSON as text, not the reasoning as a broken call)."""
    import json

    import jsonschema
    import openai

    from microvllm.engine.async_llm import AsyncLLM
    from microvllm.entrypoints.openai.api_server import build_app
    from tests.support import LLM_SETTINGS, ThreadServer

    city = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 5}}, "required": ["city"],
            "additionalProperties": False}
    tokenizer = Tokenizer.from_pretrained(folder)
    bias = {str(i): -8.0 for i in range(tokenizer.vocab_size) if not tokenizer.decode([i]).strip()}  # no wandering
    bias[str(end_id)] = 4.0
    engine = AsyncLLM(folder, reasoning_parser="qwen3", **LLM_SETTINGS)
    server = ThreadServer(build_app(engine, "tiny", reasoning_parser="qwen3"))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        answer = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Weather?"}], n=3, seed=4,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            tools=[{"type": "function", "function": {"name": "get_weather", "parameters": city}}],
            temperature=1.0, max_tokens=200, logit_bias=bias, stream=stream)
        if stream:
            reasoning, calls, finish = ["", "", ""], [[], [], []], [None] * 3
            for chunk in answer:
                for choice in chunk.choices:
                    reasoning[choice.index] += (choice.delta.model_extra or {}).get("reasoning") or ""
                    for piece in choice.delta.tool_calls or []:   # the name first, then the arguments
                        if piece.function.name is not None:
                            calls[choice.index].append(piece.model_copy(deep=True))
                        else:
                            calls[choice.index][piece.index].function.arguments += piece.function.arguments
                    assert not choice.delta.content, choice.delta
                    finish[choice.index] = choice.finish_reason or finish[choice.index]
        else:
            reasoning = [c.message.model_extra["reasoning"] for c in answer.choices]
            calls = [c.message.tool_calls for c in answer.choices]
            finish = [c.finish_reason for c in answer.choices]
    finally:
        server.stop()
        engine.shutdown()
    # a named function's call ends the turn with "stop" (OpenAI's and vLLM's finish reason)
    assert finish == ["stop"] * 3 and all(reasoning), (finish, reasoning)
    for made in calls:
        assert [call.function.name for call in made] and {call.function.name for call in made} == {"get_weather"}
        for call in made:
            jsonschema.validate(json.loads(call.function.arguments), city)


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_switched_off_puts_the_grammar_in_force_from_the_first_token(folder, stream):
    """``chat_template_kwargs={"enable_thinking": false}`` on a server with ``--reasoning-parser
    qwen3``: the model writes no reasoning, so the regex holds from its first token (vLLM's
    rule: the gate is built per request from the chat's template kwargs), even though this
    tiny model's template writes no empty ``<think></think>`` into the prompt."""
    import openai

    from microvllm.engine.async_llm import AsyncLLM
    from microvllm.entrypoints.openai.api_server import build_app
    from tests.support import LLM_SETTINGS, ThreadServer

    engine = AsyncLLM(folder, reasoning_parser="qwen3", **LLM_SETTINGS)
    server = ThreadServer(build_app(engine, "tiny", reasoning_parser="qwen3"))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        answers = []
        for seed in range(4):
            answer = client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "Three digits?"}], seed=seed, temperature=1.0,
                max_tokens=20, stream=stream, extra_body={"structured_outputs": {"regex": PATTERN},
                                                          "chat_template_kwargs": {"enable_thinking": False}})
            if stream:
                answers.append("".join(chunk.choices[0].delta.content or "" for chunk in answer if chunk.choices))
            else:
                assert answer.choices[0].message.model_extra.get("reasoning") is None
                answers.append(answer.choices[0].message.content)
    finally:
        server.stop()
        engine.shutdown()
    assert all(re.fullmatch(PATTERN, text or "") for text in answers), answers
