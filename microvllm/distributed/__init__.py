"""torch.distributed for tensor parallelism, vLLM's ``vllm.distributed``.

    parallel_state.py     the process group: init / destroy, ``get_tp_group()``,
                          this rank and the world size; ``get_ep_group()`` for experts
    communication_op.py   what sharded layers call: all-reduce, all-gather

With ``tensor_parallel_size=1`` no process group exists: ``get_tp_group()`` answers
world size 1, rank 0, and every collective returns its input unchanged, so the same
layer code runs in one process with no communication.
"""

from __future__ import annotations

import gc

from microvllm.distributed.communication_op import (
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from microvllm.distributed.parallel_state import (
    GroupCoordinator,
    destroy_distributed_environment,
    get_ep_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    get_tp_group,
    init_distributed_environment,
    serve_rendezvous,
)


def cleanup_dist_env_and_memory(shutdown_ray: bool = False) -> None:
    """Free what an ``LLM`` you have ``del``-eted held: destroy this process's process
    group if one exists (a worker's; the engine process has none), then a garbage
    collection returns the KV cache and weights to the allocator. An ``LLM`` with
    ``tensor_parallel_size > 1`` stops its worker processes itself (``LLM.shutdown``)."""
    destroy_distributed_environment()
    gc.collect()


__all__ = ["GroupCoordinator", "cleanup_dist_env_and_memory", "destroy_distributed_environment", "get_ep_group",
           "get_tensor_model_parallel_rank", "get_tensor_model_parallel_world_size", "get_tp_group",
           "init_distributed_environment", "tensor_model_parallel_all_gather",
           "serve_rendezvous", "tensor_model_parallel_all_reduce"]
