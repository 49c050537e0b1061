"""The rules the block pool's accounting must always obey, checked in O(blocks).

    every usable block is in exactly one state:
        free   ref_cnt == 0, linked in the free queue   (maybe still cached)
        used   ref_cnt == #block-table entries holding it > 0
    hash table -> only blocks whose block_hash is that key (and vice versa)
    free + used == num_blocks - 1     (block 0 is the null block, in neither)

Tests and learners' exercises call this after every operation; each message
says what went wrong in terms of the data, so it can be traced to the bug.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from microvllm.core.block_pool import BlockPool
from microvllm.core.kv_cache_utils import KVCacheBlock


class InvariantError(AssertionError):
    """The KV cache (or scheduler) bookkeeping is inconsistent."""


def check_free_queue_links(block_pool: BlockPool) -> set[int]:
    """Walk the free queue head to tail; return the ids of the blocks in it."""
    queue = block_pool.free_block_queue
    seen: set[int] = set()
    node = queue.fake_free_list_head
    while node.next_free_block is not None:
        nxt = node.next_free_block
        if nxt.prev_free_block is not node:
            raise InvariantError(
                f"free queue is broken between block {node.block_id} and block {nxt.block_id}: "
                "next.prev must point back to the block itself"
            )
        if nxt is queue.fake_free_list_tail:
            break
        if nxt.block_id in seen:
            raise InvariantError(f"free queue has a cycle: block {nxt.block_id} appears twice")
        if len(seen) > len(block_pool.blocks):
            raise InvariantError("free queue is longer than the pool: its links form a cycle")
        seen.add(nxt.block_id)
        node = nxt
    else:
        raise InvariantError("free queue does not end at its tail sentinel: a next link is None")
    if len(seen) != queue.num_free_blocks:
        raise InvariantError(
            f"free queue holds {len(seen)} blocks but its counter num_free_blocks says "
            f"{queue.num_free_blocks}: append/remove must keep the counter in step"
        )
    return seen


def check_block_pool_invariants(block_pool: BlockPool) -> None:
    """The rules the pool keeps on its own, without the block tables (so they hold between
    any two pool calls, even half-way through a KV cache manager operation): the free
    queue is well linked, ref counts are >= 0, ref_cnt == 0 exactly for queued blocks,
    and the hash table matches the blocks' hashes. O(blocks)."""
    free_ids = _free_ids(block_pool)
    for block in block_pool.blocks:
        if not block.is_null:
            _check_ref_cnt_sign(block)
            _check_queued_iff_free(block, block.block_id in free_ids)
    _check_hash_table(block_pool)


def check_kv_cache_invariants(block_pool: BlockPool, block_tables: Iterable[Iterable[KVCacheBlock | int]]) -> None:
    """Check the pool against all block tables (each a list of blocks or block ids)."""
    holders: Counter[int] = Counter()
    for table in block_tables:
        for entry in table:
            holders[entry if isinstance(entry, int) else entry.block_id] += 1
    free_ids = _free_ids(block_pool)

    num_used = 0
    for block in block_pool.blocks:
        if block.is_null:
            continue
        bid, count = block.block_id, holders[block.block_id]
        _check_ref_cnt_sign(block)
        if block.ref_cnt != count:
            raise InvariantError(
                f"block {bid} has ref_cnt {block.ref_cnt} but appears in {count} block table(s): "
                "every table entry must hold exactly one reference"
            )
        _check_queued_iff_free(block, bid in free_ids)
        num_used += block.ref_cnt > 0

    if len(free_ids) + num_used != block_pool.num_usable_blocks:
        raise InvariantError(
            f"{len(free_ids)} free + {num_used} used blocks != {block_pool.num_usable_blocks} usable blocks"
        )
    _check_hash_table(block_pool)


def _free_ids(block_pool: BlockPool) -> set[int]:
    """The ids in the free queue (its links checked); the null block must not be one."""
    free_ids = check_free_queue_links(block_pool)
    null_id = block_pool.null_block.block_id
    if null_id in free_ids:
        raise InvariantError(f"the null block {null_id} is in the free queue: it must never be handed out")
    return free_ids


def _check_ref_cnt_sign(block: KVCacheBlock) -> None:
    if block.ref_cnt < 0:
        raise InvariantError(f"block {block.block_id} has negative ref_cnt {block.ref_cnt}: it was freed too often")


def _check_queued_iff_free(block: KVCacheBlock, in_queue: bool) -> None:
    """A block is in the free queue exactly when nobody holds it (ref_cnt 0)."""
    if block.ref_cnt == 0 and not in_queue:
        raise InvariantError(f"block {block.block_id} has ref_cnt 0 but is not in the free queue: it leaked")
    if block.ref_cnt > 0 and in_queue:
        raise InvariantError(
            f"block {block.block_id} has ref_cnt {block.ref_cnt} but is also in the free queue: "
            "a used block could be handed to another request"
        )


def _check_hash_table(block_pool: BlockPool) -> None:
    num_in_table = 0
    for (block_hash, group_id), blocks in block_pool.cached_block_hash_to_block.items():
        if not blocks:
            raise InvariantError(f"hash {block_hash!r} maps to no block: empty entries must be deleted")
        for block_id, block in blocks.items():
            if block is not block_pool.blocks[block_id]:
                raise InvariantError(f"hash table entry {block_id} is not the pool's block {block_id}")
            if block.block_hash != block_hash or block.kv_cache_group_id != group_id:
                raise InvariantError(
                    f"hash {block_hash!r} (group {group_id}) maps to block {block_id}, whose hash is "
                    f"{block.block_hash!r} (group {block.kv_cache_group_id}): evict the entry when a block is reused"
                )
            num_in_table += 1
    num_hashed = sum(1 for block in block_pool.blocks if block.block_hash is not None)
    if num_hashed != num_in_table:
        raise InvariantError(
            f"{num_hashed} blocks carry a hash but the hash table holds {num_in_table}: "
            "a block's hash and its table entry must be set and removed together"
        )
    if block_pool.null_block.block_hash is not None:
        raise InvariantError("the null block has a hash: null blocks must never be cached")
