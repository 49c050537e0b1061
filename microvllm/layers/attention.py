"""The attention layer the model calls. It owns nothing but its shape: the KV cache
tensor and the step's metadata are passed in explicitly, and the actual work is
done by whichever backend (``torch``, ``triton``) the engine chose."""

from __future__ import annotations

import torch
from torch import nn

from microvllm.attention.backend import AttentionBackend
from microvllm.attention.metadata import AttentionMetadata


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 backend: AttentionBackend, sliding_window: int | None = None,
                 kv_cache_group: int = 0):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads={num_heads} is not a multiple of "
                             f"num_key_value_heads={num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.backend = backend
        self.sliding_window = sliding_window
        self.kv_cache_group = kv_cache_group  # which block table / slot mapping this layer uses

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        """``q [T, num_heads, d]``, ``k, v [T, num_kv_heads, d]`` -> ``[T, num_heads * d]``."""
        # Write first: this step's own keys are part of the context it attends to.
        self.backend.write_kv(k, v, kv_cache, metadata.slot_mapping)
        out = self.backend.forward(q, kv_cache, metadata, scale=self.scale,
                                   sliding_window=self.sliding_window)
        return out.reshape(out.shape[0], self.num_heads * self.head_dim)
