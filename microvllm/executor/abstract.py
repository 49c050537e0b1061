"""``Executor``: what the engine asks of the workers, however many there are (vLLM:
``vllm/v1/executor/abstract.py``)::

    engine ──> executor.kv_cache_layout            which layers share a block table
               executor.kv_cache_bytes_per_block() what one block costs (on one rank)
               executor.determine_num_kv_blocks()  how many fit (a GPU: after a profiling pass)
               executor.initialize_kv_cache(n)     allocate n blocks (on every rank)
               executor.execute_model(plan)        one step -> ModelRunnerOutput
               executor.collective_rpc(name)       any other Worker method, on every rank
               executor.shutdown()                 stop the workers (if any)

``get_executor_class(config)`` (in ``executor/__init__.py``) picks the implementation:
``UniProcExecutor`` for ``tensor_parallel_size=1`` (the worker in this process, no
torch.distributed), ``MultiprocExecutor`` for more, ``RayDistributedExecutor`` for
``distributed_executor_backend="ray"`` (the ranks as Ray actors, on several machines).
(vLLM's is ``Executor.get_class``, a method of this class; here it sits in the package so
that the interface imports no implementation.)
"""

from __future__ import annotations

from abc import ABC, abstractmethod


class Executor(ABC):
    """Built from the frozen ``EngineConfig`` and, beside it, the course's ``components``
    (the worker builds the model runner, block table and sampler classes found there)."""

    @abstractmethod
    def __init__(self, config, eos_token_ids: set[int], platform, components: dict[str, type] | None = None):
        """Load the model (on every rank) onto ``platform``'s device."""

    @property
    @abstractmethod
    def kv_cache_layout(self):
        """The model's ``KVCacheLayout`` (the same on every rank)."""

    @abstractmethod
    def kv_cache_bytes_per_block(self) -> int:
        """Bytes of one KV block on one rank (a rank holds only its KV heads)."""

    @abstractmethod
    def collective_rpc(self, method: str, *args):
        """Run ``Worker.<method>(*args)`` on every rank; return rank 0's result."""

    # The rest is the same call on every rank, however the ranks are reached (vLLM's
    # Executor defines these through collective_rpc too).
    def determine_num_kv_blocks(self) -> int:
        """How many KV blocks fit on one rank, as the platform measures it (on a GPU, after
        a profiling pass of the largest batch). Rank 0's: every device alike."""
        return self.collective_rpc("determine_num_kv_blocks")

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate ``num_blocks`` KV blocks per layer on every rank: the scheduler's block
        ids are global, so every rank holds the same blocks (of its own heads)."""
        self.collective_rpc("initialize_kv_cache", num_blocks)

    def execute_model(self, scheduler_output):
        """Run one step's plan; return rank 0's ``ModelRunnerOutput``."""
        return self.collective_rpc("execute_model", scheduler_output)

    def shutdown(self) -> None:
        """Stop whatever the executor started (nothing, in one process)."""
