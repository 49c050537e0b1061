"""Attention: the backend interface, the selector, the torch reference and the Triton kernels."""
from microvllm.attention.backend import AttentionBackend
from microvllm.attention.metadata import AttentionMetadata
from microvllm.attention.selector import available_backends, get_attention_backend, register_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "available_backends",
           "get_attention_backend", "register_backend"]
