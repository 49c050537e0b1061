"""Mistral: Llama plus a sliding window (``config.sliding_window``), which
``KVCacheLayout`` turns into a sliding-window cache group."""

from microvllm.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass
