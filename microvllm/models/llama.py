"""Llama, the decoder every model here is a variation of.

One token row per scheduled token, no batch dimension: the runner flattens all
requests of a step into ``T`` tokens, and attention sorts out who sees whom::

    input_ids [T] ──embed──> h [T, hidden]
    for each layer:
        h = h + o_proj(Attention(RoPE(q), RoPE(k), v))    q,k,v = split(qkv_proj(RMSNorm(h)))
        h = h + down_proj(silu(gate) * up)                  gate,up = split(gate_up_proj(RMSNorm(h)))
    hidden = RMSNorm(h)  ──lm_head (only rows whose next token is due)──> logits

In the code ``h`` is carried as ``residual`` and each ``h = h + ...`` is done by the
next RMSNorm, fused with it (``RMSNorm(x, residual)``), as vLLM's models do.

Projections are fused (q/k/v in one matmul, gate/up in one matmul): the loader
stacks Hugging Face's separate weights into them.

Tensor parallelism (``tensor_parallel_size=N``, N processes) uses vLLM's sharded layers:
each rank holds 1/N of the heads (``QKVParallelLinear``) and of the MLP
(``MergedColumnParallelLinear``), and ``o_proj`` / ``down_proj`` (``RowParallelLinear``)
all-reduce their partial sums, so ``h`` is whole on every rank after every layer. The
embedding and the LM head split the vocabulary (``vocab_parallel_embedding.py``). With
N = 1 these are plain ``Linear`` / embedding layers: no communication. Mistral adds a sliding window;
Qwen3 adds an RMSNorm on each query and key head (``qk_norm``) and an explicit
``head_dim``: both are options of this one class.
"""

from __future__ import annotations

import torch
from torch import nn

from microvllm.attention.backend import AttentionBackend
from microvllm.attention.metadata import AttentionMetadata
from microvllm.core.kv_cache_spec import KVCacheSpec
from microvllm.layers.activation import SiluAndMul
from microvllm.layers.attention import Attention
from microvllm.layers.layernorm import RMSNorm
from microvllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from microvllm.layers.logits_processor import LogitsProcessor
from microvllm.layers.rotary_embedding import ApplyRotaryEmb, RotaryEmbedding
from microvllm.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from microvllm.models.kv_cache_layout import KVCacheLayout


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx: int, layout: KVCacheLayout, backend: AttentionBackend,
                 qk_norm: bool):
        super().__init__()
        total_num_heads = config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // total_num_heads
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, total_num_heads,
                                          config.num_key_value_heads, bias=bias)
        # This rank's heads (all of them with tensor_parallel_size=1).
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(total_num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.rotary_emb = ApplyRotaryEmb()
        group = layout.layer_to_group[layer_idx]
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim,
                              scale=self.head_dim ** -0.5, backend=backend,
                              sliding_window=layout.sliding_windows[group],
                              kv_cache_group=group)

    def forward(self, cos_sin, hidden, kv_cache, metadata: AttentionMetadata):
        """``cos_sin``: this step's RoPE angles (``RotaryEmbedding.cos_sin``), shared by all layers."""
        heads = self.qkv_proj(hidden).view(-1, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        q, k, v = heads.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        if self.q_norm is not None:  # Qwen3: normalise each head before RoPE
            q, k = self.rotary_emb(self.q_norm(q), *cos_sin), self.rotary_emb(self.k_norm(k), *cos_sin)
        else:  # q and k heads sit side by side: rotate them in one go
            q, k = self.rotary_emb(heads[:, :self.num_heads + self.num_kv_heads], *cos_sin).split(
                [self.num_heads, self.num_kv_heads], dim=1)
        return self.o_proj(self.attn(q, k, v, kv_cache, metadata))


class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2,
                                                       bias=bias)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=bias)
        self.act_fn = SiluAndMul()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={config.hidden_act!r} is not supported (only 'silu')")

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx, layout, backend, qk_norm, mlp: nn.Module):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_idx, layout, backend, qk_norm)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp   # LlamaMLP, or a mixture of experts (qwen3_moe.py, mixtral.py)

    def forward(self, cos_sin, hidden, residual, kv_cache, metadata):
        """``residual`` is the residual stream (Hugging Face's ``hidden_states``), carried
        beside the branch output ``hidden`` as in vLLM: each norm first adds the previous
        branch's output into it (one fused pass). None before the first layer."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(cos_sin, hidden, kv_cache, metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(nn.Module):
    qk_norm = False

    def __init__(self, config, backend: AttentionBackend, max_position: int | None = None):
        super().__init__()
        self.config = config
        self.layout = KVCacheLayout.from_config(config)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        max_position = max_position or config.max_position_embeddings
        self.rotary = RotaryEmbedding(config, head_dim, max_position)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, self.layout, backend, self.qk_norm, self.make_mlp(config, i))
            for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.tie_weights()

    def make_mlp(self, config, layer_idx: int) -> nn.Module:
        """Layer ``layer_idx``'s feed-forward block: the dense MLP here; a mixture-of-experts
        model returns its sparse block for some or all layers."""
        return LlamaMLP(config)

    def attention_dims(self) -> tuple[int, int]:
        """``(num_kv_heads, head_dim)`` of this rank's attention layers: the shape of a page."""
        attn = self.layers[0].self_attn
        return attn.num_kv_heads, attn.head_dim

    def get_kv_cache_spec(self, block_size: int) -> list[KVCacheSpec]:
        """What each layer's KV cache needs, as core's specs (vLLM's ``get_kv_cache_spec``);
        layers with equal specs share a cache group (``self.layout``)."""
        specs = self.layout.kv_cache_specs(block_size)
        return [specs[group] for group in self.layout.layer_to_group]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], attn_metadata: list[AttentionMetadata]) -> torch.Tensor:
        """``input_ids, positions [T]``; ``kv_caches[layer]``; ``attn_metadata[cache group]``.
        Returns the final hidden states ``[T, hidden]`` (logits are computed separately,
        only for the rows that need them)."""
        hidden, residual = self.embed_tokens(input_ids), None
        cos_sin = self.rotary.cos_sin(positions)  # once per step, not once per layer
        for i, layer in enumerate(self.layers):
            metadata = attn_metadata[self.layout.layer_to_group[i]]
            hidden, residual = layer(cos_sin, hidden, residual, kv_caches[i], metadata)
        hidden, _ = self.norm(hidden, residual)   # the last MLP's output added, then normalised
        return hidden

    def tie_weights(self) -> None:
        """With ``tie_word_embeddings``, the output projection is the embedding matrix: one
        Parameter, two uses, filled once by the loader (which calls this again after
        materialising the model: ``to_empty`` makes each use its own tensor)."""
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [rows, hidden_size]`` -> ``logits [rows, vocab_size]`` (whole, on every
        rank: ``LogitsProcessor`` gathers the ranks' slices)."""
        return self.logits_processor(self.lm_head, hidden)

    # Hugging Face checkpoint names -> our fused parameters: (ours, theirs, shard id), the
    # shard id being what the fused layer's weight_loader takes (vLLM's stacked_params_mapping).
    stacked_params = [
        ("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1),
    ]
