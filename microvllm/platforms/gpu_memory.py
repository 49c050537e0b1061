"""How many KV cache blocks fit on the GPU (vLLM: ``Worker.determine_available_memory``
and ``EngineCore._initialize_kv_caches``), with the GPU's memory readings as arguments,
so that the arithmetic is tested on a CPU with made-up readings (``CudaPlatform`` takes
the readings)::

    GPU memory (total)
    |<------------------------------- total_bytes -------------------------------->|
    | used by others |<------------------ free_bytes_at_start ------------------->|
                     |<------- free x gpu_memory_utilization ------->|
                     | weights | peak activations |    KV cache    |  (left over)  |
                     |<------ peak_bytes -------->|<- kv budget -->|
                       (measured in the profiling pass: a forward of the
                        largest batch, max_num_batched_tokens tokens)

    num_blocks = (free_bytes_at_start x gpu_memory_utilization - peak_bytes) // bytes_per_block

``free_bytes_at_start`` is read before the engine loads anything, so memory another
process holds (a notebook's other model) is never counted as ours. vLLM V1 takes the
fraction of the *total* and refuses to start when that much is not free; on a GPU of
one's own (a Colab runtime) the two agree.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MemoryAtStart:
    """Read before the worker loads anything (``CudaPlatform.memory_at_start``)."""

    free_bytes: int       # torch.cuda.mem_get_info()[0]
    allocated_bytes: int  # torch.cuda.memory_allocated(): another engine's, in this process


@dataclass(frozen=True)
class MemoryProfile:
    """The readings, in bytes."""

    total_bytes: int          # torch.cuda.mem_get_info()[1]
    free_bytes_at_start: int  # torch.cuda.mem_get_info()[0] before the weights were loaded
    peak_bytes: int           # torch.cuda.max_memory_allocated() after the profiling pass


def num_gpu_blocks(profile: MemoryProfile, gpu_memory_utilization: float, bytes_per_block: int) -> int:
    """KV cache blocks that fit (the module docstring draws the budget); refuses, saying
    what to change, when fewer than 2 do (block 0 is the null block)."""
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization={gpu_memory_utilization!r} must be a fraction in (0, 1]")
    if bytes_per_block < 1:
        raise ValueError(f"bytes_per_block={bytes_per_block} must be positive")
    budget = int(profile.free_bytes_at_start * gpu_memory_utilization)
    kv_bytes = budget - profile.peak_bytes
    num_blocks = max(kv_bytes, 0) // bytes_per_block
    if num_blocks < 2:
        raise RuntimeError(
            f"no room for the KV cache: {gpu_memory_utilization:.0%} of the {_gib(profile.free_bytes_at_start)} "
            f"free at start is {_gib(budget)}, and the weights plus the largest batch's activations "
            f"took {_gib(profile.peak_bytes)}; each block needs {bytes_per_block / 2**20:.1f} MiB. "
            "Raise gpu_memory_utilization, lower max_num_batched_tokens, free GPU memory held "
            "elsewhere, or pass num_kv_blocks")
    return num_blocks


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"
