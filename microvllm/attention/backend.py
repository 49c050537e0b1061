"""The interface every attention backend implements.

The model never knows which backend runs: its ``Attention`` layer calls
``backend.write_kv`` then ``backend.forward`` with explicit metadata (no global
"current context"). Backends are chosen by name (``attention/selector.py``), e.g.
``attention_backend="torch"``; the default ``"auto"`` is the platform's choice.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from microvllm.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    """Paged attention over ``kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]``."""

    name: str = "abstract"

    @abstractmethod
    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """Store this step's keys/values (``[num_tokens, num_kv_heads, head_dim]``)
        into the cache at ``slot_mapping`` (vLLM: ``reshape_and_cache``)."""

    @abstractmethod
    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
                *, scale: float, sliding_window: int | None = None) -> torch.Tensor:
        """Attend ``query [num_tokens, num_heads, head_dim]`` over each request's cached
        context (which already holds this step's keys) and return ``[num_tokens,
        num_heads, head_dim]``. Query heads are grouped onto KV heads
        (``num_heads // num_kv_heads`` per KV head: GQA; 1 KV head: MQA). With
        ``sliding_window=W`` a query at position ``p`` sees keys at ``p-W+1 .. p``."""
