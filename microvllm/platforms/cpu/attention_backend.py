"""The CPU attention backend: ``attention_backend="cpu"`` (the CPU platform's default).

Same split as the torch backend (``torch_sdpa.py``), with the work moved into compiled
kernels that read the paged cache where it lies:

    write_kv   csrc/paged_attention.cpp's write_kv: the step's keys and values
               into their slots, one call (torch_ref.write_kv_torch is two index_copy_)
    decodes    csrc/paged_attention.cpp: every decode of the step in one call
    prefills   csrc/prefill_attention.cpp: every prefill chunk of the step in one
               call, FlashAttention-style tiles (AVX-512 CPUs, head size 64 or 128);
               otherwise one SDPA call per chunk over its gathered context
               (torch_sdpa.prefill_chunks)

Why kernels: a decode step on a CPU is bound by memory traffic. The torch backend
gathers each request's pages into a padded copy before SDPA reads it: every cached
byte is read, written, and read again, every layer. The decode kernel reads it once.
Prefill chunks are compute-bound (many queries per key): there the prefill kernel's
tiles beat SDPA's CPU kernel. In bfloat16, SDPA multiplies in bfloat16 on the CPU's
matrix units and wins on long chunks; the kernel's math is float32, so it takes
bfloat16 and float16 steps only while their longest chunk is at most
``LOW_PRECISION_PREFILL_MAX`` tokens (where the two were even; notebook 11 has the
figures).

This is vLLM's layout of work too: its CPU backend calls C++ kernels for attention
(``csrc/cpu/attention.cpp``, ``cpu_attn.cpp``) and ``reshape_and_cache``
(``csrc/cpu/cache.cpp``) for the writes.
"""

from __future__ import annotations

import torch

from microvllm.attention.backend import AttentionBackend
from microvllm.attention.metadata import AttentionMetadata
from microvllm.attention.selector import register_backend
from microvllm.attention.torch_sdpa import decode_requests, prefill_chunks
from microvllm.platforms.cpu import attention as cpu_kernels

# bfloat16 / float16 prefill chunks longer than this go to SDPA (see above).
LOW_PRECISION_PREFILL_MAX = 384


@register_backend("cpu")   # "cpu" is known once the CPU platform is loaded
class CPUAttentionBackend(AttentionBackend):
    """Decodes and prefill chunks in compiled C++ kernels (built on first use, cached)."""

    name = "cpu"

    def __init__(self):
        reason = cpu_kernels.kernel_status()  # builds the kernel now, not mid-step
        if reason is not None:
            raise RuntimeError(f"attention_backend='cpu' needs its C++ kernel, which is not "
                               f"usable here: {reason}\nChoose attention_backend='torch' "
                               "(or 'auto', which falls back to it).")

    def write_kv(self, key, value, kv_cache, slot_mapping):
        cpu_kernels.write_kv(key, value, kv_cache, slot_mapping)

    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
                *, scale: float, sliding_window: int | None = None) -> torch.Tensor:
        out = torch.empty(query.shape, dtype=query.dtype)   # contiguous (query may be a view)
        num_decodes, rows, requests = decode_requests(metadata)
        if num_decodes:
            decoded = cpu_kernels.paged_attention_decode(
                query[rows], kv_cache, metadata.block_table[requests].contiguous(),
                metadata.seq_lens[requests].contiguous(), scale=scale,
                sliding_window=sliding_window,
                out=out[rows] if isinstance(rows, slice) else None)  # in place when it can be
            if not isinstance(rows, slice):
                out[rows] = decoded
        n = metadata.num_decodes   # with the runner's order, requests n.. are the prefill chunks
        if n is not None and self.prefill_kernel_applies(query, metadata):
            if n < metadata.num_reqs:
                cpu_kernels.paged_attention_prefill(
                    query, kv_cache, metadata.block_table[n:], metadata.query_start_loc[n:],
                    metadata.seq_lens[n:], out, scale=scale, sliding_window=sliding_window)
        else:   # one SDPA call per chunk (it finds them, skipping the decodes)
            prefill_chunks(query, kv_cache, metadata, out, scale=scale, sliding_window=sliding_window)
        return out

    @staticmethod
    def prefill_kernel_applies(query: torch.Tensor, metadata: AttentionMetadata) -> bool:
        """Whether this step's prefill chunks go to the C++ kernel (see the module doc)."""
        return (cpu_kernels.prefill_supported(query.shape[2])
                and (query.dtype == torch.float32
                     or metadata.max_query_len <= LOW_PRECISION_PREFILL_MAX))
