"""Executor: the engine's handle on the workers (vLLM: ``vllm/v1/executor/``).

    abstract.py             the interface the engine calls, and ``Executor.get_class``
    uniproc_executor.py     tensor_parallel_size=1: one Worker, in this process
    multiproc_executor.py   tensor_parallel_size=N: N worker processes, one rank each

The engine never touches a tensor: whatever runs the model sits behind this seam.
"""

from microvllm.executor.abstract import Executor
from microvllm.executor.multiproc_executor import MultiprocExecutor, WorkerProc
from microvllm.executor.uniproc_executor import UniProcExecutor

__all__ = ["Executor", "MultiprocExecutor", "UniProcExecutor", "WorkerProc"]
