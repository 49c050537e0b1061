"""Prefix hashing and the free block queue."""

import time

import pytest

from microvllm.core.block_pool import BlockPool
from microvllm.core.kv_cache_utils import (
    ROOT_BLOCK_HASH,
    BlockHash,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    hash_block_tokens,
    hash_new_full_blocks,
)

# ------------------------------------------------------------------ hashing


def test_hash_is_chained_and_deterministic():
    h0 = hash_block_tokens(None, [1, 2, 3, 4])
    assert isinstance(h0, BlockHash) and len(h0) == 32
    assert h0 == hash_block_tokens(None, [1, 2, 3, 4])
    assert h0 == hash_block_tokens(ROOT_BLOCK_HASH, [1, 2, 3, 4])
    h1 = hash_block_tokens(h0, [5, 6, 7, 8])
    # Same tokens, other parent: other hash.
    assert hash_block_tokens(None, [5, 6, 7, 8]) != h1
    assert hash_block_tokens(None, [1, 2, 3, 5]) != h0
    assert hash_block_tokens(None, [1, 2, 3, 4], ("salt",)) != h0
    assert hash_block_tokens(None, [1], ("ab", "c")) != hash_block_tokens(None, [1], ("a", "bc"))
    assert repr(h0).startswith("BlockHash(") and len(h0.short()) == 8 and len(h0.hex()) == 64


def test_hash_is_stable_across_processes_and_runs():
    """Not Python's hash() (salted per process): a fixed input has a fixed digest.
    If this fails, the hashing scheme changed and every stored prefix hash with it."""
    digest = hash_block_tokens(hash_block_tokens(None, [1, 2, 3], ("s",)), [4, 5, 6])
    assert digest.hex() == "1665b54b504f243c116dc7ffa24cf9cc1d4b782f8017d35c8b6ab3dc7a8aa816"


def test_incremental_hashing_only_hashes_full_blocks():
    tokens = list(range(10))
    hashes = []
    hash_new_full_blocks(hashes, tokens[:3], 4)
    assert hashes == []
    hash_new_full_blocks(hashes, tokens[:9], 4)
    assert len(hashes) == 2
    all_at_once = []
    hash_new_full_blocks(all_at_once, tokens, 4)
    assert all_at_once == hashes
    assert hashes[1] == hash_block_tokens(hashes[0], [4, 5, 6, 7])


def test_cache_salt_goes_into_first_block_and_propagates():
    plain, salted = [], []
    hash_new_full_blocks(plain, list(range(8)), 4)
    hash_new_full_blocks(salted, list(range(8)), 4, cache_salt="user-1")
    assert plain[0] != salted[0] and plain[1] != salted[1]
    assert salted[0] == hash_block_tokens(None, [0, 1, 2, 3], ("user-1",))
    assert salted[1] == hash_block_tokens(salted[0], [4, 5, 6, 7])


# -------------------------------------------------------------- free queue


def ids(blocks):
    return [b.block_id for b in blocks]


def test_free_queue_popleft_remove_append():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    assert len(queue) == 5 and ids(queue.get_all_free_blocks()) == [0, 1, 2, 3, 4]
    assert queue.popleft().block_id == 0
    queue.remove(blocks[2])  # from the middle
    assert not blocks[2].is_free and blocks[3].is_free
    assert ids(queue.get_all_free_blocks()) == [1, 3, 4]
    queue.append(blocks[0])
    queue.append(blocks[2])
    assert ids(queue.get_all_free_blocks()) == [1, 3, 4, 0, 2]
    assert ids(queue.popleft_n(3)) == [1, 3, 4]
    queue.remove(blocks[2])  # the last one
    queue.remove(blocks[0])  # the only one
    assert len(queue) == 0 and queue.get_all_free_blocks() == []
    with pytest.raises(ValueError, match="empty"):
        queue.popleft()
    with pytest.raises(ValueError, match="not in the free queue"):
        queue.remove(blocks[0])
    queue.append(blocks[4])
    with pytest.raises(ValueError, match="already in the free queue"):
        queue.append(blocks[4])
    with pytest.raises(ValueError):
        queue.popleft_n(2)


def test_free_queue_removal_is_constant_time():
    """An O(n) removal (list.remove) would take minutes here; linked removal takes ~0.1 s."""
    pool = BlockPool(100_000)
    blocks = pool.get_new_blocks(99_999)
    pool.free_blocks(blocks)
    middle = blocks[25_000:75_000]
    start = time.perf_counter()
    pool.touch(middle)  # each is a remove() from the middle of the free queue
    elapsed = time.perf_counter() - start
    assert pool.get_num_free_blocks() == 49_999
    assert elapsed < 1.0, f"touching 50,000 free blocks took {elapsed:.2f} s: remove() is not O(1)"
    start = time.perf_counter()
    pool.free_blocks(middle)
    pool.get_new_blocks(60_000)  # popleft 60,000 times
    assert time.perf_counter() - start < 1.0
