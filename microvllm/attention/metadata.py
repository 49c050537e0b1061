"""What an attention layer needs to know about one engine step's batch.

The model runner flattens every scheduled request of a step into one long row of
tokens. Three requests, one prefill chunk of 4 tokens and two decodes:

    token index      0  1  2  3 | 4 | 5
    request          r0 r0 r0 r0| r1| r2
    query_start_loc  [0,          4,  5,  6]      (num_reqs + 1, int32)
    seq_lens         [4,          9,  3]          (cached context + this step's tokens)

Request i owns query rows ``query_start_loc[i] : query_start_loc[i+1]``; those rows
are the *last* tokens of its sequence, so row ``k`` of request ``i`` sits at position
``seq_lens[i] - query_len_i + k`` and may attend to keys at positions ``0 .. that
position`` (causal), or only the last ``sliding_window`` of them.

Keys and values live in a paged cache, one per layer::

    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]
               ^ 0 = keys, 1 = values

``block_table[i, j]`` is the physical block holding request ``i``'s logical block
``j`` (tokens ``j*block_size .. (j+1)*block_size-1``). ``slot_mapping[t]`` is where
token ``t``'s new key/value is written: ``block_id * block_size + offset``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    """Per-step, per-cache-group attention inputs (built by the model runner)."""

    num_actual_tokens: int
    """Number of query tokens in this step (rows of q/k/v that are real)."""
    max_query_len: int
    """Longest query chunk of any request in the batch (1 for a decode-only step)."""
    max_seq_len: int
    """Longest ``seq_len`` in the batch."""
    query_start_loc: torch.Tensor
    """``[num_reqs + 1]`` int32: request ``i`` owns rows ``[qsl[i], qsl[i+1])``."""
    seq_lens: torch.Tensor
    """``[num_reqs]`` int32: tokens of context each request attends over, this step's included."""
    block_table: torch.Tensor
    """``[num_reqs, max_blocks_per_req]`` int32: logical block -> physical block id."""
    slot_mapping: torch.Tensor
    """``[num_actual_tokens]`` int64: flat cache slot each new token's K/V goes to."""
    query_start_loc_cpu: list[int] | None = None
    """Host copy of ``query_start_loc`` for code that loops over requests in Python."""
    seq_lens_cpu: list[int] | None = None
    """Host copy of ``seq_lens``."""
    num_decodes: int | None = None
    """If set, requests ``0 .. num_decodes-1`` are decodes (one query token each) and
    come first; the runner orders the batch that way so backends can treat them as one
    block of rows. None: no promise about the order."""
    per_step: dict = field(default_factory=dict, repr=False)
    """Scratch space for values a backend derives from this metadata once per step and
    reuses in every layer (e.g. the decode mask). Rebuilt with the metadata each step."""

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.shape[0]
