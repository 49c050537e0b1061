"""Penalties: change the logits of tokens the request has already seen.

min_tokens: forbid ending a request too early.

A request with ``min_tokens=5`` must not stop before its 5th token, so while it has
fewer than 5 output tokens its eos and stop-token logits are set to -inf::

    row 1 (3 of min 5 tokens so far), banned ids {2}:
        logits[1]   [ 1.3   0.2   4.1   ... ]
        becomes     [ 1.3   0.2  -inf   ... ]   <- id 2 (<|im_end|>) cannot be sampled

Repetition, frequency and presence penalties (vLLM's definitions, OpenAI's for the
last two). Each row counts how often every vocabulary id occurs in its prompt and
in its output so far; a step with vocab = 6, one request::

    prompt ids  [4, 1]              output ids  [2, 2, 5]
    prompt_mask [F  T  F  F  T  F]  output_counts [0  0  2  0  0  1]
                 0  1  2  3  4  5   output_mask   [F  F  T  F  F  T]

    repetition_penalty r (prompt or output, ids 1 2 4 5):
        logit > 0: logit / r        logit <= 0: logit * r    (r > 1: less likely either way)
    frequency_penalty f (output only):  logit -= f * output_counts   (2f off id 2, f off id 5)
    presence_penalty p (output only):   logit -= p * output_mask     (p off ids 2 and 5, once)

The counts are one ``scatter_add`` per batch: ids are padded to a rectangle with
the id ``vocab_size`` (one extra column, dropped afterwards), so rows of different
lengths need no Python loop over tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch


def apply_min_tokens_penalty(logits: torch.Tensor,
                             banned: Iterable[tuple[int, Iterable[int]]]) -> None:
    """Set ``logits[row, token_id] = -inf`` in place for every (row, token_ids) pair."""
    rows: list[int] = []
    token_ids: list[int] = []
    for row, ids in banned:
        for token_id in ids:
            rows.append(row)
            token_ids.append(token_id)
    if rows:
        # One indexed write for the whole batch instead of one per pair.
        logits[rows, token_ids] = float("-inf")


def token_counts(token_ids: Sequence[Sequence[int]], vocab_size: int,
                 device: str | torch.device = "cpu") -> torch.Tensor:
    """``counts[row, id]`` = occurrences of ``id`` in ``token_ids[row]``: [num_reqs, vocab_size]."""
    num_reqs = len(token_ids)
    longest = max((len(ids) for ids in token_ids), default=0)
    # Pad with vocab_size: those land in an extra column that is cut off below.
    padded = torch.full((num_reqs, max(longest, 1)), vocab_size, dtype=torch.int64, device=device)
    for row, ids in enumerate(token_ids):
        if ids:
            padded[row, :len(ids)] = torch.as_tensor(list(ids), dtype=torch.int64, device=device)
    counts = torch.zeros(num_reqs, vocab_size + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, prompt_token_ids: Sequence[Sequence[int]],
                    output_token_ids: Sequence[Sequence[int]], presence_penalties: torch.Tensor,
                    frequency_penalties: torch.Tensor, repetition_penalties: torch.Tensor) -> torch.Tensor:
    """Return the penalized logits (a new tensor) for a batch; see the module docstring.

    logits [num_reqs, vocab]; the three penalty columns [num_reqs] (0, 0 and 1 are off).
    """
    vocab_size = logits.shape[-1]
    output_counts = token_counts(output_token_ids, vocab_size, logits.device)
    output_mask = output_counts > 0
    seen = (token_counts(prompt_token_ids, vocab_size, logits.device) > 0) | output_mask
    # Divide positive logits, multiply the others: both move the token toward less likely.
    penalty = torch.where(seen, repetition_penalties.unsqueeze(-1), 1.0)
    logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    logits = logits - frequency_penalties.unsqueeze(-1) * output_counts
    return logits - presence_penalties.unsqueeze(-1) * output_mask
