"""Sampler: exact greedy, filters that keep exactly the right tokens, temperature that
reshapes the distribution, seeded rows independent of the batch, raw logprobs."""

import pytest
import torch

from microvllm.sample import Sampler, SamplingMetadata, apply_min_tokens_penalty, make_generator
from microvllm.sampling_params import SamplingParams

# A distribution whose filters have unambiguous answers (no ties, no near-ties).
PROBS = torch.tensor([0.35, 0.25, 0.15, 0.10, 0.08, 0.04, 0.02, 0.01])
LOGITS = PROBS.log()


def sample_many(params: SamplingParams, num_samples: int = 4000, logits=LOGITS, seed=0):
    """Sample num_samples times from the same logits (one big batch) -> token ids."""
    batch = logits.expand(num_samples, -1).contiguous()
    metadata = SamplingMetadata.from_params([params] * num_samples)
    return Sampler(seed=seed)(batch, metadata).sampled_token_ids


def support(params: SamplingParams) -> set[int]:
    return set(sample_many(params).tolist())


# ---- greedy ----------------------------------------------------------------------

def test_greedy_is_argmax():
    logits = torch.randn(16, 1000, generator=make_generator(0))
    metadata = SamplingMetadata.from_params([SamplingParams(temperature=0.0)] * 16)
    assert metadata.all_greedy
    out = Sampler()(logits, metadata)
    assert out.sampled_token_ids.dtype == torch.int64
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.logprobs_tensors is None


def test_greedy_rows_in_a_mixed_batch_are_argmax():
    logits = torch.randn(6, 500, generator=make_generator(1))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.5),
              SamplingParams(temperature=0.9, top_k=1), SamplingParams(top_p=0.5),
              SamplingParams(temperature=0.0, seed=3), SamplingParams(min_p=0.2)]
    metadata = SamplingMetadata.from_params(params, [None] * 6)
    assert not metadata.all_greedy and not metadata.all_random
    sampled = Sampler()(logits, metadata).sampled_token_ids
    argmax = logits.argmax(dim=-1)
    for row in (0, 2, 4):
        assert sampled[row] == argmax[row]


def test_caller_logits_are_not_modified():
    logits = torch.randn(3, 50, generator=make_generator(2))
    before = logits.clone()
    params = [SamplingParams(top_k=5, top_p=0.5, min_p=0.1, temperature=0.5, min_tokens=4)] * 3
    metadata = SamplingMetadata.from_params(params, num_output_tokens=[0, 0, 0], eos_token_ids={2})
    Sampler()(logits, metadata)
    assert torch.equal(logits, before)


# ---- filters: the support is exactly right -----------------------------------------

def test_no_filter_draws_every_token():
    assert support(SamplingParams(temperature=1.0)) == set(range(8))


@pytest.mark.parametrize("params, expected", [
    (SamplingParams(top_k=3), {0, 1, 2}),
    (SamplingParams(top_k=1, temperature=1.0), {0}),
    (SamplingParams(top_k=100), set(range(8))),
    # Mass above each token: 0, .35, .60, .75, .85 ... -> keep while it is < top_p.
    (SamplingParams(top_p=0.7), {0, 1, 2}),
    (SamplingParams(top_p=0.55), {0, 1}),
    (SamplingParams(top_p=0.01), {0}),  # the top token always stays
    # min_p: keep p >= min_p * 0.35.
    (SamplingParams(min_p=0.3), {0, 1, 2}),      # threshold .105
    (SamplingParams(min_p=0.2), {0, 1, 2, 3, 4}),  # threshold .07
    # top-k first, then top-p on the renormalized 5 (mass above: 0 .38 .65 .81 .91).
    # top-p before top-k would keep token 4 as well.
    (SamplingParams(top_k=5, top_p=0.9), {0, 1, 2, 3}),
])
def test_filters_keep_exactly_the_right_tokens(params, expected):
    assert support(params) == expected


def test_each_row_uses_its_own_filter():
    params = [SamplingParams(top_k=2), SamplingParams(top_p=0.7), SamplingParams(min_p=0.2),
              SamplingParams()]
    rows_per_params = 1000
    batch_params = [p for p in params for _ in range(rows_per_params)]  # one batch, 4 kinds of rows
    batch = LOGITS.expand(len(batch_params), -1)
    sampled = Sampler(seed=0)(batch, SamplingMetadata.from_params(batch_params)).sampled_token_ids
    seen = [set(chunk.tolist()) for chunk in sampled.split(rows_per_params)]
    assert seen == [{0, 1}, {0, 1, 2}, {0, 1, 2, 3, 4}, set(range(8))]


def test_unused_filters_are_left_out():
    metadata = SamplingMetadata.from_params([SamplingParams(), SamplingParams(temperature=0.0,
                                                                              top_k=5)])
    assert metadata.top_k is None and metadata.top_p is None and metadata.min_p is None
    metadata = SamplingMetadata.from_params([SamplingParams(), SamplingParams(top_k=5)])
    assert metadata.top_k.tolist() == [0, 5]


# ---- the distribution itself -------------------------------------------------------

def frequencies(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab_size).float() / len(tokens)


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_temperature_reshapes_the_distribution(temperature):
    """p_T ∝ p^(1/T): sharper below 1, flatter above. 20,000 draws put each
    frequency within ~0.004 (one standard deviation) of the truth; 0.015 is ~4."""
    probs = torch.tensor([0.5, 0.3, 0.2])
    expected = probs ** (1 / temperature) / (probs ** (1 / temperature)).sum()
    tokens = sample_many(SamplingParams(temperature=temperature), 20_000, logits=probs.log())
    observed = frequencies(tokens, 3)
    assert torch.allclose(observed, expected, atol=0.015), (observed, expected)
    if temperature != 1.0:  # and it is measurably not the untempered distribution
        assert (observed - probs).abs().max() > 0.05


def test_filtered_distribution_is_renormalized():
    tokens = sample_many(SamplingParams(top_k=3), 20_000)
    expected = torch.zeros(8)
    expected[:3] = PROBS[:3] / PROBS[:3].sum()
    assert torch.allclose(frequencies(tokens, 8), expected, atol=0.015)


# ---- seeds ------------------------------------------------------------------------

VOCAB = 1000
NUM_STEPS = 5


def step_logits(step: int, num_rows: int) -> torch.Tensor:
    """Flat-ish logits (many plausible tokens), fixed per step."""
    return torch.randn(num_rows, VOCAB, generator=make_generator(100 + step))


def run_seeded(seed: int, position: int, others: list[SamplingParams]) -> list[int]:
    """The tokens of one seeded request sitting at row `position` among `others`."""
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=seed)
    generator = make_generator(seed)  # owned by the request, kept across steps
    other_generators = [make_generator(50 + i) if p.seed is not None else None
                        for i, p in enumerate(others)]
    sampler = Sampler(seed=position)  # unseeded rows' stream differs run to run
    tokens = []
    for step in range(NUM_STEPS):
        batch_params = others[:position] + [params] + others[position:]
        generators = other_generators[:position] + [generator] + other_generators[position:]
        logits = step_logits(step, len(batch_params))
        own_row = step_logits(step, 1)[0]
        logits[position] = own_row
        metadata = SamplingMetadata.from_params(batch_params, generators)
        tokens.append(int(sampler(logits, metadata).sampled_token_ids[position]))
    return tokens


OTHERS = [SamplingParams(temperature=0.7), SamplingParams(temperature=0.0),
          SamplingParams(temperature=1.3, top_k=20, seed=9), SamplingParams(min_p=0.05)]


def test_seeded_request_is_independent_of_the_batch():
    alone = run_seeded(seed=1234, position=0, others=[])
    assert len(set(alone)) > 1  # it really samples
    for position in (0, 2, 4):
        assert run_seeded(1234, position, OTHERS) == alone
    assert run_seeded(1234, 1, OTHERS[:2]) == alone


def test_different_seeds_give_different_tokens():
    assert run_seeded(1234, 0, []) != run_seeded(4321, 0, [])


def test_unseeded_rows_follow_the_sampler_seed():
    logits = step_logits(0, 8)
    metadata = SamplingMetadata.from_params([SamplingParams()] * 8)
    first = Sampler(seed=7)(logits, metadata).sampled_token_ids
    assert torch.equal(first, Sampler(seed=7)(logits, metadata).sampled_token_ids)
    assert not torch.equal(first, Sampler(seed=8)(logits, metadata).sampled_token_ids)


def test_generators_only_for_seeded_random_rows():
    generators = [make_generator(1), make_generator(2), None]
    params = [SamplingParams(seed=1), SamplingParams(seed=2, temperature=0.0), SamplingParams()]
    metadata = SamplingMetadata.from_params(params, generators)
    assert metadata.generators == {0: generators[0]}
    with pytest.raises(ValueError, match="2 generators for 3 requests"):
        SamplingMetadata.from_params(params, generators[:2])


# ---- logprobs ---------------------------------------------------------------------

def test_logprobs_are_the_raw_log_softmax_top_n():
    logits = torch.randn(4, 300, generator=make_generator(3))
    params = [SamplingParams(temperature=0.0, logprobs=5), SamplingParams(temperature=0.3),
              SamplingParams(top_k=3, logprobs=2), SamplingParams(temperature=2.0, logprobs=0)]
    out = Sampler()(logits, SamplingMetadata.from_params(params))
    lp = out.logprobs_tensors
    assert lp.logprob_token_ids.shape == lp.logprobs.shape == (4, 6)  # sampled + max N = 5
    reference = torch.log_softmax(logits, dim=-1)  # before temperature and filters
    top_values, top_ids = reference.topk(5, dim=-1)
    sampled = out.sampled_token_ids
    assert torch.equal(lp.logprob_token_ids[:, 0], sampled)
    assert torch.allclose(lp.logprobs[:, 0], reference.gather(-1, sampled[:, None])[:, 0])
    assert torch.equal(lp.logprob_token_ids[:, 1:], top_ids)
    assert torch.allclose(lp.logprobs[:, 1:], top_values)
    expected_ranks = (reference >= reference.gather(-1, sampled[:, None])).sum(-1)
    assert torch.equal(lp.selected_token_ranks, expected_ranks)
    assert lp.selected_token_ranks[0] == 1  # greedy took the most likely token
    ids, values, ranks = lp.tolists()
    assert len(ids) == 4 and len(values[0]) == 6 and ranks[0] == 1


def test_logprobs_zero_returns_only_the_sampled_token():
    logits = torch.randn(2, 30, generator=make_generator(4))
    out = Sampler()(logits, SamplingMetadata.from_params([SamplingParams(logprobs=0)] * 2))
    assert out.logprobs_tensors.logprobs.shape == (2, 1)


# ---- min_tokens -------------------------------------------------------------------

def test_min_tokens_bans_eos_and_stop_ids_until_enough_tokens():
    logits = torch.zeros(3, 10)
    logits[:, 2] = 5.0  # eos is the favourite
    logits[:, 7] = 4.0  # then a stop token id
    logits[:, 4] = 3.0
    params = [SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[7]),
              SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[7], ignore_eos=True),
              SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[7])]
    metadata = SamplingMetadata.from_params(params, num_output_tokens=[1, 1, 3],
                                            eos_token_ids={2})
    assert metadata.min_tokens_banned_ids == {0: {2, 7}, 1: {7}}
    assert Sampler()(logits, metadata).sampled_token_ids.tolist() == [4, 2, 2]


def test_apply_min_tokens_penalty_in_place():
    logits = torch.zeros(3, 5)
    apply_min_tokens_penalty(logits, [(0, [1, 2]), (2, {4})])
    assert torch.isinf(logits).nonzero().tolist() == [[0, 1], [0, 2], [2, 4]]
    apply_min_tokens_penalty(logits, [])  # nothing to do is fine


def test_wrong_logits_shape_is_explained():
    metadata = SamplingMetadata.from_params([SamplingParams()] * 2)
    with pytest.raises(ValueError, match="one row per request"):
        Sampler()(torch.zeros(3, 10), metadata)
