"""Mixtral: Mistral whose every MLP is a mixture of ``num_local_experts`` experts, top-2
(vLLM: ``models/mixtral.py``; Hugging Face: ``MixtralForCausalLM``).

Its router takes the top-k of the logits and a softmax over those k — the same numbers as
a softmax over all experts renormalized over the top k, which is how Hugging Face computes
it, so ``renormalize=True``. Each expert is ``intermediate_size`` wide; its matrices are
named ``w1`` (gate), ``w3`` (up), ``w2`` (down) in the checkpoint, and the block is
``block_sparse_moe`` where other models say ``mlp`` (the loader renames it).
"""

from __future__ import annotations

from torch import nn

from microvllm.models.mistral import MistralForCausalLM
from microvllm.models.qwen3_moe import MoEDims, SparseMoeBlock


class MixtralForCausalLM(MistralForCausalLM):
    is_mixture_of_experts = True
    checkpoint_renames = {".block_sparse_moe.": ".mlp."}

    @staticmethod
    def moe_dims(config):
        return MoEDims(config.num_local_experts, config.num_experts_per_tok, config.intermediate_size, False)

    def make_mlp(self, config, layer_idx: int) -> nn.Module:
        return SparseMoeBlock(config.hidden_size, config.num_local_experts, config.num_experts_per_tok,
                              config.intermediate_size, renormalize=True)
