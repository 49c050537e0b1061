"""RMSNorm: scale each token's vector by the inverse root-mean-square of its entries.

    y = x / sqrt(mean(x**2) + eps) * weight

Computed in float32 whatever the model dtype, as Hugging Face does, so that the
result (and therefore every greedy token) matches it.

As in vLLM, the norm can also take the residual stream and add the previous branch's
output into it first (the "fused residual add"): one pass instead of an add and a
norm. A ``CustomOp``: a platform may run the same math in one kernel (the CPU
platform's rounds where this code rounds, and updates ``residual`` in place, as
vLLM's ``fused_add_rms_norm`` does).
"""

from __future__ import annotations

import torch
from torch import nn

from microvllm.layers.custom_op import CustomOp


class RMSNorm(CustomOp):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``RMSNorm(x)``; or, given the residual stream, add ``x`` into it and normalise
        the sum, returning both::

            out, residual = norm(x, residual)   # residual = residual + x; out = RMSNorm(residual)
        """
        if residual is not None:
            x = residual = residual + x
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * x.to(dtype)
        return out if residual is None else (out, residual)


class GemmaRMSNorm(nn.Module):
    """RMSNorm whose weight is stored *zero-centred* (vLLM's name; Gemma, Qwen3-Next, Qwen3.5)::

        y = x / sqrt(mean(x**2) + eps) * (1 + weight)

    multiplied in float32 and rounded once, as Hugging Face's ``Qwen3_5RMSNorm`` does (plain
    ``RMSNorm`` rounds before the weight). Plain torch on every platform. Takes the residual
    stream as ``RMSNorm`` does."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            x = residual = residual + x
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        out = (normed * (1.0 + self.weight.float())).to(x.dtype)
        return out if residual is None else (out, residual)
