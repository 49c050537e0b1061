"""``LogitsProcessor``: the LM head's output made whole before sampling (vLLM:
``vllm/model_executor/layers/logits_processor.py``)::

    hidden [rows, dim] ──ParallelLMHead──> this rank's logits [rows, V_padded / tp]
                       ──all-gather──────> [rows, V_padded]   (the same on every rank)
                       ──drop padding────> [rows, vocab_size]

Every rank gets all the logits and runs the same seeded sampler on them, so every rank
samples the same tokens and its model runner keeps the same request state as rank 0's;
only rank 0's tokens go back to the engine. vLLM V1 does the same: the logits are
gathered to all ranks and each rank's model runner samples. With one rank it returns the
LM head's output unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from microvllm.distributed import tensor_model_parallel_all_gather


class LogitsProcessor(nn.Module):
    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size

    def forward(self, lm_head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        logits = tensor_model_parallel_all_gather(lm_head(hidden))
        return logits[..., :self.vocab_size]
