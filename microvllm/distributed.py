"""Process-group housekeeping, vLLM's ``vllm.distributed`` seam.

microvllm runs in one process (``tensor_parallel_size=1``), so there is no process
group to tear down. ``cleanup_dist_env_and_memory`` still exists because vLLM
scripts call it between two ``LLM`` objects to give memory back.
"""

from __future__ import annotations

import gc


def cleanup_dist_env_and_memory(shutdown_ray: bool = False) -> None:
    """Free what an ``LLM`` you have ``del``-eted held: one process, so no process group
    to destroy; a garbage collection returns the KV cache and weights to the allocator."""
    gc.collect()
