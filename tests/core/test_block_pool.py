"""BlockPool: hand out, free, LRU eviction, touch, the hash table, reset, usage."""

import pytest

from microvllm.core.block_pool import BlockPool
from microvllm.core.kv_cache_invariants import InvariantError, check_kv_cache_invariants
from microvllm.core.kv_cache_utils import hash_block_tokens
from tests.core.core_helpers import make_request


def ids(blocks):
    return [b.block_id for b in blocks]


def check(pool, *tables):
    check_kv_cache_invariants(pool, tables)


def cache_blocks_for(pool, blocks, tokens, block_size=2):
    """Register ``blocks`` as holding ``tokens`` (a full-block multiple)."""
    request = make_request("r", tokens, block_size)
    pool.cache_full_blocks(request, blocks, 0, len(tokens) // block_size)
    return request


def test_null_block_is_reserved():
    pool = BlockPool(5)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.num_usable_blocks == 4 and pool.get_num_free_blocks() == 4
    assert 0 not in ids(pool.get_new_blocks(4))
    with pytest.raises(ValueError, match="only 0 are free"):
        pool.get_new_blocks(1)
    assert BlockPool(1).num_usable_blocks == 0
    with pytest.raises(ValueError):
        BlockPool(0)


def test_get_new_and_free_blocks_ref_counts():
    pool = BlockPool(6)
    a = pool.get_new_blocks(2)
    assert [b.ref_cnt for b in a] == [1, 1] and pool.get_num_free_blocks() == 3
    assert pool.get_usage() == pytest.approx(2 / 5)
    check(pool, a)
    pool.free_blocks(a)
    assert [b.ref_cnt for b in a] == [0, 0] and pool.get_num_free_blocks() == 5
    assert pool.get_usage() == 0.0
    check(pool)
    with pytest.raises(ValueError, match="freed twice"):
        pool.free_blocks(a[:1])


def test_a_refused_free_blocks_changes_nothing():
    pool = BlockPool(6)
    a = pool.get_new_blocks(3)  # 1, 2, 3
    pool.touch(a[1:2])  # block 2 shared: ref_cnt 2
    pool.free_blocks(a[2:])  # block 3 free
    queue_before = ids(pool.free_block_queue.get_all_free_blocks())
    with pytest.raises(ValueError, match="block 3 was freed twice"):
        pool.free_blocks(a)  # 1 and 2 are fine, 3 is already at 0: checked before anything changes
    assert [b.ref_cnt for b in a] == [1, 2, 0]
    assert ids(pool.free_block_queue.get_all_free_blocks()) == queue_before
    check(pool, a[:2], a[1:2])
    with pytest.raises(ValueError, match="block 1 was freed twice"):
        pool.free_blocks([a[0], a[0]])  # listed twice: two references, it holds one
    assert a[0].ref_cnt == 1
    check(pool, a[:2], a[1:2])


def test_lru_eviction_order_and_hash_eviction():
    pool = BlockPool(5)  # usable blocks 1..4
    a = pool.get_new_blocks(2)  # 1, 2
    b = pool.get_new_blocks(2)  # 3, 4
    cache_blocks_for(pool, a, [7, 7, 8, 8])
    pool.free_blocks(reversed(a))  # tail first: 2 then 1
    pool.free_blocks(b)  # 3 then 4
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [2, 1, 3, 4]
    h0 = hash_block_tokens(None, [7, 7])
    assert pool.get_cached_block(h0) is a[0]  # freed blocks keep their hash
    reused = pool.get_new_blocks(1)
    assert ids(reused) == [2] and reused[0].block_hash is None  # least recently freed goes first
    assert pool.get_cached_block(hash_block_tokens(h0, [8, 8])) is None  # its hash was evicted
    assert pool.get_cached_block(h0) is a[0]
    check(pool, reused)


def test_touch_revives_a_freed_cached_block():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    cache_blocks_for(pool, blocks, [1, 2, 3, 4])
    pool.free_blocks(blocks)
    hit = pool.get_cached_block(hash_block_tokens(None, [1, 2]))
    pool.touch([hit])
    assert hit.ref_cnt == 1 and not hit.is_free and pool.get_num_free_blocks() == 2
    pool.touch([hit])  # a second request shares it
    assert hit.ref_cnt == 2
    check(pool, [hit], [hit])
    assert hit not in pool.get_new_blocks(2)  # a touched block cannot be evicted


def test_cache_full_blocks_only_registers_the_new_range_and_skips_null():
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(3)
    request = make_request("r", [1, 2, 3, 4, 5, 6, 7], 2)  # 3 full blocks of 2
    pool.cache_full_blocks(request, blocks, 0, 1)
    assert blocks[0].block_hash == request.block_hashes[0] and blocks[1].block_hash is None
    pool.cache_full_blocks(request, [pool.null_block, blocks[1], blocks[2]], 1, 3)
    assert [b.block_hash for b in blocks] == request.block_hashes[:3]
    assert pool.null_block.block_hash is None
    with pytest.raises(ValueError, match="only be cached once full"):
        pool.cache_full_blocks(request, blocks + pool.get_new_blocks(1), 3, 4)
    check(pool, blocks + [pool.blocks[4]])


def test_duplicate_content_blocks_are_both_cached():
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(1), pool.get_new_blocks(1)
    cache_blocks_for(pool, a, [5, 5])
    cache_blocks_for(pool, b, [5, 5])
    key = (a[0].block_hash, 0)
    assert set(pool.cached_block_hash_to_block[key]) == {a[0].block_id, b[0].block_id}
    pool.free_blocks(a + b)
    assert pool.get_new_blocks(1) == a  # evicts a, the least recently freed
    assert pool.get_cached_block(b[0].block_hash) is b[0]
    check(pool, a)


def test_reset_prefix_cache_only_when_nothing_is_used():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    cache_blocks_for(pool, blocks, [1, 2, 3, 4])
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(blocks[0].block_hash) is blocks[0]
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.cached_block_hash_to_block == {} and all(b.block_hash is None for b in pool.blocks)
    check(pool)


def test_invariant_checker_catches_broken_accounting():
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(2)
    with pytest.raises(InvariantError, match="block 1 has ref_cnt 1 but appears in 0 block table"):
        check(pool, blocks[1:])
    blocks[0].ref_cnt = 2
    with pytest.raises(InvariantError, match="ref_cnt 2 but appears in 1"):
        check(pool, blocks)
    blocks[0].ref_cnt = 1
    pool.free_block_queue.num_free_blocks += 1
    with pytest.raises(InvariantError, match="counter"):
        check(pool, blocks)
    pool.free_block_queue.num_free_blocks -= 1
    blocks[0].ref_cnt = 0  # "freed" without joining the queue
    with pytest.raises(InvariantError, match="leaked"):
        check(pool, [blocks[1]])
    blocks[0].ref_cnt = 1
    cache_blocks_for(pool, blocks[:1], [9, 9])
    blocks[0].block_hash = hash_block_tokens(None, [1, 1])
    with pytest.raises(InvariantError, match="maps to block 1"):
        check(pool, blocks)
