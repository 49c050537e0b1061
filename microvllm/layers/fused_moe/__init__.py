"""A mixture-of-experts layer, in the order a learner reads it (vLLM:
``vllm/model_executor/layers/fused_moe/``)::

    router.py                  select_experts: softmax, top-k, renormalize (and the bias variant)
    moe_torch_iterative.py     (a) the plain loop over experts
    moe_align_block_size.py    the (token, expert) pairs sorted by expert, padded to a block
    moe_sorted.py              (b) one matmul per expert over its contiguous rows
    fused_moe.py               (c) a Triton kernel over the padded blocks (imports triton)
    expert_parallel.py         experts split over ranks: dispatch, experts, combine
    layer.py                   FusedMoE: the stacked weights, the loader, the choice of (a)-(c)
"""

from microvllm.layers.fused_moe.layer import MOE_IMPLS, FusedMoE, moe_layers, take_expert_load
from microvllm.layers.fused_moe.moe_align_block_size import AlignedRouting, moe_align_block_size
from microvllm.layers.fused_moe.moe_sorted import fused_moe_sorted
from microvllm.layers.fused_moe.moe_torch_iterative import fused_moe_iterative
from microvllm.layers.fused_moe.router import select_experts

__all__ = ["AlignedRouting", "FusedMoE", "MOE_IMPLS", "fused_moe_iterative", "fused_moe_sorted",
           "moe_align_block_size", "moe_layers", "select_experts", "take_expert_load"]
