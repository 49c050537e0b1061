"""The random path of the sampler: filter the distribution, then draw one token.

Each filter sets the logits of dropped tokens to -inf (probability 0) and works on
the whole batch at once, with one value per row::

    probs (sorted)    0.50  0.20  0.15  0.10  0.05
    top_k = 3         keep  keep  keep   -     -      the k most likely
    top_p = 0.8       keep  keep  keep   -     -      until the kept mass reaches p
    min_p = 0.25      keep  keep  keep   -     -      prob >= 0.25 * 0.50

The order follows Hugging Face ``generate`` (temperature, top-k, top-p, min-p).
vLLM V1 applies min-p before top-k/top-p; the result differs only when top-p
runs on a distribution that min-p has already thinned.
"""

from __future__ import annotations

import torch


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep the ``top_k[row]`` largest logits of each row (0 = keep all).

    Ties with the k-th value are kept too (the threshold is a value, not a count).
    """
    ### BEGIN SOLUTION
    vocab_size = logits.shape[-1]
    k = torch.where(top_k <= 0, vocab_size, top_k).clamp(max=vocab_size)
    # The k-th largest value of each row is its threshold; topk(max k) is enough.
    top_values = logits.topk(int(k.max()), dim=-1).values
    kth_value = top_values.gather(-1, (k - 1).unsqueeze(-1))
    return logits.masked_fill(logits < kth_value, float("-inf"))
    ### END SOLUTION


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability adds up to >= top_p.

    Sorted from most to least likely, a token stays if the tokens ranked above it
    hold less than top_p of the mass; so the top token always stays::

        sorted probs        0.50  0.20  0.15  0.10  0.05
        mass above it       0.00  0.50  0.70  0.85  0.95
        top_p = 0.8: keep   yes   yes   yes   no    no     (kept mass 0.85 >= 0.8)
    """
    ### BEGIN SOLUTION
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
    sorted_probs = sorted_logits.softmax(dim=-1)
    mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep_sorted = mass_above < top_p.unsqueeze(-1)
    # Rounding can push the tail's mass_above to 1.0: top_p = 1 must keep everything.
    keep_sorted |= (top_p >= 1.0).unsqueeze(-1)
    keep = torch.empty_like(keep_sorted).scatter_(-1, sorted_ids, keep_sorted)
    return logits.masked_fill(~keep, float("-inf"))
    ### END SOLUTION


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p[row]`` times the row's largest."""
    probs = logits.softmax(dim=-1)
    threshold = min_p.unsqueeze(-1) * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, float("-inf"))


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator],
                  shared_generator: torch.Generator) -> torch.Tensor:
    """Draw one token per row from ``probs`` with the exponential race.

    For each token draw E ~ Exponential(1) and take ``argmax(probs / E)``: token i
    wins with probability exactly probs[i] (E / probs[i] is an Exponential with rate
    probs[i], and the smallest of such racers is i with chance probs[i] / sum).

    Why not ``torch.multinomial``? Here the noise is a tensor we fill row by row,
    so a seeded request's row is filled from *its own* generator, the same
    ``vocab_size`` numbers per step wherever it sits in the batch: its tokens then
    depend only on its seed and its logits. Unseeded rows share one generator::

        noise row 0  <- shared generator   (one call for the whole batch)
        noise row 1  <- request B's generator
        noise row 2  <- shared generator
    """
    ### BEGIN SOLUTION
    noise = torch.empty_like(probs)
    if len(generators) != probs.shape[0]:
        noise.exponential_(generator=shared_generator)
    for row, generator in generators.items():
        noise[row].exponential_(generator=generator)
    # A draw of exactly 0 would make 0/0 = NaN for a dropped token, and argmax
    # would pick the NaN: keep the noise strictly positive.
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    return (probs / noise).argmax(dim=-1)
    ### END SOLUTION
