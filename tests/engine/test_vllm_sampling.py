"""Penalties, logprobs and prompt logprobs end to end on a tiny model, against Hugging
Face: ``generate(repetition_penalty=...)`` and the log-softmax of its own logits."""

import pytest
import torch

from microvllm import LLM, Logprob, SamplingParams
from tests.engine.conftest import hf_model

PROMPT = [5, 17, 99, 17, 300, 42, 7, 7, 250, 13, 61, 400, 9, 17, 5, 88, 120, 31, 2 + 1]


@pytest.fixture(scope="module")
def llm(tiny_models):
    # A 16-token budget makes the 19-token prompt arrive in two chunks.
    return LLM(str(tiny_models["llama"]), max_model_len=128, max_num_batched_tokens=16,
               debug_invariants=True)


def test_repetition_penalty_greedy_matches_hugging_face(llm, tiny_models):
    model = hf_model(str(tiny_models["llama"]))
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        plain = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
                               min_new_tokens=12, pad_token_id=0, eos_token_id=None)
        expected = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=12, min_new_tokens=12, pad_token_id=0,
                                  eos_token_id=None, repetition_penalty=1.8)
    expected = expected[0, len(PROMPT):].tolist()
    assert expected != plain[0, len(PROMPT):].tolist(), "the penalty must matter on this prompt"
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.8)
    out = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == expected


def test_frequency_penalty_stops_a_greedy_loop(llm):
    free = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    loop = llm.generate({"prompt_token_ids": PROMPT}, free, use_tqdm=False)[0].outputs[0].token_ids
    penalized = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, frequency_penalty=2.0)
    ids = llm.generate({"prompt_token_ids": PROMPT}, penalized, use_tqdm=False)[0].outputs[0].token_ids
    most_repeated = max(loop.count(t) for t in set(loop))
    assert max(ids.count(t) for t in set(ids)) < most_repeated


def hf_logprobs(tiny_models, token_ids: list[int]) -> torch.Tensor:
    """log_softmax of Hugging Face's logits at every position of ``token_ids``."""
    model = hf_model(str(tiny_models["llama"]))
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float().log_softmax(-1)


def test_sample_and_prompt_logprobs_match_hugging_face(llm, tiny_models):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    out = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0]
    completion = out.outputs[0]
    reference = hf_logprobs(tiny_models, PROMPT + completion.token_ids)

    assert len(out.prompt_logprobs) == len(PROMPT) and out.prompt_logprobs[0] is None
    for position in range(1, len(PROMPT)):
        entry, row = out.prompt_logprobs[position], reference[position - 1]
        token = PROMPT[position]
        assert isinstance(entry[token], Logprob)
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert entry[token].rank == int((row >= row[token]).sum())
        top = row.topk(2).indices.tolist()
        assert set(entry) == {token, *top}  # the prompt's token, then the top 2
        assert [entry[t].rank for t in top] == [1, 2]
        assert entry[token].decoded_token == llm.tokenizer.decode([token], skip_special_tokens=False)

    for step, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        row = reference[len(PROMPT) - 1 + step]
        assert list(entry)[0] == token and entry[token].rank == 1
        assert {t: round(v.logprob, 4) for t, v in entry.items()} == \
            {t: round(row[t].item(), 4) for t in row.topk(3).indices.tolist()}


def test_prompt_logprobs_bypass_the_prefix_cache(llm):
    plain = SamplingParams(temperature=0, max_tokens=2)
    llm.generate({"prompt_token_ids": PROMPT}, plain, use_tqdm=False)  # caches the prompt's block
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0)
    out = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    assert all(entry is not None for entry in out.prompt_logprobs[1:])
    assert all(len(entry) == 1 for entry in out.prompt_logprobs[1:])
