"""Qwen3: Llama plus an RMSNorm over each query and key head before RoPE
(``q_norm``/``k_norm``) and an explicit ``head_dim`` in config.json."""

from microvllm.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
