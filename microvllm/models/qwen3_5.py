"""Qwen3.5 (text): a hybrid of Gated DeltaNet (linear attention) and gated full attention.

Three linear-attention layers to every full-attention layer (``config.layer_types``)::

    layer i:   h = h + mixer(RMSNorm(h))        mixer = GatedDeltaNet        (linear_attention)
                                                       or gated attention    (full_attention)
               h = h + down_proj(silu(gate) * up)(RMSNorm(h))

What differs from Llama (``llama.py``), all from Hugging Face's ``modeling_qwen3_5.py``:

- the linear-attention layers (``layers/linear_attention/``): a state per request instead of
  keys and values, kept in the same paged pool (``paged_state.py``, ``MambaSpec``);
- full attention is **gated**: ``q_proj`` makes each head's query and a gate side by side,
  and the attention output is multiplied by ``sigmoid(gate)`` before ``o_proj``;
- per-head RMSNorm on queries and keys (as Qwen3), and every RMSNorm's weight is stored
  zero-centred: ``x * (1 + w)`` (``GemmaRMSNorm``);
- **partial RoPE**: only the first ``head_dim * partial_rotary_factor`` channels of each
  query and key head are rotated (a quarter in Qwen3.5), the rest pass through.

One process (tensor_parallel_size=1), no speculative decoding, no quantized weights, no
decode fast path: the plain code runs (vLLM: ``vllm/model_executor/models/qwen3_5.py``,
``qwen3_next.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from microvllm.attention.backend import AttentionBackend
from microvllm.layers.attention import Attention
from microvllm.layers.layernorm import GemmaRMSNorm
from microvllm.layers.linear_attention.gated_deltanet import GatedDeltaNet
from microvllm.layers.linear_attention.paged_state import forward_paged
from microvllm.layers.logits_processor import LogitsProcessor
from microvllm.layers.rotary_embedding import RotaryEmbedding, rotate
from microvllm.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from microvllm.models.kv_cache_layout import KVCacheLayout
from microvllm.models.llama import LlamaForCausalLM, LlamaMLP


def rotary_dim(config, head_dim: int) -> int:
    """Channels of each head that RoPE rotates (``partial_rotary_factor`` of them)."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    return int(head_dim * rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)))


class Qwen3_5Attention(nn.Module):
    """Gated full attention::

        q_proj(x) [T, heads, 2 * head_dim] = per head: [ query | gate ]
        out = o_proj( attention(RoPE(q_norm(query)), RoPE(k_norm(k)), v) * sigmoid(gate) )
    """

    def __init__(self, config, layer_idx: int, layout: KVCacheLayout, backend: AttentionBackend):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.rotary_dim = rotary_dim(config, self.head_dim)
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(config.hidden_size, 2 * self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, scale=self.head_dim ** -0.5,
                              backend=backend, sliding_window=None, kv_cache_group=layout.layer_to_group[layer_idx])

    def partial_rope(self, x: torch.Tensor, cos_sin) -> torch.Tensor:
        turned = rotate(x[..., :self.rotary_dim], *cos_sin)
        return torch.cat([turned, x[..., self.rotary_dim:]], dim=-1)

    def forward(self, cos_sin, hidden, kv_cache, metadata):
        T = hidden.shape[0]
        query, gate = self.q_proj(hidden).view(T, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.partial_rope(self.q_norm(query), cos_sin)
        k = self.partial_rope(self.k_norm(self.k_proj(hidden).view(T, self.num_kv_heads, self.head_dim)), cos_sin)
        v = self.v_proj(hidden).view(T, self.num_kv_heads, self.head_dim)
        out = self.attn(q, k, v, kv_cache, metadata)
        return self.o_proj(out * torch.sigmoid(gate.reshape(T, -1)))


class Qwen3_5DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, layout: KVCacheLayout, backend: AttentionBackend):
        super().__init__()
        self.is_linear = config.layer_types[layer_idx] == "linear_attention"
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(config)
        else:
            self.self_attn = Qwen3_5Attention(config, layer_idx, layout, backend)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, cos_sin, hidden, residual, kv_cache, metadata):
        """As ``LlamaDecoderLayer``; ``kv_cache`` is this layer's KV tensor, whose pages a
        linear-attention layer reads as states."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        if self.is_linear:
            hidden = forward_paged(self.linear_attn, hidden, kv_cache, metadata)
        else:
            hidden = self.self_attn(cos_sin, hidden, kv_cache, metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class Qwen3_5ForCausalLM(LlamaForCausalLM):
    qk_norm = True
    is_hybrid = True

    def __init__(self, config, backend: AttentionBackend, max_position: int | None = None):
        nn.Module.__init__(self)
        self.config = config
        self.layout = KVCacheLayout.from_config(config)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.rotary = RotaryEmbedding(config, rotary_dim(config, head_dim),
                                      max_position or config.max_position_embeddings)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Qwen3_5DecoderLayer(config, i, self.layout, backend)
                                    for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.tie_weights()

    def attention_dims(self) -> tuple[int, int]:
        attn = next(layer.self_attn for layer in self.layers if not layer.is_linear)
        return attn.num_kv_heads, attn.head_dim

    @staticmethod
    def min_block_size(config, block_size: int) -> int:
        """``block_size`` doubled until an attention page's half (keys or values) holds a
        linear layer's conv state and its recurrent state: the page size every group shares
        (vLLM raises the attention block size the same way: 528 tokens for Qwen3.5-4B)."""
        conv = (2 * config.linear_num_key_heads * config.linear_key_head_dim
                + config.linear_num_value_heads * config.linear_value_head_dim) * (config.linear_conv_kernel_dim - 1)
        recurrent = config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        while block_size * config.num_key_value_heads * head_dim < max(conv, recurrent):
            block_size *= 2
        return block_size

    stacked_params = [("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1)]
