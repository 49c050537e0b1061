"""logit_bias, allowed_token_ids, bad_words and truncate_prompt_tokens (vLLM's
SamplingParams fields), from the tensor functions up to the engine."""

import pytest
import torch

from microvllm import LLM, SamplingParams
from microvllm.models.tiny import make_tiny_model
from microvllm.sample.logits_processors import apply_allowed_token_ids, apply_logit_bias, bad_words_banned_ids

GREEDY = dict(temperature=0, max_tokens=10, ignore_eos=True)
PROMPT = "hello there, how are you"


def test_apply_logit_bias_adds_per_row():
    logits = torch.zeros(3, 6)
    apply_logit_bias(logits, {0: {1: 2.5, 4: -1.0}, 2: {5: 3.0}})
    expected = torch.zeros(3, 6)
    expected[0, 1], expected[0, 4], expected[2, 5] = 2.5, -1.0, 3.0
    assert torch.equal(logits, expected)


def test_apply_allowed_token_ids_keeps_only_those():
    logits = torch.randn(3, 7, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    apply_allowed_token_ids(logits, {1: [2, 5]})
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    assert torch.isinf(logits[1]).tolist() == [True, True, False, True, True, False, True]
    assert logits[1, 2] == before[1, 2] and logits[1, 5] == before[1, 5]


@pytest.mark.parametrize("output, banned", [
    ([1, 2, 3], {9, 4}),    # ends with 3: [3, 4] completes; [9] always
    ([1, 2], {9}),
    ([], {9}),
    ([7, 8], {9, 6}),       # [7, 8, 6] completes after [7, 8]
])
def test_bad_words_banned_ids(output, banned):
    assert bad_words_banned_ids([[9], [3, 4], [7, 8, 6]], output) == banned


def test_params_validate_and_convert():
    assert SamplingParams(logit_bias={"12": -100}).logit_bias == {12: -100}
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={"a": 1})
    with pytest.raises(ValueError, match=r"logit_bias\[3\]"):
        SamplingParams(logit_bias={3: 101})
    with pytest.raises(ValueError, match="allowed_token_ids is empty"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=0)
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=["  "])
    p = SamplingParams(bad_words=["x"], allowed_token_ids=[1, 2])
    assert p.clone() == p and p.clone().bad_words is not p.bad_words


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    torch.set_num_threads(1)
    folder = make_tiny_model(tmp_path_factory.mktemp("lp") / "llama", "llama", seed=7)
    return LLM(str(folder), max_model_len=256, max_num_seqs=8)


def generate(llm, **params):
    return llm.generate([PROMPT], SamplingParams(**params), use_tqdm=False)[0]


def test_logit_bias_moves_greedy_choices(llm):
    base = generate(llm, **GREEDY).outputs[0].token_ids
    assert generate(llm, **GREEDY, logit_bias={"5": 100}).outputs[0].token_ids == [5] * 10
    avoided = generate(llm, **GREEDY, logit_bias={base[0]: -100}).outputs[0].token_ids
    assert base[0] not in avoided
    # Logprobs are the model's own, before the bias (as in vLLM).
    plain = generate(llm, **GREEDY, logprobs=0).outputs[0].logprobs[0][base[0]].logprob
    biased = generate(llm, **{**GREEDY, "max_tokens": 1}, logprobs=0, logit_bias={base[0]: 5})
    assert biased.outputs[0].logprobs[0][base[0]].logprob == pytest.approx(plain)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_allowed_token_ids_are_all_that_is_sampled(llm, temperature):
    allowed = [7, 9, 11, 200]
    out = generate(llm, **{**GREEDY, "temperature": temperature, "max_tokens": 30}, seed=3,
                   allowed_token_ids=allowed).outputs[0].token_ids
    assert len(out) == 30 and set(out) <= set(allowed)


def test_allowed_token_ids_greedy_is_argmax_over_them(llm):
    """Greedy with allowed ids takes the allowed id the model finds most likely (each id's
    raw logprob read from a run allowed only that id)."""
    allowed = [7, 9, 11, 200]
    one = dict(GREEDY, max_tokens=1, logprobs=0)
    chosen = generate(llm, **one, allowed_token_ids=allowed).outputs[0].token_ids[0]
    logprob = {t: generate(llm, **one, allowed_token_ids=[t]).outputs[0].logprobs[0][t].logprob
               for t in allowed}
    assert chosen == max(allowed, key=logprob.get)


def test_bad_words_never_complete(llm):
    tokenizer = llm.engine.prompts.tokenizer
    base = generate(llm, **GREEDY).outputs[0].token_ids
    word = tokenizer.decode(base[:2])
    out = generate(llm, **GREEDY, bad_words=[word]).outputs[0].token_ids
    sequences = llm.engine.prompts.bad_words_token_ids([word])
    for seq in sequences:
        assert not any(out[i:i + len(seq)] == seq for i in range(len(out))), (seq, out)
    assert out != base


def test_truncate_prompt_tokens_keeps_the_end(llm):
    full = llm.engine.prompts.tokenizer.encode(PROMPT)
    out = generate(llm, **GREEDY, truncate_prompt_tokens=3)
    assert out.prompt_token_ids == full[-3:]
    same = llm.generate([{"prompt_token_ids": full[-3:]}], SamplingParams(**GREEDY), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == same.outputs[0].token_ids


@pytest.mark.parametrize("field, value, message", [
    ("logprobs", 21, "max_logprobs=20"),
    ("prompt_logprobs", 21, "max_logprobs=20"),
    ("stop_token_ids", [10**6], "stop_token_ids contains"),
    ("allowed_token_ids", [10**6], "allowed_token_ids contains"),
    ("logit_bias", {10**6: 1.0}, "logit_bias contains"),
])
def test_values_the_model_cannot_honour_are_refused_at_the_door(llm, field, value, message):
    with pytest.raises(ValueError, match=message):
        generate(llm, **GREEDY, min_tokens=3, **{field: value})
    assert generate(llm, **GREEDY).finished   # and the LLM goes on
