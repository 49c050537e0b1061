"""``GatedDeltaNet``: Qwen3.5's linear-attention layer, one sequence at a time, its state
passed in and out (vLLM: ``QwenGatedDeltaNetAttention`` in
``vllm/model_executor/layers/mamba/gdn/``; the checkpoint's names are Hugging Face's)::

    x [T, hidden]
      ├─ in_proj_qkv ─> causal_conv1d (+ conv state) ─> split q [T, H_k, d_k], k, v [T, H_v, d_v]
      ├─ in_proj_b   ─> beta = sigmoid(b)                      [T, H_v]  how hard to write
      ├─ in_proj_a   ─> g = -exp(A_log) * softplus(a + dt_bias) [T, H_v]  how much to forget (log)
      └─ in_proj_z   ─> z                                      [T, H_v, d_v] the output gate
    gated delta rule (q, k, v, g, beta, recurrent state) ─> o [T, H_v, d_v]
    norm(o) * silu(z) ─> out_proj ─> [T, hidden]

The state of one request in one such layer, the same size whatever its length::

    conv        [conv_dim, K-1]        conv_dim = 2 * H_k * d_k + H_v * d_v
    recurrent   [H_v, d_k, d_v]        float32
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from microvllm.layers.linear_attention.causal_conv1d import causal_conv1d
from microvllm.layers.linear_attention.gated_delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule


@dataclass
class LinearAttentionState:
    """One request's state in one linear-attention layer (None: a new sequence)."""

    conv: torch.Tensor | None = None
    recurrent: torch.Tensor | None = None


class GatedRMSNorm(nn.Module):
    """RMSNorm over each head's d_v values, then weight, then times silu(z)
    (Hugging Face's ``Qwen3_5RMSNormGated``: the weight starts at 1, not zero-centred)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        x = self.weight * x.to(dtype)
        return (x * F.silu(z.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_k_heads, self.num_v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel = config.linear_conv_kernel_dim
        hidden = config.hidden_size
        self.in_proj_qkv = nn.Linear(hidden, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden, self.num_v_heads, bias=False)
        # The checkpoint stores nn.Conv1d's weight, [conv_dim, 1, K].
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.conv_kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, state: LinearAttentionState) -> tuple[torch.Tensor, LinearAttentionState]:
        """One sequence's next T tokens (T = 1: decode), after ``state``."""
        T = x.shape[0]
        mixed, conv_state = causal_conv1d(self.in_proj_qkv(x), self.conv1d.weight[:, 0], state.conv)
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(T, self.num_k_heads, self.head_k_dim)
        k = k.reshape(T, self.num_k_heads, self.head_k_dim)
        v = v.reshape(T, self.num_v_heads, self.head_v_dim)
        beta = self.in_proj_b(x).sigmoid()
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        rule = recurrent_gated_delta_rule if T == 1 else chunk_gated_delta_rule
        o, recurrent = rule(q, k, v, g, beta, state.recurrent)
        z = self.in_proj_z(x).reshape(T, self.num_v_heads, self.head_v_dim)
        o = self.norm(o, z).reshape(T, self.value_dim)
        return self.out_proj(o), LinearAttentionState(conv_state, recurrent)
