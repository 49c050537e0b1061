"""The token bitmask: which vocabulary ids each structured row may sample this step.

One int32 word holds 32 ids, bit j of word w standing for id 32*w + j (xgrammar's layout,
so both backends fill the same tensor)::

    vocab_size = 70        words per row = ceil(70 / 32) = 3
    row r:   word 0: ids 0..31   word 1: ids 32..63   word 2: ids 64..69 (+26 unused bits)
    allowed id 33  <=>  (bitmask[r, 1] >> 1) & 1 == 1

A row that is not structured keeps every bit set (-1: all 32 bits).
"""

from __future__ import annotations

import torch

BITS = 32


def num_words(vocab_size: int) -> int:
    return -(-vocab_size // BITS)


def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """``[num_rows, words]`` int32, every id allowed."""
    return torch.full((num_rows, num_words(vocab_size)), -1, dtype=torch.int32)


def pack(allowed: torch.Tensor) -> torch.Tensor:
    """A bool ``[vocab]`` (or ``[rows, vocab]``) mask -> its int32 words."""
    rows = allowed.reshape(-1, allowed.shape[-1])
    vocab = rows.shape[-1]
    padded = torch.zeros(rows.shape[0], num_words(vocab) * BITS, dtype=torch.int64)
    padded[:, :vocab] = rows.to(torch.int64)
    words = (padded.view(rows.shape[0], -1, BITS) << torch.arange(BITS)).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)   # two's complement
    return words.reshape(*allowed.shape[:-1], -1)


def unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 words ``[rows, words]`` -> bool ``[rows, vocab_size]``."""
    bits = (bitmask.to(torch.int64).unsqueeze(-1) >> torch.arange(BITS, device=bitmask.device)) & 1
    return bits.reshape(*bitmask.shape[:-1], -1)[..., :vocab_size].bool()


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """``logits[rows[i], id] = -inf`` in place wherever ``bitmask[i]`` forbids ``id``.
    The logits may be wider than the tokenizer's vocabulary (padded): those ids are
    forbidden too, since no grammar can accept them."""
    if not rows:
        return
    vocab = logits.shape[-1]
    allowed = unpack(bitmask.to(logits.device), vocab)
    if allowed.shape[-1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[-1]), value=False)
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def allows_nothing(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool ``[rows]``: True where a row allows no id below ``vocab_size`` (the bits past
    it, in the last word, do not count). Sampling such a row can only break its grammar."""
    return ~unpack(bitmask, vocab_size).any(dim=-1)
