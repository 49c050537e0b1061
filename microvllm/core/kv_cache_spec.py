"""What kind of KV cache a group of attention layers needs.

A model's layers are sorted into *cache groups* by how much of the past their
attention reads. Each group gets its own block table per request (and its own
single-type manager), all drawing blocks from one shared BlockPool.

    model                             kv_cache_groups
    Llama, Qwen3 (no window)          [FullAttentionSpec(16)]
    Mistral with sliding_window=4096  [SlidingWindowSpec(16, 4096)]
    a mixed model                     [FullAttentionSpec(16), SlidingWindowSpec(16, 4096)]

Sliding window semantics (Hugging Face Mistral, ``kv_idx > q_idx - sliding_window``):

    position     0  1  2  3  4  5  6  7  8         sliding_window W = 4
    query at 7 sees keys           4  5  6  7      p-W+1 .. p
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from microvllm.core.kv_cache_utils import cdiv


@dataclass(frozen=True)
class KVCacheSpec:
    """Base class: every group stores ``block_size`` tokens per block. ``kind`` names the
    spec's class wherever a name is needed (the trace, the widgets)."""

    kind: ClassVar[str] = ""
    block_size: int

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size is {self.block_size}: it must be at least 1")

    def max_blocks_held(self, num_tokens: int) -> int:
        """The most blocks one request of ``num_tokens`` tokens keeps at once, when
        computed one token at a time (the least a pool must have to serve it)."""
        raise NotImplementedError

    def num_blocks_needed(self, num_computed_tokens: int, num_new_tokens: int) -> int:
        """Blocks a request holds once slots for ``num_new_tokens`` more are allocated."""
        raise NotImplementedError

    def num_table_entries(self, num_tokens: int) -> int:
        """Entries a block table of ``num_tokens`` computed tokens has (null ones included)."""
        return cdiv(num_tokens, self.block_size)


@dataclass(frozen=True)
class FullAttentionSpec(KVCacheSpec):
    """Every token attends to every earlier token: all blocks stay until the end."""

    kind: ClassVar[str] = "full_attention"

    def max_blocks_held(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def num_blocks_needed(self, num_computed_tokens: int, num_new_tokens: int) -> int:
        return cdiv(num_computed_tokens + num_new_tokens, self.block_size)


@dataclass(frozen=True)
class SlidingWindowSpec(KVCacheSpec):
    """A token at position p attends to positions p-W+1 .. p only (W = sliding_window)."""

    kind: ClassVar[str] = "sliding_window"
    sliding_window: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window is {self.sliding_window}: it must be at least 1")

    def max_blocks_held(self, num_tokens: int) -> int:
        # The W-1 earlier keys span at most cdiv(W-1, block_size) blocks, plus
        # the block of the token being computed.
        return min(cdiv(num_tokens, self.block_size), cdiv(self.sliding_window - 1, self.block_size) + 1)

    def num_skipped_blocks(self, num_computed_tokens: int) -> int:
        """Leading blocks no token from ``num_computed_tokens`` on will read."""
        first_needed_position = num_computed_tokens - self.sliding_window + 1
        return max(first_needed_position, 0) // self.block_size

    def num_blocks_needed(self, num_computed_tokens: int, num_new_tokens: int) -> int:
        total = cdiv(num_computed_tokens + num_new_tokens, self.block_size)
        return total - self.num_skipped_blocks(num_computed_tokens)


def attention_spec(block_size: int, sliding_window: int | None) -> KVCacheSpec:
    """The spec of an attention layer that reads a window of ``sliding_window`` tokens (None:
    all of them), in blocks of ``block_size`` (vLLM: ``Attention.get_kv_cache_spec``)."""
    if sliding_window:
        return SlidingWindowSpec(block_size, sliding_window)
    return FullAttentionSpec(block_size)


@dataclass(frozen=True)
class MambaSpec(KVCacheSpec):
    """A layer whose memory of the past is a **state** of constant size (a linear-attention
    or Mamba layer: Qwen3.5's Gated DeltaNet; vLLM: ``MambaSpec``), not one key and value
    per token. Its group's block table holds one page per request, the live state, from the
    first token to the last: the pool's block size is the attention groups' (so the worker
    pads a page to one size for every group), but this group never needs a second page::

        tokens computed     0      5      12     40
        attention table     [b3]   [b3 b8] [b3 b8 b1] ...
        state table         [b9]   [b9]   [b9]   [b9]      b9: conv + recurrent state

    No prefix-cache hits: a state is the summary of every token before it, so a page can
    be reused only for the exact prefix it summarises at exactly its length (snapshots at
    block boundaries: not yet). A hybrid's hit is the shortest over its groups, so 0."""

    kind: ClassVar[str] = "mamba"

    def max_blocks_held(self, num_tokens: int) -> int:
        return 1

    def num_blocks_needed(self, num_computed_tokens: int, num_new_tokens: int) -> int:
        return 1

    def num_table_entries(self, num_tokens: int) -> int:
        return 1 if num_tokens else 0
