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
    per token. Each request's state group has a block table like attention's, one entry per
    ``block_size`` tokens, but entry i holds one *page*: the state after the tokens up to
    the end of block i (a **snapshot** once the block is full; the live state while it is
    being filled). Computing tokens c .. c+n-1 reads the state of page (c-1)//B and writes
    one page per block boundary it crosses plus the page of its last token::

        B = 4, 10 tokens computed, then 3 more (tokens 10, 11, 12)
        entry        0        1        2          3
        state of   t0..t3   t0..t7   t0..t11    t0..t12
        before     [null  |  null  |  p5 (live: t0..t9)]
        after      [null  |  null  |  p5 (snapshot) | p2 (live)]     reads p5, writes p5, p2

    So a request holds one page, two when its next token starts a block: a sliding window
    of 2 (the state after c tokens sits with position c-1). Older pages are released but
    keep their hash (``prefix_caching``, vLLM's former ``mamba_cache_mode="all"``): free yet
    cached, like any evictable block, a later request sharing those tokens resumes from
    the snapshot. Without them (``"none"``) a hybrid's prefix hit is always 0: the state
    of a prefix exists nowhere, and every group must be able to resume for a hit.

    Snapshots per request: one per full block of its tokens and per state group, a page
    each (the bytes of one attention block, the page size being shared). A request *holds*
    only one or two pages per state group; its older snapshots are free pages that keep
    their hash, evicted LRU like any cached block, so they cost nothing the pool's free
    pages would not hold anyway. A prefill chunk writes a page per block it crosses: those
    are held until its next step."""

    kind: ClassVar[str] = "mamba"
    prefix_caching: bool = True

    def num_skipped_blocks(self, num_computed_tokens: int) -> int:
        """Leading entries no step from ``num_computed_tokens`` on will read."""
        return max(num_computed_tokens - 1, 0) // self.block_size

    def max_blocks_held(self, num_tokens: int) -> int:
        return min(cdiv(num_tokens, self.block_size), 2)

    def num_blocks_needed(self, num_computed_tokens: int, num_new_tokens: int) -> int:
        total = cdiv(num_computed_tokens + num_new_tokens, self.block_size)
        return total - self.num_skipped_blocks(num_computed_tokens)
