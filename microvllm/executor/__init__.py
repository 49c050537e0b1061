"""Executor: the engine's handle on the workers (vLLM: ``vllm/v1/executor/``).

    abstract.py             the interface the engine calls (``get_executor_class`` below picks one)
    uniproc_executor.py     tensor_parallel_size=1: one Worker, in this process
    multiproc_executor.py   tensor_parallel_size=N: N worker processes, one rank each

The engine never touches a tensor: whatever runs the model sits behind this seam.
"""

from microvllm.executor.abstract import Executor
from microvllm.executor.multiproc_executor import MultiprocExecutor, WorkerProc
from microvllm.executor.uniproc_executor import UniProcExecutor


def get_executor_class(parallel_config) -> type[Executor]:
    """The executor for ``parallel_config.tensor_parallel_size`` (vLLM: ``Executor.get_class``)."""
    return UniProcExecutor if parallel_config.tensor_parallel_size == 1 else MultiprocExecutor


__all__ = ["Executor", "MultiprocExecutor", "UniProcExecutor", "WorkerProc", "get_executor_class"]
