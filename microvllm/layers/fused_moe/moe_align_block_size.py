"""Sort the (token, expert) pairs by expert and pad each expert's run to a block size
(vLLM: ``layers/fused_moe/moe_align_block_size.py``, a CUDA kernel there).

The router gives each of ``T`` tokens ``k`` experts: ``topk_ids [T, k]``. Flattened, that
is ``T * k`` *pairs*; pair ``i`` is token ``i // k`` going to expert ``topk_ids.flatten()[i]``.
To run each expert once on all of its rows, list the pairs expert by expert (stable: within
an expert, in pair order), and pad each expert's run up to a multiple of ``block_size``
with the index ``T * k`` (one past the last pair: "no pair here") so that a kernel block of
``block_size`` rows never holds two experts::

    T = 3, k = 2, 4 experts, block_size = 4
    topk_ids          [[2, 0], [0, 1], [2, 0]]       pairs 0..5: experts 2 0 0 1 2 0
    expert 0: pairs 1, 2, 5   expert 1: pair 3   expert 2: pairs 0, 4   expert 3: none

    sorted_token_ids  [1 2 5 6 | 3 6 6 6 | 0 4 6 6]  (6 = padding)
    expert_ids        [0,        1,        2      ]  one per block of 4
    expert_offsets    [0, 4, 8, 12, 12]             expert e's rows: offsets[e] .. offsets[e+1]
    num_tokens_post_padded = 12

An expert that gets no pair gets no block (expert 3 above: offsets[3] == offsets[4]).
With ``block_size = 1`` nothing is padded: the pairs simply sorted by expert. Pairs whose
id is -1 (an expert this rank does not hold, under expert parallelism) are left out.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class AlignedRouting(NamedTuple):
    sorted_token_ids: torch.Tensor   # [num_tokens_post_padded] pair indices, padding = T*k
    expert_ids: torch.Tensor         # [num_tokens_post_padded // block_size] expert of each block
    num_tokens_post_padded: int
    expert_offsets: torch.Tensor     # [E + 1] where each expert's (padded) run starts


def moe_align_block_size(topk_ids: torch.Tensor, block_size: int, num_experts: int) -> AlignedRouting:
    """``topk_ids [T, k]`` (expert ids in ``0 .. num_experts - 1``, or -1 to leave a pair
    out) -> the pairs sorted by expert, each expert's run padded to ``block_size``."""
    if block_size < 1:
        raise ValueError(f"block_size={block_size} must be at least 1")
    flat = topk_ids.flatten().long()
    num_pairs = flat.numel()
    if num_pairs and int(flat.max()) >= num_experts:
        raise ValueError(f"topk_ids holds expert {int(flat.max())} but there are {num_experts} experts")
    ### BEGIN SOLUTION
    kept = flat >= 0
    counts = torch.bincount(flat[kept], minlength=num_experts)           # [E] pairs per expert
    padded = (counts + block_size - 1) // block_size * block_size        # [E] rows per expert
    device = flat.device   # everything on the ids' device (a GPU kernel reads these tensors)
    expert_offsets = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
    expert_offsets[1:] = torch.cumsum(padded, 0)
    total = int(expert_offsets[-1])
    # The pairs in expert order. Left-out pairs sort last (key num_experts) and are cut off.
    order = torch.argsort(torch.where(kept, flat, num_experts), stable=True)[:int(kept.sum())]
    experts = flat[order]
    # Each pair's place: its expert's run start + its rank among that expert's pairs.
    unpadded_starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(order.numel(), device=device) - unpadded_starts[experts]
    sorted_token_ids = torch.full((total,), num_pairs, dtype=torch.long, device=device)
    sorted_token_ids[expert_offsets[experts] + rank] = order
    expert_ids = torch.repeat_interleave(torch.arange(num_experts, device=device), padded // block_size)
    return AlignedRouting(sorted_token_ids, expert_ids, total, expert_offsets)
    ### END SOLUTION
