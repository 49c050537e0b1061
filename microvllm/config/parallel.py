"""``ParallelConfig``: how many ranks share the model (vLLM: ``vllm/config/parallel.py``)."""

from __future__ import annotations

from dataclasses import dataclass

# vLLM's names for who runs the ranks (``executor/__init__.py``'s ``get_executor_class``).
DISTRIBUTED_EXECUTOR_BACKENDS = ("mp", "ray", "uni")


@dataclass(frozen=True)
class ParallelConfig:
    """``tensor_parallel_size``: split the model over this many worker processes (ranks)
    with torch.distributed; 1 runs it in the engine's process (``executor/``).
    ``enable_expert_parallel``: a mixture-of-experts layer's experts are split over those
    ranks (whole experts per rank) instead of each expert's matrices.
    ``distributed_executor_backend``: who starts the ranks: ``"mp"`` worker processes on
    this machine (one rank: none, the engine's process runs it, as ``"uni"``), ``"ray"``
    Ray actors in a cluster started with ``ray start`` (any number of machines; even one
    rank runs in an actor)."""

    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    distributed_executor_backend: str = "mp"
    # Data parallelism: this engine is replica ``data_parallel_rank`` of ``data_parallel_size``
    # (each a whole model copy; ``engine/dp_async_llm.py``). The rank offsets its KV event ports.
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
