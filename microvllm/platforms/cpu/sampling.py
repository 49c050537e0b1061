"""The CPU's random draw: inverse CDF, one random number per row.

The sampler's own draw (``sample/topk_topp_sampler.py``, ``random_sample``) is the
exponential race: ``argmax(probs / E)`` with one ``E ~ Exponential(1)`` per vocabulary
entry. On a GPU that noise is nearly free. On a CPU it is not: torch fills it with one
``log`` per entry on one thread, about 20 ns each, so a batch of 48 rows of SmolLM2's
49,152-token vocabulary spends ~47 ms per step on noise alone (EPYC, 2 cores), as much as
the forward of that decode step. Every sampled (temperature > 0) request pays it:
``vllm bench serve`` sends no temperature, so all of its requests sample at 1.0.

Inverse CDF draws from the same distribution with one uniform number per row::

    probs   0.10  0.00  0.60  0.30
    cdf     0.10  0.10  0.70  1.00        cumulative sum (float64: the tail's tiny
    u = 0.42 -> u * total = 0.42          probabilities are not lost to rounding)
    first cdf > 0.42  ->  token 2         searchsorted, right side

(done in two levels, chunks of 256 tokens then one chunk, so that no cumulative sum of
the whole batch is ever allocated: see ``inverse_cdf_sample``.)

A token of probability 0 never wins (its cdf equals its left neighbour's, which is not
above the target). Cost: one pass over the probabilities and two binary searches per row,
0.25 ms for the same 48 rows. vLLM's CPU build replaces the noise too
(``fused_gumbel_argmax``, a C++ kernel with counter-based noise); this needs no kernel.

Seeds still fix tokens: a seeded row takes its one number from its own generator, so its
tokens depend only on its seed and its logits, wherever it sits in the batch. They are
not the tokens ``enforce_eager=True`` draws from the same seed (another draw from the
same distribution). Bound by ``CpuPlatform.op_version`` to ``RandomSample``; compared
with the exponential race by its distribution in ``tests/platforms/test_cpu_sampling.py``.
"""

from __future__ import annotations

import torch

CHUNK = 256   # vocabulary entries per chunk of the two-level search


def inverse_cdf_sample(probs: torch.Tensor, generators: dict[int, torch.Generator],
                       shared_generator: torch.Generator) -> torch.Tensor | None:
    """``probs [rows, vocab]`` (each row sums to ~1) -> ``[rows]`` int64: one token per row,
    token i with probability probs[row, i] / sum(probs[row]). None, drawing nothing, if a
    row holds a NaN (it is no distribution: the caller's own draw decides).

    In two levels, so that no cumulative sum of the whole batch is ever made (its float64
    copy alone would be 19 MB for 48 rows of 49,152)::

        chunk sums   [rows, vocab / 256]    one pass over probs; their cumulative sum in float64
        the chunk    the first whose cumulative sum passes u * total
        the token    the same search inside that chunk's 256 probabilities, float64
    """
    rows, vocab = probs.shape
    probs = probs.contiguous()
    full = vocab // CHUNK * CHUNK
    sums = probs[:, :full].reshape(rows, -1, CHUNK).sum(dim=-1)
    if full < vocab:   # the last, shorter chunk
        sums = torch.cat([sums, probs[:, full:].sum(dim=-1, keepdim=True)], dim=-1)
    chunk_cdf = sums.to(torch.float64).cumsum(dim=-1)
    if bool(torch.isnan(chunk_cdf[:, -1]).any()):   # a NaN anywhere in a row reaches its total
        return None
    uniform = torch.empty(rows, 1, dtype=torch.float64)
    if len(generators) != rows:   # the shared generator advances once per step, as the race's does
        uniform.uniform_(generator=shared_generator)
    for row, generator in generators.items():
        uniform[row].uniform_(generator=generator)
    # uniform is in [0, 1), so the target is below the row's total: some chunk passes it.
    target = uniform * chunk_cdf[:, -1:]
    chunk = torch.searchsorted(chunk_cdf, target, right=True).clamp_(max=sums.shape[1] - 1)
    # Where the target falls inside its chunk, as a share of the chunk's mass, in [0, 1).
    before = torch.where(chunk > 0, chunk_cdf.gather(1, (chunk - 1).clamp(min=0)), 0.0)
    share = ((target - before) / sums.gather(1, chunk).to(torch.float64)).clamp_(0.0, 1.0 - 1e-12)
    positions = chunk * CHUNK + torch.arange(CHUNK)              # [rows, CHUNK]
    inside = probs.gather(1, positions.clamp(max=vocab - 1)).to(torch.float64)
    inside = inside.masked_fill_(positions >= vocab, 0.0).cumsum(dim=-1)
    offset = torch.searchsorted(inside, share * inside[:, -1:], right=True)
    return (chunk * CHUNK + offset).squeeze(-1)


def random_sample_forward(op, probs: torch.Tensor, generators: dict[int, torch.Generator],
                          shared_generator: torch.Generator) -> torch.Tensor:
    """``RandomSample``: inverse CDF for float rows on the CPU that are distributions;
    anything else goes to the op's own draw."""
    if probs.device.type == "cpu" and probs.dim() == 2 and probs.shape[1] > 0 and probs.is_floating_point():
        tokens = inverse_cdf_sample(probs, generators, shared_generator)
        if tokens is not None:
            return tokens
    return op.forward_native(probs, generators, shared_generator)
