"""KVCacheManager with one full-attention group: hits, allocation, free order, capacity."""

import pytest

from microvllm.core import FullAttentionSpec, InvariantError, KVCacheManager, PoolTooSmallError
from tests.core.core_helpers import make_request

B = 4


def manager(num_blocks=16, enable_caching=True):
    return KVCacheManager([FullAttentionSpec(B)], num_blocks, B, enable_caching)


def admit(kv, request, num_new_tokens=None):
    """Admission as the scheduler does it: hit lookup, then allocate the rest."""
    hit_blocks, num_hit = kv.get_computed_blocks(request)
    num_new = request.num_tokens - num_hit if num_new_tokens is None else num_new_tokens
    new = kv.allocate_slots(request, num_new, num_hit, hit_blocks)
    if new is not None:
        request.num_computed_tokens = num_hit + num_new
    kv.check_invariants()
    return new, num_hit


def test_allocate_returns_new_blocks_and_grows_by_block():
    kv = manager()
    r = make_request("a", list(range(6)), B)
    new, hit = admit(kv, r)
    assert hit == 0 and new.get_block_ids() == ([1, 2],)
    r.append_output_token_ids([100])
    assert kv.allocate_slots(r, 1).get_block_ids() == ([],)  # position 6 fits in block 2
    r.num_computed_tokens = 7
    r.append_output_token_ids([101, 102])
    assert kv.allocate_slots(r, 2).get_block_ids() == ([3],)
    assert kv.get_block_ids("a") == ([1, 2, 3],)
    kv.check_invariants()


def test_hit_never_covers_the_last_token():
    kv = manager()
    a = make_request("a", list(range(8)), B)  # exactly 2 full blocks
    admit(kv, a)
    b = make_request("b", list(range(8)), B)
    blocks, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 4  # not 8: token 7 is recomputed to get logits
    assert blocks.get_block_ids() == ([1],)
    c = make_request("c", list(range(9)), B)
    assert kv.get_computed_blocks(c)[1] == 8


def test_shared_block_has_ref_count_two_and_free_order():
    kv = manager()
    a = make_request("a", list(range(10)), B)
    admit(kv, a)
    b = make_request("b", list(range(8)) + [50, 51], B)
    new, hit = admit(kv, b)
    assert hit == 8 and new.get_block_ids() == ([4],)
    assert kv.get_block_ids("b") == ([1, 2, 4],)
    assert [kv.block_pool.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [2, 2, 1, 1]
    kv.free(a)
    assert [kv.block_pool.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [1, 1, 0, 1]
    kv.free(b)
    # Tail blocks first, so a request's prefix is evicted last.
    free_ids = [blk.block_id for blk in kv.block_pool.free_block_queue.get_all_free_blocks()]
    assert free_ids[-4:] == [3, 4, 2, 1]
    kv.check_invariants()


def test_cache_hit_on_a_freed_block():
    kv = manager()
    a = make_request("a", list(range(9)), B)
    admit(kv, a)
    kv.free(a)
    assert kv.usage == 0.0
    b = make_request("b", list(range(9)), B)
    new, hit = admit(kv, b)
    assert hit == 8 and kv.get_block_ids("b") == ([1, 2, 4],)  # 1 and 2 revived, not recomputed
    assert b.num_computed_tokens == 9


def test_hit_stops_at_the_first_missing_block():
    kv = manager()
    a = make_request("a", list(range(12)), B)
    admit(kv, a)
    # Evict the middle block's hash by hand: blocks after it are useless without it.
    middle = kv.block_pool.blocks[2]
    kv.free(a)
    kv.block_pool._maybe_evict_cached_block(middle)
    b = make_request("b", list(range(12)) + [99], B)
    blocks, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 4 and blocks.get_block_ids() == ([1],)
    kv.check_invariants()


def test_allocate_slots_none_changes_nothing():
    kv = manager(num_blocks=4)  # 3 usable
    a = make_request("a", list(range(8)), B)
    admit(kv, a)
    kv.free(a)  # blocks 1, 2 cached and free
    b = make_request("b", list(range(8)) + list(range(50, 58)), B)  # 2 hit + 2 new = 4 > 3
    before = [(blk.ref_cnt, blk.block_hash, blk.is_free) for blk in kv.block_pool.blocks]
    new, hit = admit(kv, b)
    assert new is None and hit == 8
    assert [(blk.ref_cnt, blk.block_hash, blk.is_free) for blk in kv.block_pool.blocks] == before
    assert kv.get_block_ids("b") == ([],)
    kv.check_invariants()


def test_no_caching_means_no_hits():
    kv = manager(enable_caching=False)
    a = make_request("a", list(range(9)), B)
    admit(kv, a)
    assert kv.block_pool.cached_block_hash_to_block == {}
    assert kv.get_computed_blocks(make_request("b", list(range(9)), B))[1] == 0


def test_cache_salt_separates_users():
    kv = manager()
    admit(kv, make_request("a", list(range(9)), B, cache_salt="alice"))
    assert kv.get_computed_blocks(make_request("b", list(range(9)), B, cache_salt="bob"))[1] == 0
    assert kv.get_computed_blocks(make_request("c", list(range(9)), B, cache_salt="alice"))[1] == 8


def test_reset_prefix_cache_and_usage():
    kv = manager(num_blocks=5)
    a = make_request("a", list(range(8)), B)
    admit(kv, a)
    assert kv.usage == pytest.approx(0.5)
    assert kv.reset_prefix_cache() is False
    kv.free(a)
    assert kv.reset_prefix_cache() is True
    assert kv.get_computed_blocks(make_request("b", list(range(9)), B))[1] == 0


def test_pool_too_small_is_reported_with_numbers():
    kv = KVCacheManager([FullAttentionSpec(16)], 32, 16)  # 31 usable
    request = make_request("r3", list(range(630)), 16)
    assert kv.can_fit_ever(31 * 16) and not kv.can_fit_ever(31 * 16 + 1)
    with pytest.raises(PoolTooSmallError) as info:
        kv.check_can_fit_ever(request)
    assert str(info.value) == (
        "request 'r3' needs 40 KV blocks for 630 tokens but the pool has only 31 usable blocks "
        "(block_size=16): raise num_kv_blocks or shorten the prompt")
    assert isinstance(info.value, ValueError)


def test_check_invariants_with_extra_tables_and_errors():
    kv = manager()
    a = make_request("a", list(range(9)), B)
    admit(kv, a)
    kv.free(a)
    hit = kv.block_pool.get_cached_block(a.block_hashes[0])
    kv.block_pool.touch([hit])  # held outside any request
    with pytest.raises(InvariantError, match=f"block {hit.block_id} has ref_cnt 1 but appears in 0"):
        kv.check_invariants()
    kv.check_invariants(extra_block_tables=[[hit]])
    kv.check_invariants(extra_block_tables=[[hit.block_id]])


def test_rejects_mismatched_block_sizes():
    with pytest.raises(ValueError, match="share one block size"):
        KVCacheManager([FullAttentionSpec(8)], 8, 16)
