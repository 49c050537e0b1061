"""The Triton attention backend: ``attention_backend="triton"``.

Same interface as the torch reference (``torch_ref.py``), different engine room:

    write_kv  -> triton_kernels/write_kv.py   one program per new token
    forward   -> triton_kernels/unified.py    one launch for the whole mixed batch
                 (or triton_kernels/decode.py for decode-only batches when the
                  backend is built with use_decode_kernel=True)

By default every batch goes to the unified kernel, as in vLLM V1: a decode is a
chunk of one token, so there is a single code path to trust. The decode kernel is
the teaching first step of notebook 06; ``TritonAttentionBackend(use_decode_kernel=True)``
plugs it into the engine for decode-only steps.

Importing this module does not import triton (``import microvllm`` stays light).
Triton is imported when the backend is constructed. On a machine without CUDA the
kernels run in Triton's CPU interpreter (slow; float32 and float16 only), which the
constructor switches on if nothing has imported triton yet, and otherwise explains
how to.
"""

from __future__ import annotations

import torch

from microvllm.attention.backend import AttentionBackend
from microvllm.attention.metadata import AttentionMetadata

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class TritonAttentionBackend(AttentionBackend):
    """Paged attention with Triton kernels; compiled on a CUDA GPU, interpreted on a CPU."""

    name = "triton"

    def __init__(self, use_decode_kernel: bool = False):
        from microvllm.attention.triton_kernels import check_kernel_can_run, ensure_triton_can_run, is_interpreted
        ensure_triton_can_run()  # raises a RuntimeError that says what to change
        from microvllm.attention.triton_kernels import decode, unified, write_kv

        check_kernel_can_run(unified.unified_attention_kernel)
        self.interpreted = is_interpreted(unified.unified_attention_kernel)
        self.use_decode_kernel = use_decode_kernel
        self._write_kv = write_kv.write_kv
        self._unified_attention = unified.unified_attention
        self._decode_attention = decode.decode_attention

    def write_kv(self, key, value, kv_cache, slot_mapping):
        self._write_kv(key, value, kv_cache, slot_mapping)

    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
                *, scale: float, sliding_window: int | None = None) -> torch.Tensor:
        check_supported(query, kv_cache, sliding_window, interpreted=self.interpreted)
        out = torch.empty_like(query)
        if self.use_decode_kernel and metadata.max_query_len <= 1:
            self._decode_attention(query, kv_cache, metadata, scale=scale,
                                   sliding_window=sliding_window, out=out)
        else:
            self._unified_attention(query, kv_cache, metadata, scale=scale,
                                    sliding_window=sliding_window, out=out)
        # Rows past the batch's real tokens (padding) belong to no request: the
        # kernels never touch them, the reference returns zeros there, so do we.
        out[metadata.num_actual_tokens:].zero_()
        return out


def check_supported(query: torch.Tensor, kv_cache: torch.Tensor, sliding_window: int | None,
                    *, interpreted: bool) -> None:
    """Refuse, with what to change, the inputs the kernels do not handle."""
    if query.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"the Triton attention backend supports float32, float16 and "
                         f"bfloat16, not {query.dtype}")
    if kv_cache.dtype != query.dtype:
        raise ValueError(f"query is {query.dtype} but the KV cache is {kv_cache.dtype}: "
                         f"allocate the cache in the model's dtype")
    if interpreted and query.dtype == torch.bfloat16:
        raise ValueError("Triton's CPU interpreter computes bfloat16 wrongly: on a CPU use "
                         "dtype='float32' or 'float16' with the Triton backend, or "
                         "attention_backend='torch'")
    block_size = kv_cache.shape[2]
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size={block_size}: the Triton kernels load one cache page "
                         f"per tl.dot tile, which needs a power of two of at least 16; use "
                         f"block_size=16 (or 32, 64...) or attention_backend='torch'")
    num_heads, num_kv_heads = query.shape[1], kv_cache.shape[3]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads cannot be grouped onto "
                         f"{num_kv_heads} KV heads: num_heads must be a multiple")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window={sliding_window}: use None (no window) or >= 1")
    if query.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("query and kv_cache must be contiguous along head_dim")
