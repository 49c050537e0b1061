"""BlockPool's KV cache events (vLLM's ``kv_event_queue`` / ``take_events``), no engine:
what enters the prefix cache, what leaves it, a reset; off by default."""

from collections import Counter

from microvllm.core.block_pool import AllBlocksCleared, BlockPool, BlockRemoved, BlockStored
from microvllm.core.kv_cache_invariants import check_kv_cache_invariants
from tests.core.core_helpers import make_request


def mirror(events, counts=None):
    """The cached (hash, group) multiset a router rebuilds from the events."""
    counts = Counter() if counts is None else counts
    for event in events:
        if isinstance(event, BlockStored):
            counts.update((h, event.group_idx) for h in event.block_hashes)
        elif isinstance(event, BlockRemoved):
            counts.subtract((h, event.group_idx) for h in event.block_hashes)
        else:
            counts.clear()
    return +counts


def cached(pool):
    return Counter({key: len(blocks) for key, blocks in pool.cached_block_hash_to_block.items()})


def test_events_are_off_by_default():
    pool = BlockPool(6)
    request = make_request("r", list(range(8)), 2)
    blocks = pool.get_new_blocks(4)
    pool.cache_full_blocks(request, blocks, 0, 4)
    pool.free_blocks(blocks)
    pool.get_new_blocks(5)   # evicts all four
    assert pool.kv_event_queue == [] and pool.take_events() == []


def test_stored_removed_cleared_in_order():
    pool = BlockPool(6, enable_kv_cache_events=True)
    tokens = list(range(10, 20))           # 5 blocks of 2
    request = make_request("r", tokens, 2)
    blocks = pool.get_new_blocks(5)
    pool.cache_full_blocks(request, blocks, 0, 2)
    pool.cache_full_blocks(request, blocks, 2, 5)
    first, second = pool.take_events()
    assert first == BlockStored(block_hashes=request.block_hashes[:2], parent_block_hash=None,
                                token_ids=tokens[:4], block_size=2, lora_id=None, medium="GPU", group_idx=0)
    assert second.parent_block_hash == request.block_hashes[1]
    assert second.block_hashes == request.block_hashes[2:5] and second.token_ids == tokens[4:10]
    assert pool.take_events() == []        # drained
    check_kv_cache_invariants(pool, [blocks])

    pool.free_blocks(reversed(blocks))     # the tail block is evicted first
    pool.get_new_blocks(2)
    assert pool.take_events() == [BlockRemoved(block_hashes=[request.block_hashes[4]]),
                                  BlockRemoved(block_hashes=[request.block_hashes[3]])]
    assert mirror([first, second, *[BlockRemoved([h]) for h in request.block_hashes[3:]]]) == cached(pool)


def test_a_reset_is_one_event_and_a_refused_reset_none():
    pool = BlockPool(6, enable_kv_cache_events=True)
    request = make_request("r", list(range(4)), 2)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(request, blocks, 0, 2)
    assert pool.reset_prefix_cache() is False   # blocks in use
    assert [type(e) for e in pool.take_events()] == [BlockStored]
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.take_events() == [AllBlocksCleared()]
    pool.get_new_blocks(5)                      # nothing cached any more: nothing evicted
    assert pool.take_events() == []


def test_two_blocks_with_one_hash_and_another_group():
    """Two blocks may hold the same content (a multiset per hash), and a second cache group
    keeps its own entries: the events name the group, and a removal takes one copy."""
    pool = BlockPool(8, enable_kv_cache_events=True)
    tokens = list(range(4))
    a, b = make_request("a", tokens, 2), make_request("b", tokens, 2)
    blocks_a, blocks_b, blocks_g1 = pool.get_new_blocks(2), pool.get_new_blocks(2), pool.get_new_blocks(2)
    pool.cache_full_blocks(a, blocks_a, 0, 2)
    pool.cache_full_blocks(b, blocks_b, 0, 2)
    pool.cache_full_blocks(a, blocks_g1, 0, 2, kv_cache_group_id=1)
    counts = mirror(pool.take_events())
    assert counts == cached(pool) and counts[(a.block_hashes[0], 0)] == 2 and counts[(a.block_hashes[0], 1)] == 1
    pool.evict_cached_blocks(blocks_b[:1])
    pool.evict_cached_blocks(blocks_b[:1])     # already forgotten: no second event
    events = pool.take_events()
    assert events == [BlockRemoved(block_hashes=[a.block_hashes[0]], group_idx=0)]
    assert mirror(events, counts) == cached(pool)
    check_kv_cache_invariants(pool, [blocks_a, blocks_b, blocks_g1])


def test_the_null_block_and_already_cached_blocks_are_not_stored_again():
    pool = BlockPool(6, enable_kv_cache_events=True)
    tokens = list(range(6))
    request = make_request("r", tokens, 2)
    blocks = [pool.null_block, *pool.get_new_blocks(2)]   # a sliding window dropped block 0
    pool.cache_full_blocks(request, blocks, 0, 3)
    (event,) = pool.take_events()
    assert event.block_hashes == request.block_hashes[1:3] and event.token_ids == tokens   # vLLM's range
    pool.cache_full_blocks(request, blocks, 1, 3)          # the same blocks again: nothing new
    assert pool.take_events() == []
