"""``LoRALayerWeights``: one adapter's matrices for one layer (vLLM: ``vllm/lora/lora_weights.py``)::

    lora_a [rank, in_features]     the "down" projection (peft's lora_A.weight)
    lora_b [out_features, rank]    the "up" projection (peft's lora_B.weight)
    scaling                        lora_alpha / rank (or / sqrt(rank): rsLoRA)

    the layer's output gains   scaling * lora_b @ (lora_a @ x)

These are the whole, unsharded matrices as the adapter file holds them; a wrapper
(``layers.py``) cuts out its tensor-parallel rank's part when it copies them into its slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LoRALayerWeights:
    module_name: str          # Hugging Face's name, e.g. "layers.0.self_attn.q_proj"
    rank: int
    lora_alpha: float
    lora_a: torch.Tensor      # [rank, in_features]
    lora_b: torch.Tensor      # [out_features, rank]
    scaling: float

    @property
    def input_dim(self) -> int:
        return self.lora_a.shape[1]

    @property
    def output_dim(self) -> int:
        return self.lora_b.shape[0]
