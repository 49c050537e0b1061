"""One cache group's block tables: FullAttentionManager and SlidingWindowManager.

Each request has one block table per cache group: a list of blocks, one per
``block_size`` tokens. Entry i holds the KV of positions i*B .. i*B+B-1.

    full attention     req "a": [ b3 | b8 | b1 | b6 ]        every block kept
    sliding window     req "a": [null|null| b1 | b6 ]        W = 6, B = 4, 14 tokens computed:
                                                            positions < 14-6+1 = 9 are never
                                                            read again, blocks 0..1 released

The two managers differ in only two places:
- ``find_longest_cache_hit``: which cached prefix is usable;
- ``remove_skipped_blocks``: which blocks can be released early.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from microvllm.core.block_pool import BlockPool
from microvllm.core.kv_cache_spec import FullAttentionSpec, KVCacheSpec, MambaSpec, SlidingWindowSpec
from microvllm.core.kv_cache_utils import BlockHash, KVCacheBlock, cdiv

if TYPE_CHECKING:
    from microvllm.core.request import Request


class SingleTypeKVCacheManager:
    """Block tables of one cache group; blocks come from the shared BlockPool."""

    def __init__(self, kv_cache_spec: KVCacheSpec, block_pool: BlockPool, kv_cache_group_id: int) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.block_size = kv_cache_spec.block_size
        self.block_pool = block_pool
        self.kv_cache_group_id = kv_cache_group_id
        self._null_block = block_pool.null_block
        # request id -> its block table for this group
        self.req_to_blocks: defaultdict[str, list[KVCacheBlock]] = defaultdict(list)
        # request id -> how many of its leading blocks are registered in the
        # prefix cache (so each full block is hashed into the table only once)
        self.num_cached_block: dict[str, int] = {}

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> int:
        """Free blocks needed so the request's table covers ``num_tokens``. O(hit blocks).

        New blocks, plus hit blocks that sit in the free queue: touching those
        takes them out of it, so they also use up free blocks.
        """
        num_required = cdiv(num_tokens, self.block_size)
        num_new = num_required - len(new_computed_blocks) - len(self.req_to_blocks.get(request_id, ()))
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and not b.is_null)
        return max(num_new, 0) + num_evictable_hits

    def save_new_computed_blocks(self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock]) -> None:
        """Put the prefix-cache hits at the start of a new request's table. O(hit blocks)."""
        if request_id not in self.num_cached_block:
            # A new request: its hits are already cached, by definition.
            self.req_to_blocks[request_id].extend(new_computed_blocks)
            self.num_cached_block[request_id] = len(new_computed_blocks)
        elif new_computed_blocks:
            raise ValueError(f"request {request_id!r} is running: it cannot get new prefix-cache hits")

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Grow the table to cover ``num_tokens``; return only the new blocks. O(new blocks)."""
        req_blocks = self.req_to_blocks[request_id]
        num_new = cdiv(num_tokens, self.block_size) - len(req_blocks)
        if num_new <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new)
        req_blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the blocks that ``num_tokens`` fill, if not yet cached. O(newly full blocks)."""
        num_cached = self.num_cached_block.get(request.request_id, 0)
        num_full = num_tokens // self.block_size
        if num_full <= num_cached:
            return
        self.block_pool.cache_full_blocks(
            request, self.req_to_blocks[request.request_id], num_cached, num_full, self.kv_cache_group_id
        )
        self.num_cached_block[request.request_id] = num_full

    def free(self, request_id: str) -> None:
        """Release the whole table, last block first. O(blocks of the request).

        Reverse order: the tail (least likely shared) reaches the free queue
        first and is therefore evicted first.
        """
        req_blocks = self.req_to_blocks.pop(request_id, [])
        self.block_pool.free_blocks(reversed(req_blocks))
        self.num_cached_block.pop(request_id, None)

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_length: int) -> list[KVCacheBlock]:
        """The longest usable cached prefix of at most ``max_length`` tokens, as blocks."""
        raise NotImplementedError

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Release blocks no future token will read. No-op unless overridden."""


class FullAttentionManager(SingleTypeKVCacheManager):
    """Every block is needed by every later token."""

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_length: int) -> list[KVCacheBlock]:
        """Cached blocks from the start, stopping at the first miss. O(hit blocks).

            block_hashes  h0  h1  h2  h3
            in cache?     yes yes no  yes    -> hit [b(h0), b(h1)]: h3 is useless
                                                without the KV of h2 before it
        """
        hit: list[KVCacheBlock] = []
        for block_hash in block_hashes[: max_length // self.block_size]:
            block = self.block_pool.get_cached_block(block_hash, self.kv_cache_group_id)
            if block is None:
                break
            hit.append(block)
        return hit


class SlidingWindowManager(SingleTypeKVCacheManager):
    """A token at position p reads keys p-W+1 .. p only, so older blocks can go."""

    kv_cache_spec: SlidingWindowSpec

    def __init__(self, kv_cache_spec: SlidingWindowSpec, block_pool: BlockPool, kv_cache_group_id: int) -> None:
        super().__init__(kv_cache_spec, block_pool, kv_cache_group_id)
        self.sliding_window = kv_cache_spec.sliding_window

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_length: int) -> list[KVCacheBlock]:
        """The longest hit whose *last* ``cdiv(W-1, B)`` blocks are cached. O(blocks scanned).

        A hit of h blocks means the next token computed sits at position h*B;
        it reads keys h*B-W+1 .. h*B, the last being itself. So only the W-1
        keys before it must be cached: the last cdiv(W-1, B) blocks of the
        hit. Earlier blocks are never read again and become null blocks.

            W = 5, B = 4 -> the last cdiv(4, 4) = 1 block must be cached
            block_hashes  h0  h1  h2  h3  h4
            in cache?     no  yes no  yes no     (scan right to left)
            hit           [null, null, null, b(h3)]   4 blocks, 16 tokens

        Scans from the right and stops at the first run that is long enough.
        """
        max_num_blocks = max_length // self.block_size
        needed = cdiv(self.sliding_window - 1, self.block_size)
        hit: list[KVCacheBlock] = [self._null_block] * max_num_blocks
        hit_end = max_num_blocks  # blocks hit_end-1, hit_end-2, ... are being checked
        for index in range(max_num_blocks - 1, -1, -1):
            if hit_end - (index + 1) >= needed:
                break  # blocks index+1 .. hit_end-1 are cached: enough
            block = self.block_pool.get_cached_block(block_hashes[index], self.kv_cache_group_id)
            if block is None:
                hit_end = index  # a hit cannot reach past a missing block
            else:
                hit[index] = block
        # Either a long-enough run was found, or the scan reached block 0 and
        # blocks 0 .. hit_end-1 are all cached.
        return hit[:hit_end]

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Swap blocks wholly before the window for the null block and free them.

        Computing tokens from position ``num_computed_tokens`` on, the first
        key still needed is at ``num_computed_tokens - W + 1``:

            W = 6, B = 4, num_computed_tokens = 14: first needed position 9
            positions  0-3   4-7   8-11  12-15
            table     [ b3 | b8 | b1  | b6 ]  ->  [null|null| b1 | b6 ]
                      freed: b8, then b3 (tail first, as in free())

        Stops at the first null walking left: everything before it is null.
        O(blocks released).
        """
        num_skipped_blocks = self.kv_cache_spec.num_skipped_blocks(num_computed_tokens)
        req_blocks = self.req_to_blocks.get(request_id)
        if not req_blocks:
            return
        removed = []
        for index in range(min(num_skipped_blocks, len(req_blocks)) - 1, -1, -1):
            if req_blocks[index].is_null:
                break
            removed.append(req_blocks[index])
            req_blocks[index] = self._null_block
        self.block_pool.free_blocks(removed)


spec_manager_map: dict[type[KVCacheSpec], type[SingleTypeKVCacheManager]] = {
    FullAttentionSpec: FullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
}


def get_manager_for_kv_cache_spec(
    kv_cache_spec: KVCacheSpec, block_pool: BlockPool, kv_cache_group_id: int
) -> SingleTypeKVCacheManager:
    """The manager class that matches the spec's type."""
    manager_class = spec_manager_map.get(type(kv_cache_spec))
    if manager_class is None:
        raise ValueError(f"no KV cache manager for {type(kv_cache_spec).__name__}")
    return manager_class(kv_cache_spec, block_pool, kv_cache_group_id)


class MambaManager(SlidingWindowManager):
    """The state group (``MambaSpec``): a sliding window of 2 over state pages.

    - the page of block (c-1)//B holds the state after c tokens: the one the next step
      reads (``remove_skipped_blocks`` releases every page before it);
    - a hit needs only the snapshot at the hit's end, the last entry (the window's
      ``cdiv(W-1, B) = 1`` block), everything before it null: SlidingWindowManager's search;
    - a page is registered only once its state is **computed**, at the request's next
      allocation (before older pages go) or when it is freed: attention registers a block
      when it is scheduled, as its KV is written before any layer reads it, but a state
      page of this step could be read by a request admitted after it in the same step.

    Preemption drops the pages; the request is recomputed from its first token (or from a
    snapshot, as any new request)."""

    kv_cache_spec: MambaSpec  # type: ignore[assignment]

    def __init__(self, kv_cache_spec: MambaSpec, block_pool: BlockPool, kv_cache_group_id: int) -> None:
        SingleTypeKVCacheManager.__init__(self, kv_cache_spec, block_pool, kv_cache_group_id)
        self.sliding_window = 2
        self.prefix_caching = kv_cache_spec.prefix_caching

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the snapshots of full blocks whose state is computed (not ``num_tokens``,
        which counts this step's tokens too)."""
        if self.prefix_caching:
            super().cache_blocks(request, min(num_tokens, request.num_computed_tokens))

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_length: int) -> list[KVCacheBlock]:
        """The longest prefix whose end has a cached snapshot: ``[null, .., null, snapshot]``."""
        if not self.prefix_caching:
            return []
        return super().find_longest_cache_hit(block_hashes, max_length)


spec_manager_map[MambaSpec] = MambaManager
