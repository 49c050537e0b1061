"""Step (b): sort the (token, expert) pairs by expert once, then run each expert on a
contiguous run of rows (the permutation of ``moe_align_block_size.py``)::

    hidden [T, H] ──gather rows in sorted order──> x [P, H]     P = T*k pairs, expert by expert
                                                   │ expert 0's rows │ expert 1's rows │ ...
                   one matmul pair per expert  ──> y [P, H]
    out [T, H] <──scatter-add y * weight back to each pair's token

Same arithmetic as step (a), in the same order (each token's experts are added in expert
order): in float32 the result is the same to the last bit (``tests/layers/``; in bfloat16
with k > 2 it may differ in the last bit: step (a) rounds the running sum after each
expert, ``index_add_`` here adds a token's k rows before it rounds). What changes is the bookkeeping — one
sort instead of ``E`` scans of ``topk_ids`` — and the layout: every expert's rows are
contiguous, which is what a single fused kernel needs (step (c), ``fused_moe.py``, pads
each run to its block size and runs all experts in one launch).

``block_size`` is for show: with more than 1 the runs are padded (index ``T*k``) and the
padding rows are skipped here; a kernel would compute them and throw them away.
"""

from __future__ import annotations

import torch

from microvllm.layers.fused_moe.moe_align_block_size import moe_align_block_size
from microvllm.layers.fused_moe.moe_torch_iterative import expert_mlp


def fused_moe_sorted(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                     topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                     block_size: int = 1) -> torch.Tensor:
    """Same arguments and result as ``fused_moe_iterative``."""
    num_pairs, top_k = topk_ids.numel(), topk_ids.shape[-1]
    routing = moe_align_block_size(topk_ids, block_size, w13.shape[0])
    pairs = routing.sorted_token_ids                     # [P] pair indices, padding = num_pairs
    real = pairs < num_pairs
    tokens = pairs[real] // top_k                        # pair i is token i // k
    x = hidden.new_zeros(pairs.numel(), hidden.shape[-1])
    x[real] = hidden[tokens]                             # gather: every expert's rows contiguous
    y = torch.empty_like(x)
    offsets = routing.expert_offsets.tolist()
    for expert in range(w13.shape[0]):
        rows = slice(offsets[expert], offsets[expert + 1])
        if rows.start < rows.stop:                       # an expert with no pair has no rows
            y[rows] = expert_mlp(x[rows], w13[expert], w2[expert])
    weights = topk_weights.flatten()[pairs[real], None].to(y.dtype)
    return torch.zeros_like(hidden).index_add_(0, tokens, y[real] * weights)   # scatter back
