"""BlockPool: every KV block, its ref count, the LRU free queue, the prefix cache.

    blocks                [null][ b1 ][ b2 ][ b3 ][ b4 ][ b5 ]      num_blocks = 6
    ref_cnt                 -     2     1     0     0     1
    free_block_queue              head <-> b4 <-> b3 <-> tail    (LRU order)
    cached_block_hash_to_block    (h(b1), group 0) -> {1: b1}
                                  (h(b3), group 0) -> {3: b3}    b3: free but cached

A block is in exactly one of two states: *in use* (ref_cnt > 0, held by one or
more block tables) or *free* (ref_cnt == 0, in the free queue). A free block may
still carry its hash: it is a cached block that a later request can revive with
``touch`` until ``get_new_blocks`` pops it for other tokens ("eviction").

Block 0 is the **null block** (vLLM's ``null_block``): never handed out, never
ref-counted, it fills block-table entries for positions a sliding window has
dropped. So a pool of ``num_blocks`` has ``num_blocks - 1`` usable blocks.

KV cache events (vLLM's ``kv_event_queue``, off by default): with
``enable_kv_cache_events=True`` the pool records every change to the set of cached
hashes, in order, for a router that keeps a copy of it (``take_events`` drains them;
``microvllm/distributed/kv_events.py`` sends them in vLLM's wire format)::

    cache_full_blocks      -> BlockStored(block_hashes=[h2, h3], parent_block_hash=h1, ...)
    get_new_blocks evicts  -> BlockRemoved(block_hashes=[h3])
    reset_prefix_cache     -> AllBlocksCleared()
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from microvllm.core.kv_cache_utils import BlockHash, FreeKVCacheBlockQueue, KVCacheBlock

if TYPE_CHECKING:
    from microvllm.core.request import Request

# The prefix-cache key: the same tokens in two cache groups (say a full-attention
# and a sliding-window layer group) live in two different blocks.
BlockHashWithGroupId = tuple[BlockHash, int]

# vLLM's ``MEDIUM_GPU``: the engine's own KV cache (the tier its attention reads), as
# opposed to an offloading tier ("CPU"). Routers compare it by name, so the pool says
# "GPU" on every device, as vLLM's does.
MEDIUM_GPU = "GPU"


# The events, as plain records (core stays free of msgspec); vLLM's names and fields.
@dataclass(frozen=True)
class BlockStored:
    """Full blocks entered the prefix cache: ``block_hashes`` chain on from
    ``parent_block_hash`` (None: they start the sequence) and hold ``token_ids``."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    group_idx: int = 0            # the cache group (BlockHashWithGroupId's second half)
    lora_name: str | None = None  # the adapter the blocks were computed under (None: the base model)


@dataclass(frozen=True)
class BlockRemoved:
    """Cached blocks were evicted: no later request can hit them."""

    block_hashes: list[BlockHash]
    medium: str | None = MEDIUM_GPU
    group_idx: int = 0


@dataclass(frozen=True)
class AllBlocksCleared:
    """Every hash was forgotten (``reset_prefix_cache``)."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class BlockPool:
    """Owns all ``KVCacheBlock`` objects of one KV cache, shared by all cache groups."""

    def __init__(self, num_blocks: int, enable_caching: bool = True,
                 enable_kv_cache_events: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks is {num_blocks}: a pool needs at least 1 block (the null block)")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks: list[KVCacheBlock] = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # Two blocks can hold the same content (two requests filled the same
        # block at the same time), hence a dict of blocks per hash.
        self.cached_block_hash_to_block: dict[BlockHashWithGroupId, dict[int, KVCacheBlock]] = {}
        # Block 0 leaves the free queue for good.
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        # Changes to the cached hashes since the last take_events(); only when enabled.
        self.enable_kv_cache_events = enable_kv_cache_events
        self.kv_event_queue: list[KVCacheEvent] = []

    @property
    def num_usable_blocks(self) -> int:
        """Blocks a request can ever get: all but the null block."""
        return self.num_blocks - 1

    # ------------------------------------------------------------------ lookup

    def get_cached_block(self, block_hash: BlockHash, kv_cache_group_id: int = 0) -> KVCacheBlock | None:
        """A block holding this content for this group, or None. O(1)."""
        blocks = self.cached_block_hash_to_block.get((block_hash, kv_cache_group_id))
        if not blocks:
            return None
        return next(iter(blocks.values()))

    # -------------------------------------------------------- hand out / free

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop ``num_blocks`` least recently freed blocks, with ref_cnt 1. O(num_blocks).

        A popped block that still carries a hash is being reused for other
        tokens, so its prefix-cache entry is evicted first.
        """
        ### BEGIN SOLUTION
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(
                f"asked for {num_blocks} blocks but only {self.get_num_free_blocks()} are free: "
                "check get_num_free_blocks() before allocating"
            )
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            self._maybe_evict_cached_block(block)
            block.ref_cnt = 1
        return blocks
        ### END SOLUTION

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; those reaching 0 join the free queue's tail.

        Order matters: blocks appended first are evicted first. The hash is kept
        (the block stays a possible cache hit). A block already at 0 raises
        ValueError before anything changes. O(len(blocks)).
        """
        ### BEGIN SOLUTION
        blocks = [block for block in ordered_blocks if not block.is_null]
        # Check every block first (a block listed twice drops two references): a
        # refused call must leave the pool as it was.
        drops: dict[int, int] = {}
        for block in blocks:
            drops[block.block_id] = drops.get(block.block_id, 0) + 1
            if block.ref_cnt < drops[block.block_id]:
                raise ValueError(
                    f"block {block.block_id} was freed twice: free_blocks() must not be "
                    "given a block whose ref count is already 0"
                )
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)
        ### END SOLUTION

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits. O(len(blocks)).

        A hit that sat free in the queue (ref_cnt 0) is pulled out of it, so
        it can no longer be evicted; the O(1) ``remove`` is what makes this cheap.
        """
        ### BEGIN SOLUTION
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1
        ### END SOLUTION

    # ------------------------------------------------------------ prefix cache

    def cache_full_blocks(
        self,
        request: Request,
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        kv_cache_group_id: int = 0,
    ) -> None:
        """Register ``blocks[num_cached_blocks:num_full_blocks]`` in the prefix cache.

            blocks           [ b5 | b2 | b9 | b4 | b8 ]
                               cached    new full   (not full yet)
                               <-2->     <--2--->
            num_cached_blocks = 2, num_full_blocks = 4: b9, b4 get
            request.block_hashes[2], request.block_hashes[3].

        Null blocks (sliding window) are skipped. O(num_full - num_cached).
        With events on, one ``BlockStored`` names the newly cached blocks, their
        parent (``block_hashes[num_cached_blocks - 1]``) and the tokens of
        ``blocks[num_cached_blocks:num_full_blocks]``, as vLLM's does.
        """
        if not self.enable_caching or num_full_blocks <= num_cached_blocks:
            return
        if num_full_blocks > len(request.block_hashes):
            raise ValueError(
                f"request {request.request_id!r} has {len(request.block_hashes)} block hashes "
                f"but {num_full_blocks} blocks are being cached: a block can only be cached once full"
            )
        new_hashes: list[BlockHash] = []
        for index in range(num_cached_blocks, num_full_blocks):
            block = blocks[index]
            if block.is_null:
                continue
            block_hash = request.block_hashes[index]
            if block.block_hash is not None:
                if block.block_hash != block_hash or block.kv_cache_group_id != kv_cache_group_id:
                    raise ValueError(f"block {block.block_id} is already cached with another hash")
                continue
            block.block_hash = block_hash
            block.kv_cache_group_id = kv_cache_group_id
            key = (block_hash, kv_cache_group_id)
            self.cached_block_hash_to_block.setdefault(key, {})[block.block_id] = block
            new_hashes.append(block_hash)
        if self.enable_kv_cache_events and new_hashes:
            block_size = request.block_size
            self.kv_event_queue.append(BlockStored(
                block_hashes=new_hashes,
                parent_block_hash=request.block_hashes[num_cached_blocks - 1] if num_cached_blocks else None,
                token_ids=request.all_token_ids[num_cached_blocks * block_size:num_full_blocks * block_size],
                block_size=block_size,
                group_idx=kv_cache_group_id,
                lora_id=getattr(request, "lora_int_id", 0) or None,
                lora_name=getattr(request, "lora_name", None),
            ))

    def evict_cached_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Forget the hashes of ``blocks``: no later request may hit them. O(len(blocks))."""
        for block in blocks:
            if not block.is_null:
                self._maybe_evict_cached_block(block)

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        """Forget ``block``'s hash (it is about to hold other tokens). O(1)."""
        if block.block_hash is None:
            return False
        key = (block.block_hash, block.kv_cache_group_id)
        same_hash = self.cached_block_hash_to_block.get(key)
        if same_hash is not None:
            removed = same_hash.pop(block.block_id, None)
            if not same_hash:
                del self.cached_block_hash_to_block[key]
            if removed is not None and self.enable_kv_cache_events:
                self.kv_event_queue.append(BlockRemoved(block_hashes=[block.block_hash],
                                                        group_idx=block.kv_cache_group_id))
        block.block_hash = None
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every hash, only when no block is in use. O(num_blocks).

        Returns False (and changes nothing) while any request holds blocks:
        their hashes would go stale under them.
        """
        if self.get_num_free_blocks() != self.num_usable_blocks:
            return False
        self.cached_block_hash_to_block = {}
        for block in self.blocks:
            block.block_hash = None
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVCacheEvent]:
        """The events recorded since the last call, oldest first; the queue is left
        empty (vLLM's name). Always [] with events off. O(events)."""
        if not self.kv_event_queue:
            return []
        events, self.kv_event_queue = self.kv_event_queue, []
        return events

    # ------------------------------------------------------------------ usage

    def get_num_free_blocks(self) -> int:
        """Free blocks, cached or not (cached free blocks can be evicted). O(1)."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable blocks in use, 0.0 .. 1.0. O(1)."""
        if self.num_usable_blocks == 0:
            return 0.0
        return 1.0 - self.get_num_free_blocks() / self.num_usable_blocks
