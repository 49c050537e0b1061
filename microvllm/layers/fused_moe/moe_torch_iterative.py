"""Step (a) of a mixture-of-experts layer: the plain loop over experts (vLLM:
``layers/fused_moe/moe_torch_iterative.py``; Hugging Face's ``Qwen3MoeExperts.forward``
computes the same thing in the same order).

Each expert is a small SwiGLU MLP with its own weights, stacked along a first axis::

    w13 [E, 2I, H]   expert e's gate and up projections, fused: rows 0..I gate, I..2I up
    w2  [E, H, I]    expert e's down projection

    out[t] = sum over the k experts e chosen for token t of
             topk_weight[t, e] * w2[e] @ (silu(w13[e, :I] @ x[t]) * (w13[e, I:] @ x[t]))

The loop: for each expert, find the tokens routed to it, run its MLP on those rows, and
add the weighted result back into their rows. Simple, and slow in the way that matters:
each expert scans all of ``topk_ids`` to find its tokens (``E`` passes), and the experts
run one after another. Step (b) (``moe_sorted.py``) sorts the pairs once instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def expert_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One expert on its rows: ``x [n, H]``, ``w13 [2I, H]``, ``w2 [H, I]`` -> ``[n, H]``."""
    gate, up = F.linear(x, w13).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w2)


def fused_moe_iterative(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                        topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """``hidden [T, H]``; ``topk_weights, topk_ids [T, k]`` (ids of this layer's local experts,
    0 .. E-1, or -1 for an expert held elsewhere: skipped) -> ``[T, H]``."""
    out = torch.zeros_like(hidden)
    for expert in range(w13.shape[0]):
        tokens, slots = torch.where(topk_ids == expert)     # which tokens chose it, as which of k
        if tokens.numel() == 0:
            continue
        y = expert_mlp(hidden[tokens], w13[expert], w2[expert])
        out.index_add_(0, tokens, y * topk_weights[tokens, slots, None].to(y.dtype))
    return out
