"""The token embedding and the LM head, split across ranks by vocabulary rows (vLLM:
``vllm/model_executor/layers/vocab_parallel_embedding.py``).

Each rank holds an equal, contiguous slice of the vocabulary. When the vocabulary does
not divide, it is padded at the end to a multiple of ``tp`` (vLLM pads further, to a
multiple of 64 per partition, for its GPU kernels; any padding is correct as long as
padded rows are never sampled)::

    vocab 10, tp 4:  padded to 12, 3 rows per rank
    rank 0: tokens 0-2   rank 1: 3-5   rank 2: 6-8   rank 3: token 9 + 2 padding rows (zeros)

``VocabParallelEmbedding``: each rank looks up the tokens in its slice and writes zeros
for the others; an all-reduce adds the one non-zero row per token (exact: x + 0 = x).

``ParallelLMHead``: each rank computes the logits of its slice, ``[T, V_padded / tp]``;
``LogitsProcessor`` all-gathers them and drops the padding, ``[T, vocab_size]``, before
sampling. With one rank, no padding and no communication: an ``nn.Embedding`` and a
``Linear``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from microvllm.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from microvllm.layers.linear import Linear, check_shape


@dataclass(frozen=True)
class VocabShard:
    """This rank's slice of the vocabulary: tokens ``start .. end`` (``end`` at most
    ``vocab_size``) in rows ``0 .. end - start`` of a ``[num_embeddings_per_partition, dim]``
    weight; the rows after them are padding (vLLM: ``VocabParallelEmbeddingShardIndices``)."""

    vocab_size: int
    num_embeddings_per_partition: int
    start: int
    end: int

    @classmethod
    def of_this_rank(cls, vocab_size: int) -> "VocabShard":
        rank, tp_size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        per_partition = -(-vocab_size // tp_size)          # padded to a multiple of tp
        start = min(rank * per_partition, vocab_size)
        return cls(vocab_size, per_partition, start, min(start + per_partition, vocab_size))

    def load(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """Copy this rank's rows of the whole ``[vocab_size, dim]`` checkpoint tensor; zero
        the padding rows."""
        check_shape(loaded_weight, (self.vocab_size, *param.shape[1:]))
        param.data.zero_()
        param.data[:self.end - self.start].copy_(loaded_weight[self.start:self.end])


class VocabParallelEmbedding(nn.Module):
    """``input_ids [T] -> embeddings [T, dim]``, this rank holding a slice of the rows."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.shard = VocabShard.of_this_rank(num_embeddings)
        self.tp_size = get_tensor_model_parallel_world_size()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight = nn.Parameter(torch.empty(self.shard.num_embeddings_per_partition, embedding_dim))
        self.weight.weight_loader = self.weight_loader
        self.quant_method = None   # an EmbeddingMethodBase when the weight is quantized

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        self.shard.load(param, loaded_weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:   # layers/quantization/: dequantize the rows looked up
            return self.quant_method.embedding(self, input_ids)
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        # Tokens outside this rank's slice look up row 0, then are zeroed.
        outside = (input_ids < self.shard.start) | (input_ids >= self.shard.end)
        local_ids = (input_ids - self.shard.start).masked_fill(outside, 0)
        embeddings = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0)
        return tensor_model_parallel_all_reduce(embeddings)

    def extra_repr(self) -> str:
        text = f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}"
        if self.tp_size > 1:   # one process holds every row: no shard to speak of (notebook 02)
            text += f", this rank: tokens {self.shard.start}..{self.shard.end}"
        return text


class ParallelLMHead(Linear):
    """``hidden [T, dim] -> logits of this rank's vocabulary slice [T, V_padded / tp]``.

    The same weight shape and slices as ``VocabParallelEmbedding`` (so a tied LM head
    can share the embedding's Parameter). vLLM's ``ParallelLMHead`` subclasses the
    embedding and leaves the matmul to its ``LogitsProcessor``; here it is a ``Linear``
    so that the platform's GEMM runs it like every other projection. ``LogitsProcessor``
    gathers the slices."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        shard = VocabShard.of_this_rank(num_embeddings)
        super().__init__(embedding_dim, shard.num_embeddings_per_partition, bias=False)
        self.shard, self.num_embeddings = shard, num_embeddings
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        self.shard.load(param, loaded_weight)
