"""The CPU's random draw (``platforms/cpu/sampling.py``, inverse CDF) against the sampler's
own (the exponential race): the same distribution, measured on many draws from fresh
random probabilities; seeds fix tokens wherever a row sits; the engine binds it by
default and not with ``enforce_eager=True``."""

import math

import pytest
import torch

from microvllm.platforms.cpu.sampling import inverse_cdf_sample, random_sample_forward
from microvllm.sample.sampler import RandomSample
from microvllm.sample.topk_topp_sampler import random_sample
from tests.attention.cases import seed_for

DRAWS = 40_000


def frequencies(draw, probs_row: torch.Tensor, seed: int) -> torch.Tensor:
    """How often each token wins over DRAWS rows that all hold ``probs_row`` (one step)."""
    probs = probs_row.expand(DRAWS, -1).contiguous()
    tokens = draw(probs, {}, torch.Generator().manual_seed(seed))
    return torch.bincount(tokens, minlength=probs_row.numel()).double() / DRAWS


def assert_within_five_sigma(freq: torch.Tensor, probs_row: torch.Tensor, who: str):
    p = probs_row.double() / probs_row.double().sum()
    sigma = (p * (1 - p) / DRAWS).sqrt()
    worst = ((freq - p).abs() - 5 * sigma).max()
    assert worst <= 1e-12, f"{who}: a token's frequency is > 5 sigma from its probability by {worst:.2e}"


@pytest.mark.parametrize("vocab,temperature", [(4, 1.0), (50, 1.0), (50, 0.3), (1000, 2.0)])
def test_both_draws_follow_the_probabilities(vocab, temperature, request):
    g = torch.Generator().manual_seed(seed_for(request.node.name))
    logits = torch.randn(vocab, generator=g) * 3
    logits[torch.randperm(vocab, generator=g)[: vocab // 4]] = float("-inf")   # filtered-out tokens
    probs_row = (logits / temperature).softmax(-1)
    for name, draw in (("inverse CDF", inverse_cdf_sample), ("exponential race", random_sample)):
        freq = frequencies(draw, probs_row, seed_for(request.node.name + name))
        assert freq[probs_row == 0].sum() == 0, f"{name} drew a token of probability 0"
        assert_within_five_sigma(freq, probs_row, name)


def test_a_zero_probability_token_never_wins_even_at_the_edges():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]]).expand(DRAWS, -1).contiguous()
    tokens = inverse_cdf_sample(probs, {}, torch.Generator().manual_seed(0))
    assert set(tokens.tolist()) == {1, 3}
    one_hot = torch.zeros(3, 6)
    one_hot[0, 0], one_hot[1, 5], one_hot[2, 2] = 1.0, 1.0, 1.0   # first, last, middle entry
    assert inverse_cdf_sample(one_hot, {}, torch.Generator().manual_seed(0)).tolist() == [0, 5, 2]


@pytest.mark.parametrize("vocab", [512, 1000, 49152])   # whole chunks of 256; a shorter last one
def test_the_two_level_search_finds_tokens_at_every_chunk_edge(vocab):
    winners = [0, 255, 256, 511, vocab - 1]
    one_hot = torch.zeros(len(winners), vocab)
    one_hot[torch.arange(len(winners)), winners] = 1.0
    assert inverse_cdf_sample(one_hot, {}, torch.Generator().manual_seed(0)).tolist() == winners
    # Two tokens on either side of a chunk edge, half the mass each: both win, nothing else does.
    pair = torch.zeros(DRAWS, vocab)
    pair[:, 255] = pair[:, 256] = 0.5
    drawn = inverse_cdf_sample(pair, {}, torch.Generator().manual_seed(1))
    assert set(drawn.tolist()) == {255, 256}
    assert abs((drawn == 255).double().mean().item() - 0.5) < 5 * (0.25 / DRAWS) ** 0.5


def test_a_seeded_row_draws_the_same_tokens_alone_and_anywhere_in_a_batch(request):
    g = torch.Generator().manual_seed(seed_for(request.node.name))
    probs = torch.randn(5, 300, generator=g).softmax(-1)
    shared = torch.Generator().manual_seed(1)
    alone = [inverse_cdf_sample(probs[3:4], {0: mine}, shared).item()
             for mine in [torch.Generator().manual_seed(7)] for _ in range(20)]
    mine = torch.Generator().manual_seed(7)
    in_batch = [inverse_cdf_sample(probs, {3: mine}, shared)[3].item() for _ in range(20)]
    assert alone == in_batch
    assert len(set(alone)) > 1   # 20 draws of a spread-out distribution: not one token


def test_the_shared_generator_advances_once_per_step_and_not_when_every_row_is_seeded():
    probs = torch.full((3, 10), 0.1)
    shared = torch.Generator().manual_seed(0)
    before = shared.get_state()
    inverse_cdf_sample(probs, {0: torch.Generator(), 1: torch.Generator(), 2: torch.Generator()}, shared)
    assert torch.equal(shared.get_state(), before)
    inverse_cdf_sample(probs, {1: torch.Generator()}, shared)
    assert not torch.equal(shared.get_state(), before)


def test_a_row_holding_nan_goes_to_the_ops_own_draw_and_draws_nothing_itself():
    probs = torch.full((2, 8), 0.125)
    probs[1, 3] = math.nan
    op = RandomSample(random_sample)
    expected = op.forward_native(probs, {}, torch.Generator().manual_seed(5))
    shared = torch.Generator().manual_seed(5)
    assert inverse_cdf_sample(probs, {}, shared) is None
    assert torch.equal(shared.get_state(), torch.Generator().manual_seed(5).get_state())
    assert torch.equal(random_sample_forward(op, probs, {}, torch.Generator().manual_seed(5)), expected)


def test_the_engine_draws_by_inverse_cdf_by_default_and_by_the_race_with_enforce_eager(tiny_models):
    from microvllm import LLM, SamplingParams

    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=6, ignore_eos=True) for s in (3, 4)]
    tokens = {}
    for eager in (False, True):
        llm = LLM(str(tiny_models["llama"]), enforce_eager=eager, num_kv_blocks=32, max_model_len=64)
        op = llm.engine.executor.worker.model_runner.sampler.random_sample
        assert op.implementation == ("native" if eager else "random_sample_forward")
        runs = [[o.outputs[0].token_ids for o in llm.generate(["a b c", "d e"], params, use_tqdm=False)]
                for _ in range(2)]
        assert runs[0] == runs[1], "a seed must fix the tokens"
        tokens[eager] = runs[0]
    assert tokens[False] != tokens[True]   # two draws from the same distributions, not one
