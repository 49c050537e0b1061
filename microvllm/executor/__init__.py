"""Executor: the engine's handle on the workers (vLLM: ``vllm/v1/executor/``).

    abstract.py             the interface the engine calls (``get_executor_class`` below picks one)
    uniproc_executor.py     tensor_parallel_size=1: one Worker, in this process
    multiproc_executor.py   tensor_parallel_size=N: N worker processes, one rank each
    ray_executor.py         distributed_executor_backend="ray": one Ray actor per rank, on the
                            machines of a Ray cluster (imports ray only when chosen)

The engine never touches a tensor: whatever runs the model sits behind this seam.
"""

from microvllm.executor.abstract import Executor
from microvllm.executor.multiproc_executor import MultiprocExecutor, WorkerProc
from microvllm.executor.uniproc_executor import UniProcExecutor


def get_executor_class(parallel_config) -> type[Executor]:
    """The executor for ``parallel_config`` (vLLM: ``Executor.get_class``)::

        distributed_executor_backend   tensor_parallel_size 1   N
        "mp" (the default)             UniProcExecutor          MultiprocExecutor
        "uni"                          UniProcExecutor          (refused by EngineArgs)
        "ray"                          RayDistributedExecutor   RayDistributedExecutor
    """
    if parallel_config.distributed_executor_backend == "ray":
        from microvllm.executor.ray_executor import RayDistributedExecutor
        return RayDistributedExecutor
    return UniProcExecutor if parallel_config.tensor_parallel_size == 1 else MultiprocExecutor


__all__ = ["Executor", "MultiprocExecutor", "UniProcExecutor", "WorkerProc", "get_executor_class"]
