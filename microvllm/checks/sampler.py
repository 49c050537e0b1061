"""Checks for exercise 07 (sampler): greedy, temperature, top-k, top-p, seeded draws.

The sampler is checked through its public call, ``Sampler(seed)(logits, metadata)``, on
distributions whose filters have unambiguous answers. Statistical checks draw thousands
of samples from fixed seeds, so they give the same verdict on every run.
"""

from __future__ import annotations

import torch

from microvllm.checks.report import (
    Case,
    CheckFailure,
    CheckResult,
    expect,
    expect_equal,
    property_settings,
    run_checks,
    run_property,
)
from microvllm.sample import SamplingMetadata, make_generator, topk_topp_sampler as reference
from microvllm.sampling_params import SamplingParams

# A distribution whose filters have unambiguous answers (no ties, no near-ties).
PROBS = torch.tensor([0.35, 0.25, 0.15, 0.10, 0.08, 0.04, 0.02, 0.01])
LOGITS = PROBS.log()

SUPPORT_CASES = [  # (params, tokens that may be drawn, why)
    (dict(top_k=3), {0, 1, 2}, "top_k=3 keeps the 3 most likely tokens"),
    (dict(top_k=1, temperature=1.0), {0}, "top_k=1 keeps only the most likely token"),
    (dict(top_k=100), set(range(8)), "top_k larger than the vocabulary keeps everything"),
    (dict(top_p=0.7), {0, 1, 2}, "top_p=0.7: mass above each token is 0, .35, .60, .75: keep while < 0.7, "
                                 "so the token that crosses 0.7 stays"),
    (dict(top_p=0.55), {0, 1}, "top_p=0.55 keeps tokens 0 and 1 (mass above token 2 is .60)"),
    (dict(top_p=0.01), {0}, "top_p=0.01 still keeps the top token"),
    (dict(top_k=5, top_p=0.9), {0, 1, 2, 3}, "top-k first, then top-p on the renormalized 5 tokens "
                                            "(mass above: 0 .38 .65 .81 .91)"),
]


def check_sampler(sampler_class, *, num_samples: int = 4000, max_examples: int = 30,
                  quiet: bool = False) -> CheckResult:
    """Check a ``Sampler`` class (with your apply_top_k, apply_top_p, random_sample)."""

    def sample(params_list, logits, seed=0, generators=None):
        metadata = SamplingMetadata.from_params(params_list, generators)
        out = sampler_class(seed=seed)(logits, metadata)
        tokens = out.sampled_token_ids
        expect(isinstance(tokens, torch.Tensor) and tokens.shape == (logits.shape[0],),
               "sampled_token_ids must be a tensor with one token per row",
               got=f"{type(tokens).__name__} {getattr(tokens, 'shape', '')}")
        return tokens

    def sample_many(params: SamplingParams, n=num_samples, logits=LOGITS, seed=0):
        return sample([params] * n, logits.expand(n, -1).contiguous(), seed)

    def greedy_is_argmax():
        logits = torch.randn(16, 1000, generator=make_generator(0))
        got = sample([SamplingParams(temperature=0.0)] * 16, logits)
        expect(torch.equal(got, logits.argmax(dim=-1)), "temperature 0 must take the argmax of every row",
               input="16 rows of random logits, all greedy", expected=logits.argmax(dim=-1).tolist(),
               got=got.tolist(), hint="greedy rows: logits.argmax(dim=-1), exactly (Hugging Face does the same)")

    def greedy_rows_in_a_mixed_batch():
        logits = torch.randn(6, 500, generator=make_generator(1))
        params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.5),
                  SamplingParams(temperature=0.9, top_k=1), SamplingParams(top_p=0.5),
                  SamplingParams(temperature=0.0, seed=3), SamplingParams(min_p=0.2)]
        got = sample(params, logits, generators=[None] * 6)
        argmax = logits.argmax(dim=-1)
        for row in (0, 2, 4):
            expect(got[row] == argmax[row], f"row {row} is greedy but did not get its argmax",
                   input="a batch mixing greedy and random rows", expected=int(argmax[row]), got=int(got[row]),
                   hint="torch.where(is_greedy, greedy_sampled, random_sampled): pick per row")

    def logits_untouched():
        logits = torch.randn(3, 50, generator=make_generator(2))
        before = logits.clone()
        params = [SamplingParams(top_k=5, top_p=0.5, min_p=0.1, temperature=0.5)] * 3
        sample(params, logits)
        expect(torch.equal(logits, before), "the caller's logits must not be modified",
               hint="use out-of-place ops (logits / t, masked_fill) instead of in-place ones (div_, masked_fill_)")

    def support_is_exact():
        for kwargs, expected, why in SUPPORT_CASES:
            got = set(sample_many(SamplingParams(**kwargs)).tolist())
            expect_equal(got, expected, f"the tokens drawn under SamplingParams({_kw(kwargs)})",
                         input=f"probabilities {PROBS.tolist()}, {num_samples} draws",
                         hint=why)

    def each_row_its_own_filter():
        params = [SamplingParams(top_k=2), SamplingParams(top_p=0.7), SamplingParams(min_p=0.2), SamplingParams()]
        per = 1000
        batch_params = [p for p in params for _ in range(per)]
        got = sample(batch_params, LOGITS.expand(len(batch_params), -1))
        seen = [set(chunk.tolist()) for chunk in got.split(per)]
        expected = [{0, 1}, {0, 1, 2}, {0, 1, 2, 3, 4}, set(range(8))]
        wrong = [name for name, a, b in zip(("top_k", "top_p", "min_p"), seen, expected) if a != b]
        if len(wrong) == 1:   # one filter's rule is wrong, not the per-row broadcasting
            hint = (f"only the {wrong[0]} rows are wrong: fix the {wrong[0]} rule itself (the "
                    "single-request check of that filter shows it on a smaller case)")
        else:
            hint = "top_k and top_p are tensors with one value per row; unsqueeze(-1) to compare per row"
        expect_equal(seen, expected, "each row must use its own request's filters",
                     input="one batch: 1000 rows top_k=2, 1000 top_p=0.7, 1000 min_p=0.2, 1000 unfiltered",
                     hint=hint)

    def temperature_reshapes():
        probs = torch.tensor([0.5, 0.3, 0.2])
        for temperature in (0.5, 2.0):
            expected = probs ** (1 / temperature) / (probs ** (1 / temperature)).sum()
            tokens = sample_many(SamplingParams(temperature=temperature), 20_000, logits=probs.log())
            observed = torch.bincount(tokens, minlength=3).float() / len(tokens)
            expect(torch.allclose(observed, expected, atol=0.015),
                   f"temperature {temperature} must give p^(1/T), renormalized",
                   input=f"probabilities {probs.tolist()}, 20,000 draws",
                   expected=[round(v, 3) for v in expected.tolist()],
                   got=[round(v, 3) for v in observed.tolist()],
                   hint="divide the logits by the temperature (each row by its own) before the softmax")

    def temperature_before_the_filters():
        # p = [0.5, 0.3, 0.2]; at T = 0.5 it is [0.66, 0.24, 0.11], so top_p = 0.6 keeps only
        # token 0. top_p on the unscaled p would keep 0 and 1 (the mass above 1 is 0.5 < 0.6).
        probs = torch.tensor([0.5, 0.3, 0.2])
        got = set(sample_many(SamplingParams(temperature=0.5, top_p=0.6), logits=probs.log()).tolist())
        expect_equal(got, {0}, "the tokens drawn under SamplingParams(temperature=0.5, top_p=0.6)",
                     input=f"probabilities {probs.tolist()}, {num_samples} draws",
                     hint="divide by the temperature first, then top-k, top-p, min-p: top_p measures mass "
                          "in the distribution the token is drawn from (at T=0.5: [0.66, 0.24, 0.11])")

    def filtered_is_renormalized():
        tokens = sample_many(SamplingParams(top_k=3), 20_000)
        observed = torch.bincount(tokens, minlength=8).float() / len(tokens)
        expected = torch.zeros(8)
        expected[:3] = PROBS[:3] / PROBS[:3].sum()
        expect(torch.allclose(observed, expected, atol=0.015),
               "the kept tokens keep their relative probabilities", input="top_k=3, 20,000 draws",
               expected=[round(v, 3) for v in expected.tolist()], got=[round(v, 3) for v in observed.tolist()],
               hint="drop tokens by setting their logits to -inf, then softmax and draw")

    def seeded_rows_are_independent():
        alone = _run_seeded(sample, 1234, 0, [])
        expect(len(set(alone)) > 1, "a seeded request at temperature 1 must really sample",
               got=alone)
        for position in (0, 2, 4):
            got = _run_seeded(sample, 1234, position, OTHERS)
            expect_equal(got, alone, "a seeded request's tokens must not depend on the rest of the batch",
                         input=f"seed 1234, 5 steps, alone vs at row {position} among 4 other requests",
                         hint="fill a seeded row's noise from its own generator (generators[row]); "
                              "every other row from the sampler's shared generator")
        expect(_run_seeded(sample, 4321, 0, []) != alone, "different seeds must give different tokens",
               input="seed 1234 vs seed 4321")

    def unseeded_follow_the_sampler_seed():
        logits = torch.randn(8, 1000, generator=make_generator(100))
        params = [SamplingParams()] * 8
        first = sample(params, logits, seed=7)
        expect(torch.equal(first, sample(params, logits, seed=7)), "the same sampler seed must give the same tokens",
               input="Sampler(seed=7) twice", hint="draw unseeded rows from self.generator")
        expect(not torch.equal(first, sample(params, logits, seed=8)),
               "another sampler seed must give other tokens", input="Sampler(seed=7) vs Sampler(seed=8)")

    def random_filters():
        from hypothesis import given, strategies as st

        @property_settings(max_examples)
        @given(st.lists(st.floats(-4, 4), min_size=2, max_size=12), st.integers(0, 12),
               st.floats(0.05, 1.0), st.floats(0.1, 2.0))
        def test(values, top_k, top_p, temperature):
            logits = torch.tensor(values)
            params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
            metadata = SamplingMetadata.from_params([params])
            allowed = logits / temperature
            if metadata.top_k is not None:
                allowed = reference.apply_top_k(allowed[None], metadata.top_k)[0]
            if metadata.top_p is not None:
                allowed = reference.apply_top_p(allowed[None], metadata.top_p)[0]
            allowed_ids = set(torch.isfinite(allowed).nonzero().flatten().tolist())
            got = set(sample_many(params, 200, logits=logits).tolist())
            if not got <= allowed_ids:
                raise CheckFailure("a token that the filters drop was drawn",
                                   input=f"logits {[round(v, 3) for v in values]}, SamplingParams("
                                         f"temperature={temperature:.3f}, top_k={top_k}, top_p={top_p:.3f})",
                                   expected=f"only tokens {sorted(allowed_ids)}", got=f"tokens {sorted(got)}",
                                   hint="ties with the k-th value are kept; the token that crosses top_p is kept")

        run_property(test)

    cases = [
        Case("greedy takes the argmax of every row", greedy_is_argmax),
        Case("greedy rows in a mixed batch take their argmax", greedy_rows_in_a_mixed_batch),
        Case("the caller's logits are left untouched", logits_untouched),
        Case("top-k and top-p keep exactly the right tokens", support_is_exact),
        Case("each row uses its own request's filters", each_row_its_own_filter),
        Case("temperature reshapes the distribution as p^(1/T)", temperature_reshapes),
        Case("temperature comes before the filters", temperature_before_the_filters),
        Case("filtered distributions are renormalized", filtered_is_renormalized),
        Case("a seeded request samples the same tokens wherever it sits in the batch", seeded_rows_are_independent),
        Case("unseeded rows follow the sampler's seed", unseeded_follow_the_sampler_seed),
        Case(f"property: {max_examples} random logits never draw a filtered-out token", random_filters),
    ]
    return run_checks("check_sampler", cases, quiet=quiet)


def _kw(kwargs: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in kwargs.items())


OTHERS = [SamplingParams(temperature=0.7), SamplingParams(temperature=0.0),
          SamplingParams(temperature=1.3, top_k=20, seed=9), SamplingParams(min_p=0.05)]


def _run_seeded(sample, seed: int, position: int, others: list[SamplingParams]) -> list[int]:
    """The tokens of one seeded request sitting at row ``position`` among ``others``, 5 steps."""
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=seed)
    generator = make_generator(seed)  # owned by the request, kept across steps
    other_generators = [make_generator(50 + i) if p.seed is not None else None for i, p in enumerate(others)]
    tokens = []
    for step in range(5):
        batch_params = others[:position] + [params] + others[position:]
        generators = other_generators[:position] + [generator] + other_generators[position:]
        logits = torch.randn(len(batch_params), 1000, generator=make_generator(100 + step))
        logits[position] = torch.randn(1, 1000, generator=make_generator(100 + step))[0]
        tokens.append(int(sample(batch_params, logits, seed=position, generators=generators)[position]))
    return tokens
