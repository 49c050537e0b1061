"""Repetition, frequency and presence penalties: vLLM's definitions, checked against
Hugging Face's RepetitionPenaltyLogitsProcessor and OpenAI's formula."""

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from microvllm.sample import Sampler, SamplingMetadata, make_generator
from microvllm.sample.penalties import apply_penalties, token_counts
from microvllm.sampling_params import SamplingParams

VOCAB = 50


def random_histories(num_reqs: int, seed: int):
    g = make_generator(seed)
    prompts = [torch.randint(0, VOCAB, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
               for _ in range(num_reqs)]
    outputs = [torch.randint(0, VOCAB, (int(torch.randint(0, 10, (1,), generator=g)),), generator=g).tolist()
               for _ in range(num_reqs)]
    return prompts, outputs


def test_token_counts_pads_rows_of_any_length():
    counts = token_counts([[4, 1], [], [2, 2, 5]], vocab_size=6)
    assert counts.tolist() == [[0, 1, 0, 0, 1, 0], [0] * 6, [0, 0, 2, 0, 0, 1]]


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_matches_hugging_face(penalty):
    prompts, outputs = random_histories(6, seed=1)
    logits = torch.randn(6, VOCAB, generator=make_generator(2)) * 3
    n = len(prompts)
    ours = apply_penalties(logits, prompts, outputs, torch.zeros(n), torch.zeros(n), torch.full((n,), penalty))
    hf = RepetitionPenaltyLogitsProcessor(penalty)
    for row in range(n):
        input_ids = torch.tensor([prompts[row] + outputs[row]])
        expected = hf(input_ids, logits[row:row + 1].clone())[0]
        assert torch.allclose(ours[row], expected), f"row {row}"


def test_frequency_and_presence_follow_openai():
    prompts, outputs = random_histories(5, seed=3)
    logits = torch.randn(5, VOCAB, generator=make_generator(4))
    frequency = torch.tensor([0.0, 0.5, -0.3, 1.0, 2.0])
    presence = torch.tensor([0.4, 0.0, 0.2, -1.0, 2.0])
    ours = apply_penalties(logits, prompts, outputs, presence, frequency, torch.ones(5))
    for row in range(5):
        expected = logits[row].clone()
        for token in set(outputs[row]):  # prompt tokens are not penalized by these two
            expected[token] -= frequency[row] * outputs[row].count(token) + presence[row]
        assert torch.allclose(ours[row], expected), f"row {row}"


def test_penalties_change_greedy_choice_only_for_rows_that_ask():
    # Token 3 is the clear favourite and was already generated once.
    logits = torch.zeros(2, 8)
    logits[:, 3], logits[:, 5] = 2.0, 1.5
    params = [SamplingParams(temperature=0, presence_penalty=1.0), SamplingParams(temperature=0)]
    metadata = SamplingMetadata.from_params(params, token_ids=[[1, 3], [1, 3]], num_prompt_tokens=[1, 1])
    assert Sampler()(logits, metadata).sampled_token_ids.tolist() == [5, 3]
    with pytest.raises(ValueError, match="token_ids="):
        SamplingMetadata.from_params(params)  # the history is required once a row has a penalty
    assert SamplingMetadata.from_params([SamplingParams()]).repetition_penalties is None
