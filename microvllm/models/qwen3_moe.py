"""Qwen3-MoE: Qwen3 whose MLPs are (all or some) mixtures of experts (vLLM:
``models/qwen3_moe.py``; Hugging Face: ``Qwen3MoeForCausalLM``)::

    h = h + o_proj(Attention(...))                           as Qwen3 (per-head q/k norms)
    h = h + SparseMoeBlock(RMSNorm(h))       on sparse layers, else the dense LlamaMLP
            router_logits = gate(x)          [T, E]  one small matmul, replicated on every rank
            experts(x, router_logits)        FusedMoE: top-k experts per token, weighted sum

Which layers are sparse (config.json): layer i is, unless it is in ``mlp_only_layers``,
when ``(i + 1) % decoder_sparse_step == 0`` (every layer with step 1). The router
renormalizes its top-k weights with ``norm_topk_prob``. Each expert's MLP is
``moe_intermediate_size`` wide; a dense layer's is ``intermediate_size``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from microvllm.layers.fused_moe import FusedMoE
from microvllm.layers.linear import Linear
from microvllm.models.llama import LlamaMLP
from microvllm.models.qwen3 import Qwen3ForCausalLM


class MoEDims(NamedTuple):
    """A mixture-of-experts model's shape, from config.json (for checks made before any
    model is built: how the experts split over ranks)."""
    num_experts: int
    top_k: int
    intermediate_size: int        # one expert's
    has_dense_layers: bool        # some layers keep a dense MLP (config's intermediate_size)


class SparseMoeBlock(nn.Module):
    """The router (``gate``, Hugging Face's name) and the experts, for one layer."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 renormalize: bool):
        super().__init__()
        self.gate = Linear(hidden_size, num_experts, bias=False)   # whole on every rank
        self.experts = FusedMoE(num_experts, top_k, hidden_size, intermediate_size, renormalize)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x))


def is_sparse_layer(config, layer_idx: int) -> bool:
    """Hugging Face's rule for Qwen2/3-MoE: which layers have experts."""
    return (layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
            and config.num_experts > 0 and (layer_idx + 1) % config.decoder_sparse_step == 0)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    is_mixture_of_experts = True
    @staticmethod
    def moe_dims(config):
        dense = any(not is_sparse_layer(config, i) for i in range(config.num_hidden_layers))
        return MoEDims(config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size, dense)

    def make_mlp(self, config, layer_idx: int) -> nn.Module:
        if not is_sparse_layer(config, layer_idx):
            return LlamaMLP(config)
        return SparseMoeBlock(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                              config.moe_intermediate_size, bool(config.norm_topk_prob))
