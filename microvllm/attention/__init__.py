"""Attention: the backend interface, the torch reference and the Triton kernels."""
from microvllm.attention.backend import (AttentionBackend, available_backends,
                                         get_attention_backend, register_backend)
from microvllm.attention.metadata import AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata", "available_backends",
           "get_attention_backend", "register_backend"]
