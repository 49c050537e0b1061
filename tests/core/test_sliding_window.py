"""Sliding-window groups: releasing out-of-window blocks, window-aware hits, hybrid models."""

import pytest

from microvllm.core import FullAttentionSpec, KVCacheManager, SlidingWindowSpec
from tests.core.core_helpers import ShadowKVCache, make_request

B = 4


def test_remove_skipped_blocks_swaps_in_null_and_frees_tail_first():
    kv = KVCacheManager([SlidingWindowSpec(B, 6)], 16, B)
    r = make_request("a", list(range(14)), B)
    kv.allocate_slots(r, 14)
    r.num_computed_tokens = 14
    assert kv.get_block_ids("a") == ([1, 2, 3, 4],)
    manager = kv.single_type_managers[0]
    manager.remove_skipped_blocks("a", 14)  # first needed position: 14 - 6 + 1 = 9 -> blocks 0, 1 go
    assert kv.get_block_ids("a") == ([0, 0, 3, 4],)
    free_ids = [b.block_id for b in kv.block_pool.free_block_queue.get_all_free_blocks()]
    assert free_ids[-2:] == [2, 1]
    kv.check_invariants()
    manager.remove_skipped_blocks("a", 14)  # idempotent
    assert kv.get_block_ids("a") == ([0, 0, 3, 4],)


@pytest.mark.parametrize("num_computed, expected", [
    (8, [1, 2, 3, 4]),   # first needed position 1: block 0 is still read
    (10, [1, 2, 3, 4]),  # first needed 3: the query at 10 reads key 3, in block 0
    (11, [0, 2, 3, 4]),  # first needed 4: block 0 (positions 0-3) is never read again
    (15, [0, 0, 3, 4]),  # first needed 8
])
def test_blocks_needed_this_step_stay(num_computed, expected):
    """Computing from position c reads keys back to c - W + 1: their blocks must stay."""
    kv = KVCacheManager([SlidingWindowSpec(B, 8)], 16, B)
    r = make_request("a", list(range(16)), B)
    kv.allocate_slots(r, 16)
    kv.single_type_managers[0].remove_skipped_blocks("a", num_computed)
    assert kv.get_block_ids("a") == (expected,)
    kv.check_invariants()


def test_allocate_slots_releases_before_allocating():
    kv = KVCacheManager([SlidingWindowSpec(B, 4)], 4, B)  # 3 usable blocks
    r = make_request("a", list(range(12)), B)
    for step in range(12):  # one token at a time, as decoding does
        assert kv.allocate_slots(r, 1) is not None, step
        r.num_computed_tokens += 1
        kv.check_invariants()
    # A full-attention group would need 3 blocks, then a 4th: the window keeps it at 2.
    assert kv.get_block_ids("a") == ([0, 0, 3],)
    assert kv.block_pool.get_num_free_blocks() == 2


def test_window_respecting_hit():
    W = 5  # the last cdiv(W-1, B) = 1 block before the hit point must be cached
    kv = KVCacheManager([SlidingWindowSpec(B, W)], 32, B)
    a = make_request("a", list(range(20)), B)
    kv.allocate_slots(a, 20)
    a.num_computed_tokens = 20
    kv.free(a)
    pool = kv.block_pool
    # Evict blocks 0, 2 and 4 of a's prefix: hashes h1 and h3 stay.
    for index in (0, 2, 4):
        pool._maybe_evict_cached_block(pool.get_cached_block(a.block_hashes[index]))
    b = make_request("b", list(range(20)) + [7], B)
    blocks, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 16  # hit ends after h3; blocks 0..2 may be null
    assert [blk.block_hash for blk in blocks.blocks[0][3:]] == [a.block_hashes[3]]
    assert all(blk.is_null for blk in blocks.blocks[0][:3])
    kv.allocate_slots(b, b.num_tokens - num_hit, num_hit, blocks)
    kv.check_invariants()


def test_window_hit_needs_a_long_enough_run():
    W = 9  # needs cdiv(8, 4) = 2 cached blocks before the hit point
    kv = KVCacheManager([SlidingWindowSpec(B, W)], 32, B)
    a = make_request("a", list(range(24)), B)
    kv.allocate_slots(a, 24)
    kv.free(a)
    pool = kv.block_pool
    for index in (2, 4):  # cached: 0 1 _ 3 _ 5
        pool._maybe_evict_cached_block(pool.get_cached_block(a.block_hashes[index]))
    b = make_request("b", list(range(24)) + [1], B)
    blocks, num_hit = kv.get_computed_blocks(b)
    # Runs of one (block 5, block 3) are too short; blocks 0,1 from the start are enough.
    assert num_hit == 8 and not any(blk.is_null for blk in blocks.blocks[0])


def test_window_of_one_needs_no_earlier_keys():
    kv = KVCacheManager([SlidingWindowSpec(B, 1)], 8, B)
    r = make_request("a", list(range(9)), B)
    blocks, num_hit = kv.get_computed_blocks(r)
    assert num_hit == 8 and all(blk.is_null for blk in blocks.blocks[0])
    assert kv.allocate_slots(r, 1, num_hit, blocks).get_block_ids() == ([1],)
    kv.check_invariants()


def test_hybrid_groups_agree_on_the_shortest_hit():
    groups = [FullAttentionSpec(B), SlidingWindowSpec(B, 5)]
    kv = KVCacheManager(groups, 64, B)
    a = make_request("a", list(range(20)), B)
    kv.allocate_slots(a, 20)
    a.num_computed_tokens = 20
    kv.free(a)
    pool = kv.block_pool
    # Full-attention group: all 5 blocks cached. Sliding group: block 3 evicted.
    pool._maybe_evict_cached_block(pool.get_cached_block(a.block_hashes[3], 1))
    b = make_request("b", list(range(20)) + [1], B)
    blocks, num_hit = kv.get_computed_blocks(b)
    # The sliding group needs only block 4 before position 20 (cdiv(W-1, B) = 1 block).
    assert num_hit == 20 and [blk.is_null for blk in blocks.blocks[1]] == [True] * 4 + [False]
    assert [len(g) for g in blocks.blocks] == [5, 5]
    pool._maybe_evict_cached_block(pool.get_cached_block(a.block_hashes[4], 0))  # full group stops at 16
    blocks, num_hit = kv.get_computed_blocks(b)
    # At 16 the sliding group needs block 3, which is gone; it falls back to 12 (block 2),
    # and the full group is trimmed to match.
    assert num_hit == 12 and [len(g) for g in blocks.blocks] == [3, 3]
    kv.allocate_slots(b, b.num_tokens - num_hit, num_hit, blocks)
    b.num_computed_tokens = b.num_tokens
    kv.check_invariants()


def test_shadow_reads_after_sliding_hit():
    """End to end: every key read after a window hit holds the right token."""
    W = 6
    groups = [SlidingWindowSpec(B, W)]
    kv = KVCacheManager(groups, 32, B)
    shadow = ShadowKVCache(B)
    a = make_request("a", list(range(30)), B)
    kv.allocate_slots(a, 30)
    shadow.compute(groups, kv.get_block_ids("a"), a.all_token_ids, 0, 30, "a")
    kv.free(a)
    b = make_request("b", list(range(30)) + [5, 6], B)
    blocks, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 28
    kv.allocate_slots(b, b.num_tokens - num_hit, num_hit, blocks)
    shadow.compute(groups, kv.get_block_ids("b"), b.all_token_ids, num_hit, b.num_tokens - num_hit, "b")
    kv.check_invariants()
