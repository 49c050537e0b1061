"""The rejection sampler: greedy rows are the argmax walk plus the bonus token, random rows
follow the target's distribution exactly (chi-square tests with a stated false-alarm rate),
padding and K = 0 rows, the residual, seeded requests reproducible, and in the engine:
greedy output with n-gram drafts equals the output without them."""

from __future__ import annotations

import pytest
import torch

from microvllm.sample import SamplingMetadata, make_generator
from microvllm.sample.rejection_sampler import (
    PLACEHOLDER_TOKEN_ID,
    RejectionSampler,
    SpecDecodeMetadata,
    rejection_sample,
    residual_probs,
)
from microvllm.sampling_params import SamplingParams

# chi2.isf(1e-4, df): a correct sampler exceeds it once in 10,000 seeds.
CHI2_1_IN_10_000 = {1: 15.137, 2: 18.421, 3: 21.108, 4: 23.513}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def argmax_sample(probs: torch.Tensor) -> torch.Tensor:
    return probs.argmax(dim=-1)


def one_hot(argmax: list[list[int]], vocab: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(argmax), vocab).float()


def walk(drafts: list[int], p: torch.Tensor, q: torch.Tensor | None, uniform: list[float]) -> list[int]:
    """One row draft by draft, as the papers write it (sample = argmax, to compare exactly)."""
    out = []
    for j, d in enumerate(drafts):
        q_j = torch.zeros_like(p[j]).index_fill_(0, torch.tensor(d), 1.0) if q is None else q[j]
        if uniform[j] < p[j, d] / q_j[d]:
            out.append(d)
            continue
        return out + [int((p[j] - q_j).clamp(min=0).argmax())]
    return out + [int(p[len(drafts)].argmax())]


# ---- greedy ----------------------------------------------------------------------

@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_greedy_is_the_argmax_walk_with_a_bonus(with_draft_probs):
    drafts = torch.tensor([[5, 2, 7], [5, 2, 7], [4, 4, 4]])
    target = one_hot([[5, 2, 7, 1], [5, 3, 8, 8], [6, 4, 4, 4]], 10)
    draft_probs = torch.full((3, 3, 10), 0.1) if with_draft_probs else None
    out = rejection_sample(drafts, torch.tensor([3, 3, 3]), target, draft_probs, torch.zeros(3, 3), argmax_sample)
    assert out.tolist() == [[5, 2, 7, 1],       # all accepted, then the bonus token
                            [5, 3, -1, -1],     # the first wrong draft is replaced by the argmax
                            [6, -1, -1, -1]]


def test_greedy_matches_decoding_without_drafts_on_random_targets():
    """For any drafts, the greedy output is a prefix of the argmax walk the target would take."""
    gen = make_generator(0)
    for _ in range(50):
        k, vocab = 4, 6
        argmax = torch.randint(0, vocab, (1, k + 1), generator=gen)
        drafts = torch.where(torch.rand(1, k, generator=gen) < 0.7, argmax[:, :k],
                             torch.randint(0, vocab, (1, k), generator=gen))
        out = rejection_sample(drafts, torch.tensor([k]), one_hot(argmax.tolist(), vocab), None,
                               torch.zeros(1, k), argmax_sample)[0].tolist()
        kept = [t for t in out if t != PLACEHOLDER_TOKEN_ID]
        num_right = next((j for j in range(k) if drafts[0, j] != argmax[0, j]), k)
        assert kept == argmax[0, :num_right + 1].tolist()


def test_k0_rows_and_mixed_num_draft_tokens_with_padding():
    drafts = torch.tensor([[3, 1, PLACEHOLDER_TOKEN_ID], [PLACEHOLDER_TOKEN_ID] * 3, [0, 0, 0], [2, 9, 9]])
    num = torch.tensor([2, 0, 3, 1])
    target = one_hot([[3, 1, 4, 4], [8, 0, 0, 0], [0, 0, 0, 5], [2, 7, 7, 7]], 10)
    out = rejection_sample(drafts, num, target, None, torch.zeros(4, 3), argmax_sample)
    assert out.tolist() == [[3, 1, 4, -1],     # 2 drafts kept, the bonus from position 2 (not padding's)
                            [8, -1, -1, -1],    # no drafts: one ordinary token
                            [0, 0, 0, 5],
                            [2, 7, -1, -1]]     # the padding (9, 9) is never a draft


def test_no_drafts_at_all_is_one_token_per_row():
    target = one_hot([[4], [1]], 6)
    out = rejection_sample(torch.zeros(2, 0, dtype=torch.long), torch.tensor([0, 0]), target, None,
                           torch.zeros(2, 0), argmax_sample)
    assert out.tolist() == [[4], [1]]


def test_matches_the_row_by_row_walk():
    """Random (non-greedy) targets, fixed uniforms, sample = argmax: exactly the walk."""
    gen = make_generator(1)
    for trial in range(40):
        batch, k, vocab = 4, 3, 7
        num = torch.randint(0, k + 1, (batch,), generator=gen)
        target = torch.rand(batch, k + 1, vocab, generator=gen).mul(4).softmax(-1)
        q = torch.rand(batch, k, vocab, generator=gen).mul(4).softmax(-1) if trial % 2 else None
        drafts = torch.randint(0, vocab, (batch, k), generator=gen)
        uniform = torch.rand(batch, k, generator=gen)
        out = rejection_sample(drafts, num, target, q, uniform, argmax_sample)
        for b in range(batch):
            n = int(num[b])
            expected = walk(drafts[b, :n].tolist(), target[b], None if q is None else q[b], uniform[b].tolist())
            assert out[b].tolist() == expected + [PLACEHOLDER_TOKEN_ID] * (k + 1 - len(expected))


# ---- the distribution ------------------------------------------------------------

P1 = torch.tensor([0.4, 0.3, 0.2, 0.1])
Q1 = torch.tensor([0.1, 0.2, 0.3, 0.4])
P2 = torch.tensor([0.1, 0.6, 0.2, 0.1])
Q2 = torch.tensor([0.5, 0.1, 0.1, 0.3])
P3 = torch.tensor([0.25, 0.25, 0.1, 0.4])


def assert_follows(tokens: torch.Tensor, probs: torch.Tensor) -> None:
    """Chi-square goodness of fit; a correct sampler fails it once in 10,000 seeds (each
    test below uses a fixed seed, so its verdict never changes)."""
    counts = torch.bincount(tokens, minlength=len(probs)).double()
    expected = probs.double() * len(tokens)
    statistic = float(((counts - expected) ** 2 / expected).sum())
    assert statistic < CHI2_1_IN_10_000[len(probs) - 1], (statistic, (counts / len(tokens)).tolist(), probs.tolist())


@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_output_follows_the_target_at_every_position(with_draft_probs):
    """Position 0 follows p1; given the first draft kept, the second token follows p2; given
    both kept, the bonus token follows p3 (Leviathan et al. 2023, theorem 1)."""
    n = 50_000
    gen = make_generator(7 if with_draft_probs else 8)
    target = torch.stack([P1, P2, P3]).expand(n, -1, -1).contiguous()
    if with_draft_probs:   # drafts drawn from the q they are checked with
        draft_probs = torch.stack([Q1, Q2]).expand(n, -1, -1).contiguous()
        drafts = torch.stack([torch.multinomial(Q1, n, True, generator=gen),
                              torch.multinomial(Q2, n, True, generator=gen)], 1)
    else:                  # token-only drafts: any guesses at all
        draft_probs = None
        drafts = torch.stack([torch.arange(n) % 4, torch.arange(n) // 4 % 4], 1)
    out = rejection_sample(drafts, torch.full((n,), 2), target, draft_probs, torch.rand(n, 2, generator=gen),
                           lambda probs: torch.multinomial(probs, 1, generator=gen).squeeze(-1))
    first_kept = out[:, 0] == drafts[:, 0]
    both_kept = first_kept & (out[:, 1] == drafts[:, 1])
    assert_follows(out[:, 0], P1)
    assert_follows(out[first_kept, 1], P2)
    assert_follows(out[both_kept, 2], P3)
    # And the acceptance rate is the theory's: sum_x min(p(x), q(x)) (0.6 with q, p(d) averaged without).
    rate = float(first_kept.double().mean())
    assert abs(rate - (0.6 if with_draft_probs else float(P1.mean()))) < 0.01


def test_a_wrong_rule_fails_the_distribution_test():
    """The test above can fail: accepting with min(1, q/p) skews the first token."""
    n = 50_000
    gen = make_generator(9)
    drafts = torch.multinomial(Q1, n, True, generator=gen)
    u = torch.rand(n, generator=gen)
    accepted = u * P1[drafts] < Q1[drafts]   # q/p
    residual = residual_probs(P1, Q1)
    tokens = torch.where(accepted, drafts, torch.multinomial(residual, n, True, generator=gen))
    with pytest.raises(AssertionError):
        assert_follows(tokens, P1)


# ---- the residual ----------------------------------------------------------------

def test_residual_sums_to_one_and_handles_p_equal_q():
    gen = make_generator(3)
    p = torch.rand(5, 3, 20, generator=gen).softmax(-1)
    q = torch.rand(5, 3, 20, generator=gen).mul(3).softmax(-1)
    q[2, 1] = p[2, 1]
    got = residual_probs(p, q)
    assert torch.allclose(got.sum(-1), torch.ones(5, 3))
    assert (got >= 0).all()
    assert torch.equal(got[2, 1], p[2, 1])          # nothing left: p itself, no NaN
    assert torch.allclose(residual_probs(P1, Q1), torch.tensor([0.75, 0.25, 0.0, 0.0]))


# ---- the module: target probs, uniforms, seeds -----------------------------------

def run_module(params: list[SamplingParams], drafts: list[list[int]], logits: torch.Tensor, seed: int = 0):
    rows = [p for p, d in zip(params, drafts) for _ in range(len(d) + 1)]
    generators = [make_generator(p.seed) if p.seed is not None else None for p in params]
    row_generators = [g for g, d in zip(generators, drafts) for _ in range(len(d) + 1)]
    metadata = SamplingMetadata.from_params(rows, row_generators)
    sampler = RejectionSampler(make_generator(seed))
    return sampler(SpecDecodeMetadata.from_lists(drafts), logits, metadata, generators)


def test_seeded_requests_are_reproducible():
    logits = torch.randn(2 + 4 + 1, 50, generator=make_generator(11))
    params = [SamplingParams(temperature=1.0, seed=5), SamplingParams(temperature=0.8, top_k=10, seed=6),
              SamplingParams(temperature=1.0)]
    drafts = [[3], [4, 9, 1], []]
    first = run_module(params, drafts, logits, seed=0)
    again = run_module(params, drafts, logits, seed=1)   # another shared seed: only row 2 may change
    assert torch.equal(first[:2], again[:2])
    assert torch.equal(first, run_module(params, drafts, logits, seed=0))
    reseeded = [SamplingParams(temperature=1.0, seed=50), SamplingParams(temperature=0.8, top_k=10, seed=60),
                SamplingParams(temperature=1.0)]
    assert not torch.equal(run_module(reseeded, drafts, logits)[:2], first[:2])   # other seeds: other draws


def test_module_greedy_rows_are_the_argmax_walk():
    logits = torch.randn(3 + 1, 30, generator=make_generator(12))
    argmax = logits.argmax(-1).tolist()
    drafts = [[argmax[0], argmax[1], (argmax[2] + 1) % 30]]   # two right, the third wrong
    out = run_module([SamplingParams(temperature=0.0)], drafts, logits)
    assert out.tolist() == [[argmax[0], argmax[1], argmax[2], -1]]


def test_module_refuses_the_wrong_number_of_logit_rows():
    with pytest.raises(ValueError, match="one row per draft plus one per request"):
        run_module([SamplingParams(temperature=0.0)], [[1, 2]], torch.randn(2, 10))


# ---- in the engine ---------------------------------------------------------------

PROMPTS = ["one two three four one two three four one two three four one two",
           {"prompt_token_ids": [5, 6, 7, 8, 9] * 5},
           "The scheduler decides which requests run in each step; the model runner"]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from microvllm.models.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("spec") / "llama", "llama", seed=7))


def generate(folder, params: SamplingParams, speculative_config=None, components=None):
    from microvllm import LLM

    llm = LLM(folder, dtype="float32", max_model_len=128, speculative_config=speculative_config,
              components=components, trace=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    drafted = sum(s.num_scheduled_tokens - 1 for step in llm.engine.trace for s in step.scheduled
                  if s.num_computed_tokens_before >= s.num_prompt_tokens)
    return [list(o.outputs[0].token_ids) for o in outputs], drafted, len(llm.engine.trace)


def test_engine_greedy_with_ngram_drafts_equals_without(tiny_llama):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain, _, plain_steps = generate(tiny_llama, params)
    spec, drafted, spec_steps = generate(tiny_llama, params, NGRAM)
    assert spec == plain
    # The drafts were really checked, and some accepted (the tiny model repeats itself): fewer steps.
    assert drafted > 0 and spec_steps < plain_steps


def test_engine_seeded_sampling_with_drafts_is_reproducible(tiny_llama):
    params = SamplingParams(temperature=1.0, top_k=20, seed=1234, max_tokens=24, ignore_eos=True)
    first, drafted, _ = generate(tiny_llama, params, NGRAM)
    assert drafted > 0
    assert generate(tiny_llama, params, NGRAM)[0] == first


def test_engine_runs_a_replaced_rejection_sampler(tiny_llama):
    calls = []

    class Counting(RejectionSampler):
        def forward(self, *args, **kwargs):
            calls.append(1)
            return super().forward(*args, **kwargs)

    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    tokens, _, _ = generate(tiny_llama, params, NGRAM, components={"rejection_sampler": Counting})
    assert calls and tokens == generate(tiny_llama, params)[0]
