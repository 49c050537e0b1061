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
    # Data parallelism: ``data_parallel_size`` whole model copies, each in an engine core of
    # its own. One front end over all of them (``DPLBMPClient``, ``engine/core_client.py``)
    # balances the load itself; with ``data_parallel_external_lb`` (a rank was given) this
    # engine is replica ``data_parallel_rank`` only and something in front (a router)
    # balances. The rank offsets the core's KV event ports.
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    data_parallel_external_lb: bool = False
