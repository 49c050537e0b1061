"""``CacheConfig``: the paged KV cache's shape and budget (vLLM: ``vllm/config/cache.py``)."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_KV_CACHE_BYTES = 1 << 30  # 1 GiB of KV cache on a CPU when num_kv_blocks is not given
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default
MAMBA_CACHE_MODES = ("align", "all", "none")   # vLLM's values; "align" its default with prefix caching


@dataclass(frozen=True)
class CacheConfig:
    """How the KV cache is cut into blocks and how big it may grow.

    block_size              tokens per block (a power of two)
    enable_prefix_caching   reuse the blocks of shared prompt prefixes
    mamba_cache_mode        a hybrid's state snapshots (one of ``MAMBA_CACHE_MODES``):
                            "align" (the default, vLLM's) or "all": a snapshot at every
                            block boundary, so a prefix hit can resume the state; "none":
                            no snapshots (a hybrid never hits). "all" is what this engine
                            does, and vLLM's older name for it; vLLM's "align" keeps fewer
                            snapshots (only where a scheduler step ends on a block
                            boundary, its prefill chunks cut to whole blocks), so here
                            "align" holds more pages than in vLLM and hits at least as often
    num_kv_blocks           the user's fixed number of blocks, or None: as many as fit
                            (vLLM: ``num_gpu_blocks_override``)
    kv_cache_memory_bytes   on a CPU: the bytes the blocks may take (None on CUDA)
    gpu_memory_utilization  on CUDA: the fraction of the GPU's free memory the engine may
                            use; the cache gets what weights and activations leave (None
                            on a CPU)

    Exactly one of the two budgets is set: the platform says which one it sizes the
    cache from (``Platform.kv_cache_budget``). The number of blocks is then decided by
    the executor's profiling (``Engine._initialize_kv_caches``), not stored here.
    """

    block_size: int = 16
    enable_prefix_caching: bool = True
    mamba_cache_mode: str = "align"
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = DEFAULT_KV_CACHE_BYTES
    gpu_memory_utilization: float | None = None
