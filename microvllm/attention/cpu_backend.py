"""The CPU attention backend: ``attention_backend="cpu"`` (what ``"auto"`` picks on a CPU).

Same split as the torch backend (``torch_sdpa.py``), with the decodes moved into a
compiled kernel:

    write_kv   cpu_kernels/paged_attention.cpp's write_kv: the step's keys and values
               into their slots, one call (torch_ref.write_kv_torch is two index_copy_)
    decodes    cpu_kernels/paged_attention.cpp: every decode of the step in one call,
               reading keys and values where they lie in the paged cache
    prefills   one SDPA call per chunk over its gathered context  (torch_sdpa.prefill_chunks)

Why a kernel for decodes only: a decode step on a CPU is bound by memory traffic.
The torch backend gathers each request's pages into a padded copy before SDPA reads
it: every cached byte is read, written, and read again, every layer. The kernel reads
it once. Prefill chunks are compute-bound (many queries per key), where SDPA's
blocked kernel is already good and a gathered copy is cheap next to the matmuls.

This is vLLM's layout of work too: its CPU backend calls a C++ paged-attention
kernel (``csrc/cpu/attention.cpp``) for decodes, and ``reshape_and_cache``
(``csrc/cpu/cache.cpp``) for the writes.
"""

from __future__ import annotations

import torch

from microvllm.attention import cpu_kernels
from microvllm.attention.backend import AttentionBackend, register_backend
from microvllm.attention.metadata import AttentionMetadata
from microvllm.attention.torch_sdpa import decode_requests, prefill_chunks


@register_backend("cpu")
class CPUAttentionBackend(AttentionBackend):
    """Decodes in a compiled C++ kernel (built on first use, cached), prefills with SDPA."""

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
        out = torch.empty_like(query)
        num_decodes, rows, requests = decode_requests(metadata)
        if num_decodes:
            decoded = cpu_kernels.paged_attention_decode(
                query[rows], kv_cache, metadata.block_table[requests].contiguous(),
                metadata.seq_lens[requests].contiguous(), scale=scale,
                sliding_window=sliding_window,
                out=out[rows] if isinstance(rows, slice) else None)  # in place when it can be
            if not isinstance(rows, slice):
                out[rows] = decoded
        prefill_chunks(query, kv_cache, metadata, out, scale=scale, sliding_window=sliding_window)
        return out
