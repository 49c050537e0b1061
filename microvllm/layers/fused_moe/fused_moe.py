"""Step (c): the experts as one Triton kernel, launched twice (vLLM:
``layers/fused_moe/fused_moe.py``, ``fused_experts``).

Step (b) (``moe_sorted.py``) sorted the pairs by expert, gathered their rows into a new
tensor, and still ran one matmul per expert. Here nothing is gathered and nothing loops
over experts in Python: the kernel reads each pair's row of A where it already lies, and
one launch covers every expert (the kernel is in ``fused_moe_triton.py``; its docstring
draws what one program does)::

    topk_ids [T, k] ──moe_align_block_size(BLOCK_SIZE_M)──> sorted_token_ids, expert_ids
                                                              (indices only: no data moves)

    hidden [T, H] ──kernel(w13 [E, 2I, H], A row = pair // k)──> gate_up [P, 2I]  P = T*k
    gate_up [P, 2I] ──silu(gate) * up, torch──────────────────> act     [P, I]
    act [P, I] ──kernel(w2 [E, H, I], A row = pair, × topk_weight)──> y [P, H]
    y.view(T, k, H).sum(1) ──────────────────────────────────────> out  [T, H]

Rows of ``gate_up``, ``act`` and ``y`` are in pair order (row ``i`` is token ``i // k``'s
``i % k``-th expert), so the last step is a plain sum over ``k``: no scatter-add. A pair
whose expert id is -1 (held by another rank) gets no block, so its rows are never
written: ``y`` starts as zeros, and they add nothing.

The result equals ``fused_moe_iterative`` up to rounding: float32 sums are accumulated
in a different order, and the routing weight multiplies the float32 accumulator before
the one rounding to the model's dtype (step (a) rounds, then multiplies).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from microvllm.layers.fused_moe.moe_align_block_size import moe_align_block_size


def fused_experts(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  block_size_m: int = 16) -> torch.Tensor:
    """Same arguments and result as ``fused_moe_iterative``, plus ``block_size_m``: rows
    per kernel block, a power of two of at least 16 (``tl.dot``'s smallest tile)."""
    if block_size_m < 16 or block_size_m & (block_size_m - 1):
        raise ValueError(f"block_size_m={block_size_m} must be a power of two of at least 16")
    # Imported here, not at the top: importing it imports triton (and on a CPU must
    # switch Triton's interpreter on first), which the rest of the package never needs.
    from microvllm.layers.fused_moe.fused_moe_triton import invoke_fused_moe_kernel

    num_tokens, top_k = topk_ids.shape
    num_experts, two_i, hidden_size = w13.shape
    num_pairs = num_tokens * top_k
    # The bookkeeping in plain torch, on the ids' device (vLLM has a CUDA kernel for it).
    routing = moe_align_block_size(topk_ids, block_size_m, num_experts)
    weights = topk_weights.to(device=hidden.device, dtype=torch.float32).contiguous().view(-1)

    # A pair routed to no local expert (-1) is in no block, so neither launch touches its
    # row: here that row stays uninitialised, and nothing reads it ...
    gate_up = hidden.new_empty(num_pairs, two_i)
    invoke_fused_moe_kernel(hidden, w13, gate_up, weights, routing, top_k=top_k,
                            mul_routed_weight=False, block_size_m=block_size_m)
    gate, up = gate_up.chunk(2, dim=-1)       # as expert_mlp (step a) and SiluAndMul do
    act = F.silu(gate) * up                   # [P, I]
    y = hidden.new_zeros(num_pairs, hidden_size)     # ... but here it is summed: zeros
    invoke_fused_moe_kernel(act, w2, y, weights, routing, top_k=1,
                            mul_routed_weight=True, block_size_m=block_size_m)
    return y.view(num_tokens, top_k, hidden_size).sum(dim=1)
