"""min_tokens: forbid ending a request too early.

A request with ``min_tokens=5`` must not stop before its 5th token, so while it has
fewer than 5 output tokens its eos and stop-token logits are set to -inf::

    row 1 (3 of min 5 tokens so far), banned ids {2}:
        logits[1]   [ 1.3   0.2   4.1   ... ]
        becomes     [ 1.3   0.2  -inf   ... ]   <- id 2 (<|im_end|>) cannot be sampled
"""

from __future__ import annotations

from collections.abc import Iterable

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
