"""The two collectives tensor parallelism needs, as the layers call them (vLLM:
``vllm/distributed/communication_op.py``)::

    tensor_model_parallel_all_reduce(x)   partial sums -> the sum, on every rank
                                          (after RowParallelLinear, VocabParallelEmbedding)
    tensor_model_parallel_all_gather(x)   shards -> the whole, on every rank
                                          (the logits, before sampling)

With one rank both return ``x`` itself: no communication.
"""

from __future__ import annotations

import torch

from microvllm.distributed.parallel_state import get_tp_group


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    return get_tp_group().all_reduce(x)


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return get_tp_group().all_gather(x, dim)
