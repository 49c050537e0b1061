"""The rejection sampler: which of a request's k draft tokens the target keeps, and the
one token it adds (vLLM: ``vllm/v1/sample/rejection_sampler.py``).

Speculative decoding runs the target once over a request's last token and its k
drafts, so it has the target's distribution at every draft position::

    input to the target   t      d1     d2     d3          (k = 3 drafts)
    target's distribution p1     p2     p3     p4          p_j predicts the token after
                          |      |      |      |
    compared with         d1     d2     d3     (none: p4 is the "bonus" position)

Walking left to right, draft d_j is accepted with probability ``min(1, p_j(d_j) /
q_j(d_j))``, where q_j is the distribution the drafter drew d_j from. The first
rejected one is replaced by a token drawn from the residual ``max(0, p_j - q_j)``
(normalized), and the walk stops. If all k are accepted, a bonus token is drawn from
p_{k+1}. Each step therefore yields between 1 and k + 1 tokens, and (Leviathan et al.
2023, Chen et al. 2023) each is distributed exactly as if the target had sampled it
alone: speculative decoding changes the speed, never the output's distribution.

Two special cases fall out of the same rule:

* a drafter that gives tokens but no probabilities (n-gram lookup) means q_j is one-hot
  at d_j: accept with probability p_j(d_j); the residual is p_j with d_j removed;
* a greedy request's target distribution is one-hot at its argmax: a draft is accepted
  exactly when it is the argmax, and the replacement is the argmax. Greedy output with
  drafts is token-for-token the output without them.

Batched layout (``rejection_sample``): B requests, each with up to K drafts, padded::

    draft_token_ids    [B, K]         request b's drafts are its first num_draft_tokens[b]
    target_probs       [B, K + 1, V]  row j: the target's distribution after j drafts
    draft_probs        [B, K, V]      or None (token-only drafter)
    uniform            [B, K]         one U(0, 1) draw per draft (0 on greedy rows)
    output             [B, K + 1]     accepted drafts, then one recovered or bonus token,
                                      then PLACEHOLDER_TOKEN_ID (-1)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from microvllm.sample.metadata import SamplingMetadata
from microvllm.sample.topk_topp_sampler import apply_min_p, apply_top_k, apply_top_p, random_sample
from microvllm.sampling_params import SAMPLING_EPS

PLACEHOLDER_TOKEN_ID = -1   # vLLM's name: the padding of a row with fewer than K + 1 tokens


def residual_probs(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """``max(0, p - q)``, normalized to sum to 1 over the last dimension: what a rejected
    position's token is drawn from. Where p == q exactly (nothing left), it is p: such a
    draft is never rejected, so the value is never used, but it stays a distribution."""
    ### BEGIN SOLUTION
    residual = (target_probs - draft_probs).clamp_(min=0)
    total = residual.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, residual / total.clamp(min=torch.finfo(residual.dtype).tiny), target_probs)
    ### END SOLUTION


def rejection_sample(draft_token_ids: torch.Tensor, num_draft_tokens: torch.Tensor,
                     target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                     uniform: torch.Tensor,
                     sample: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The tokens each request keeps this step (see the module docstring for the layout).

    draft_token_ids   [B, K] int64; padding past num_draft_tokens[b] may hold anything
    num_draft_tokens  [B] int64, 0..K
    target_probs      [B, K + 1, V] float; each row sums to 1
    draft_probs       [B, K, V] float, or None: the drafter gave tokens only (q one-hot)
    uniform           [B, K] float in [0, 1): draft j of row b is accepted when
                      ``uniform * q(d) < p(d)``, i.e. with probability min(1, p(d) / q(d))
    sample            draws one token per row from a [B, V] distribution -> [B] int64
    returns           [B, K + 1] int64: the accepted drafts, then the recovered token (at
                      the first rejection) or the bonus token (all accepted), then -1

    No Python loop over rows: every step is one tensor operation over the batch.
    """
    ### BEGIN SOLUTION
    batch_size, max_drafts = draft_token_ids.shape
    rows = torch.arange(batch_size, device=target_probs.device)
    positions = torch.arange(max_drafts, device=target_probs.device)
    is_draft = positions < num_draft_tokens.unsqueeze(1)            # [B, K]: real drafts, not padding
    drafts = torch.where(is_draft, draft_token_ids, 0)              # padding -> a valid index
    p_of_draft = target_probs[:, :max_drafts].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    q_of_draft = (torch.ones_like(p_of_draft) if draft_probs is None
                  else draft_probs.gather(-1, drafts.unsqueeze(-1)).squeeze(-1))
    accepted = (uniform * q_of_draft < p_of_draft) & is_draft
    # Accepted drafts count only up to the first rejection: a running product of 0/1.
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)        # [B], 0..num_draft_tokens

    # The distribution of the one token after the accepted drafts: the bonus position's
    # p when every draft was accepted, else the residual at the first rejected one.
    p_next = target_probs[rows, num_accepted]                       # [B, V]
    if max_drafts == 0:
        next_probs = p_next
    else:
        at = num_accepted.clamp(max=max_drafts - 1)
        q_next = (torch.nn.functional.one_hot(drafts[rows, at], p_next.shape[-1]).to(p_next.dtype)
                  if draft_probs is None else draft_probs[rows, at])
        all_accepted = (num_accepted == num_draft_tokens).unsqueeze(1)
        next_probs = torch.where(all_accepted, p_next, residual_probs(p_next, q_next))
    next_token = sample(next_probs)

    output = torch.full((batch_size, max_drafts + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.long,
                        device=target_probs.device)
    output[:, :max_drafts] = torch.where(positions < num_accepted.unsqueeze(1), draft_token_ids,
                                         PLACEHOLDER_TOKEN_ID)
    output[rows, num_accepted] = next_token
    return output
    ### END SOLUTION


@dataclass(frozen=True)
class SpecDecodeMetadata:
    """This step's drafts, one row per request that samples (vLLM: the same name)::

        draft_token_ids   [B, K] int64, padded with PLACEHOLDER_TOKEN_ID
        num_draft_tokens  [B] int64, how many of each row are real (0 = no drafts)

    The target's logits come with it as ``num_draft_tokens[b] + 1`` consecutive rows per
    request (the position before each draft, then the bonus position)."""

    draft_token_ids: torch.Tensor
    num_draft_tokens: list[int]

    @classmethod
    def from_lists(cls, drafts: list[list[int]], device: torch.device | str = "cpu") -> "SpecDecodeMetadata":
        width = max((len(d) for d in drafts), default=0)
        padded = [d + [PLACEHOLDER_TOKEN_ID] * (width - len(d)) for d in drafts]
        return cls(torch.tensor(padded, dtype=torch.long, device=device).reshape(len(drafts), width),
                   [len(d) for d in drafts])


class RejectionSampler(nn.Module):
    """Turns the target's logits at every draft position into each request's new tokens.

    ``forward`` takes the logits already through the sampler's logits processors (one row
    per position, ``SpecDecodeMetadata``'s order) and the *per-position* sampling
    metadata (row r's temperature, top-k, ...); it builds the target distributions
    (temperature, top-k, top-p, min-p; one-hot argmax on greedy rows), draws the uniforms
    (a seeded request from its own generator), and calls ``rejection_sample``.
    """

    def __init__(self, shared_generator: torch.Generator):
        super().__init__()
        self.generator = shared_generator   # the sampler's: requests without a seed draw from it

    def forward(self, metadata: SpecDecodeMetadata, logits: torch.Tensor, sampling_metadata: SamplingMetadata,
                generators: list[torch.Generator | None], draft_probs: torch.Tensor | None = None) -> torch.Tensor:
        """-> [B, K + 1] int64 output tokens (PLACEHOLDER_TOKEN_ID-padded). ``generators``:
        one per request (None: the shared one); ``draft_probs`` [B, K, V] from a drafter
        that samples, None for drafts given as tokens only."""
        num_drafts = metadata.num_draft_tokens
        batch_size, max_drafts = metadata.draft_token_ids.shape
        if logits.shape[0] != sum(num_drafts) + batch_size:
            raise ValueError(f"got {logits.shape[0]} rows of logits for {batch_size} requests with "
                             f"{sum(num_drafts)} drafts: one row per draft plus one per request")
        probs_rows = self.target_probs(logits, sampling_metadata)          # [R, V]
        # Scatter the R rows into the padded [B, K + 1, V] layout.
        counts = torch.tensor([n + 1 for n in num_drafts], device=logits.device)
        request_of_row = torch.repeat_interleave(torch.arange(batch_size, device=logits.device), counts)
        starts = torch.cumsum(counts, 0) - counts
        position_of_row = torch.arange(len(request_of_row), device=logits.device) - starts[request_of_row]
        target_probs = probs_rows.new_zeros(batch_size, max_drafts + 1, probs_rows.shape[-1])
        target_probs[request_of_row, position_of_row] = probs_rows
        # A padded position's row must still be a distribution (nothing reads it).
        target_probs[:, :, 0] += (target_probs.sum(-1) == 0).to(target_probs.dtype)

        is_greedy = sampling_metadata.temperature[starts] < SAMPLING_EPS   # [B]
        greedy_rows = set(torch.nonzero(is_greedy).flatten().tolist())
        # A seeded request draws from its own generator (its tokens then depend on its
        # seed only); the others share one draw. The only loop: over seeded rows.
        seeded = {b: g for b, g in enumerate(generators) if g is not None and b not in greedy_rows}
        uniform = torch.zeros(batch_size, max_drafts, device=logits.device)
        if max_drafts and len(greedy_rows) < batch_size:
            uniform = torch.rand(batch_size, max_drafts, generator=self.generator, device=logits.device)
            for b, generator in seeded.items():
                uniform[b] = torch.rand(max_drafts, generator=generator, device=logits.device)
            # Greedy rows get 0: accepted exactly when p(d) = 1, i.e. d is the argmax.
            uniform = uniform.masked_fill(is_greedy.unsqueeze(1), 0.0)

        def draw(probs: torch.Tensor) -> torch.Tensor:
            # Greedy rows' distributions are one-hot: their argmax is the token.
            if len(greedy_rows) == batch_size:
                return probs.argmax(dim=-1)
            return torch.where(is_greedy, probs.argmax(dim=-1), random_sample(probs, seeded, self.generator))

        return rejection_sample(metadata.draft_token_ids, torch.tensor(num_drafts, device=logits.device),
                                target_probs, draft_probs, uniform, draw)

    @staticmethod
    def target_probs(logits: torch.Tensor, sampling_metadata: SamplingMetadata) -> torch.Tensor:
        """Each row's distribution as the sampler would draw from it (temperature, top-k,
        top-p, min-p, softmax), and one-hot at the argmax on greedy rows."""
        m = sampling_metadata
        is_greedy = m.temperature < SAMPLING_EPS
        greedy = torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).to(logits.dtype)
        if m.all_greedy:
            return greedy
        logits = logits / torch.where(is_greedy, 1.0, m.temperature).unsqueeze(-1)
        if m.top_k is not None:
            logits = apply_top_k(logits, m.top_k)
        if m.top_p is not None:
            logits = apply_top_p(logits, m.top_p)
        if m.min_p is not None:
            logits = apply_min_p(logits, m.min_p)
        return torch.where(is_greedy.unsqueeze(-1), greedy, logits.softmax(dim=-1))
