"""The router: which ``top_k`` experts each token goes to, and with what weight
(vLLM: ``FusedMoE.select_experts`` in ``layers/fused_moe/layer.py``).

A router is one small matmul, ``router_logits = x @ W_gate.T`` (``[T, E]``, done by the
model's ``gate`` layer), then this::

    router_logits [T, E] ──softmax──> probs [T, E] ──top-k──> topk_weights [T, k]
                                                              topk_ids     [T, k]  (expert ids)
                         renormalize: topk_weights /= their sum, so each row sums to 1

Softmax and top-k run in float32 whatever the model's dtype, as Hugging Face does: a
tie or near-tie between two experts must break the same way in every engine.

``renormalize`` is config.json's ``norm_topk_prob`` (Qwen3-MoE; always on for Mixtral,
whose "top-k of the logits, then softmax over those k" is the same number). Without it
the weights are the experts' full-softmax probabilities and sum to less than 1.

The bias variant, ``e_score_correction_bias`` (DeepSeek-V3's load-balancing bias, a
vector ``[E]`` learned without a loss): the bias shifts which experts are *chosen*,
never the weights they get::

    chosen  = top-k of (probs + bias)       weights = probs[chosen]  (then renormalized)
"""

from __future__ import annotations

import torch


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                   e_score_correction_bias: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``router_logits [T, E]`` -> ``(topk_weights [T, k] float32, topk_ids [T, k] int64)``,
    each row's experts in order of decreasing score (``torch.topk``'s order)."""
    num_experts = router_logits.shape[-1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be between 1 and the number of experts ({num_experts})")
    probs = torch.softmax(router_logits.float(), dim=-1)
    if e_score_correction_bias is None:
        topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    else:
        _, topk_ids = torch.topk(probs + e_score_correction_bias.float(), top_k, dim=-1)
        topk_weights = probs.gather(-1, topk_ids)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids
