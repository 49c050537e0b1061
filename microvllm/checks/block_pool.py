"""Checks for exercise 03, part 2: the block pool.

    check_block_pool(BlockPool)     get_new_blocks / free_blocks / touch

Ends with a property test: hypothesis runs random sequences of operations against a plain
Python model of the pool (ref counts + LRU list), and after every operation compares them
and checks the pool's accounting (``check_kv_cache_invariants``: ref counts = table
entries, free = in the queue, hash table = hashed blocks).
"""

from __future__ import annotations

from microvllm.checks.fakes import make_request
from microvllm.checks.free_queue import _expect_raises, ids
from microvllm.checks.pool_watch import POOL_HINTS
from microvllm.checks.report import (
    Case,
    CheckFailure,
    CheckResult,
    expect,
    expect_equal,
    property_settings,
    run_checks,
    run_property,
)
from microvllm.core.kv_cache_invariants import check_kv_cache_invariants


def _cache(pool, blocks, tag: int):
    """Give ``blocks`` unique hashes (as the KV cache manager does once they are full)."""
    request = make_request(f"cache{tag}", [tag * 100 + i for i in range(len(blocks))], 1)
    pool.cache_full_blocks(request, blocks, 0, len(blocks))


def check_block_pool(pool_class, *, max_examples: int = 60, quiet: bool = False) -> CheckResult:
    """Check a ``BlockPool`` implementation; print and return the result."""

    def check(pool, *tables, after: str):
        try:
            check_kv_cache_invariants(pool, tables)
        except AssertionError as exc:
            raise CheckFailure(f"after {after}: {exc}", input=after) from exc

    def null_block_reserved():
        pool = pool_class(5)
        expect(pool.null_block.block_id == 0 and pool.null_block.is_null, "block 0 must be the null block")
        expect_equal(pool.get_num_free_blocks(), 4, "a pool of 5 blocks has 4 free blocks (block 0 is null)")
        got = ids(pool.get_new_blocks(4))
        expect(0 not in got, "get_new_blocks() handed out the null block", input="BlockPool(5).get_new_blocks(4)",
               got=got, hint="__init__ pops block 0 from the free queue for good")
        _expect_raises(lambda: pool.get_new_blocks(1), "get_new_blocks(1) with no free block must raise "
                       "ValueError", "compare num_blocks with get_num_free_blocks() before popping anything")

    def new_blocks_lru_and_ref_counts():
        pool = pool_class(6)
        a = pool.get_new_blocks(2)
        expect_equal(ids(a), [1, 2], "get_new_blocks(2) on a fresh pool must pop the head blocks 1, 2",
                     hint="pop from the head of the free queue (least recently freed first)")
        expect_equal([b.ref_cnt for b in a], [1, 1], "blocks from get_new_blocks() must have ref_cnt 1",
                     input="BlockPool(6).get_new_blocks(2)")
        expect_equal(pool.get_num_free_blocks(), 3, "free blocks after taking 2 of 5")
        check(pool, a, after="get_new_blocks(2)")

    def free_blocks_join_the_tail():
        pool = pool_class(6)
        a, b = pool.get_new_blocks(2), pool.get_new_blocks(2)
        pool.free_blocks(reversed(a))
        pool.free_blocks(b)
        after = ("a = get_new_blocks(2) -> [1, 2]; b = get_new_blocks(2) -> [3, 4]; "
                 "free_blocks([2, 1]); free_blocks([3, 4])")
        expect_equal([blk.ref_cnt for blk in a + b], [0, 0, 0, 0], "freed blocks must have ref_cnt 0", input=after)
        expect_equal(ids(pool.free_block_queue.get_all_free_blocks()), [5, 2, 1, 3, 4],
                     "freed blocks must join the free queue's tail in the order given", input=after,
                     hint="append() each block whose ref_cnt reaches 0, in the order of the iterable")
        check(pool, after=after)

    def double_free_is_refused():
        pool = pool_class(6)
        blocks = pool.get_new_blocks(4)
        pool.free_blocks(blocks[2:3])
        free_before = pool.get_num_free_blocks()
        try:
            pool.free_blocks(blocks[2:3])
        except ValueError:
            pass
        else:
            raise CheckFailure("block 3 came back from free_blocks() twice and nothing was refused",
                               input="get_new_blocks(4) -> [1, 2, 3, 4]; free_blocks([3]); free_blocks([3])",
                               expected="ValueError", got="no error",
                               hint="a block whose ref count is already 0 must not be pushed onto the free "
                                    "queue again: raise ValueError")
        expect(blocks[2].ref_cnt == 0 and pool.get_num_free_blocks() == free_before,
               "block 3 came back from free_blocks() twice: the refused call still changed the pool",
               input="free_blocks([3]) twice", expected=f"ref_cnt 0, {free_before} free blocks",
               got=f"ref_cnt {blocks[2].ref_cnt}, {pool.get_num_free_blocks()} free blocks",
               hint="a block whose ref count is already 0 must not be pushed onto the free queue again: "
                    "check ref_cnt before you change anything")
        # A refused call changes nothing, not even the blocks listed before the bad one.
        what = "get_new_blocks(4) -> [1, 2, 3, 4]; free_blocks([3]); free_blocks([1, 2, 3])"
        try:
            pool.free_blocks(blocks[:3])
        except ValueError:
            pass
        else:
            raise CheckFailure("free_blocks([1, 2, 3]) with block 3 already free must raise ValueError",
                               input=what, expected="ValueError", got="no error")
        expect([b.ref_cnt for b in blocks[:2]] == [1, 1] and pool.get_num_free_blocks() == free_before,
               "a refused free_blocks() must change nothing: blocks 1 and 2 lost a reference although "
               "the call raised", input=what, expected=f"blocks 1, 2: ref_cnt 1, 1; {free_before} free blocks",
               got=f"blocks 1, 2: ref_cnt {blocks[0].ref_cnt}, {blocks[1].ref_cnt}; "
                   f"{pool.get_num_free_blocks()} free blocks",
               hint="check every block first (all ref_cnt > 0), then drop the references")
        check(pool, blocks[:2], blocks[3:], after=what)
        # A block listed twice drops two references: with only one, the call is refused whole.
        what = "get_new_blocks(4) -> [1, 2, 3, 4]; free_blocks([3]); free_blocks([4, 4])"
        try:
            pool.free_blocks([blocks[3], blocks[3]])
        except ValueError:
            pass
        else:
            raise CheckFailure("free_blocks([4, 4]) with one reference on block 4 must raise ValueError",
                               input=what, expected="ValueError", got="no error",
                               hint="a block listed twice drops two references: count how often each "
                                    "block appears, and compare with its ref_cnt before changing anything")
        expect(blocks[3].ref_cnt == 1 and not blocks[3].is_free,
               "a refused free_blocks([4, 4]) must change nothing", input=what,
               expected="block 4: ref_cnt 1, not in the free queue",
               got=f"block 4: ref_cnt {blocks[3].ref_cnt}, in the free queue: {blocks[3].is_free}",
               hint="check every block first (counting repeats), then drop the references")

    def shared_blocks_stay_in_use():
        pool = pool_class(4)
        blocks = pool.get_new_blocks(1)
        pool.touch(blocks)  # a second request shares the block
        expect_equal(blocks[0].ref_cnt, 2, "touch() on a block in use must add one reference",
                     input="get_new_blocks(1) -> [1]; touch([1])")
        pool.free_blocks(blocks)
        expect(blocks[0].ref_cnt == 1 and not blocks[0].is_free,
               "a shared block freed by one of its two holders must stay in use",
               input="get_new_blocks(1); touch([1]); free_blocks([1])",
               got=f"ref_cnt {blocks[0].ref_cnt}, in the free queue: {blocks[0].is_free}",
               hint="only a block whose ref_cnt reaches 0 goes back to the free queue")
        check(pool, blocks, after="get_new_blocks(1); touch([1]); free_blocks([1])")

    def touch_revives_a_free_cached_block():
        pool = pool_class(4)
        blocks = pool.get_new_blocks(2)
        _cache(pool, blocks, 1)
        pool.free_blocks(blocks)
        hit = pool.get_cached_block(blocks[0].block_hash)
        pool.touch([hit])
        after = "get_new_blocks(2) -> [1, 2]; cache them; free_blocks([1, 2]); touch([1])"
        expect(hit.ref_cnt == 1 and not hit.is_free and pool.get_num_free_blocks() == 2,
               "touch() must take a free cached block out of the free queue", input=after,
               expected="block 1: ref_cnt 1, not in the free queue; 2 free blocks",
               got=f"block 1: ref_cnt {hit.ref_cnt}, in the free queue: {hit.is_free}; "
                   f"{pool.get_num_free_blocks()} free blocks",
               hint="a block with ref_cnt 0 sits in the free queue: remove() it before taking the "
                    "reference, or get_new_blocks() can hand it to another request while it is in use")
        got = ids(pool.get_new_blocks(2))
        expect(hit.block_id not in got, "get_new_blocks() handed out a block that touch() revived",
               input=after + "; get_new_blocks(2)", got=got,
               hint="touch() must remove the block from the free queue")
        check(pool, [hit], [pool.blocks[i] for i in got], after=after + "; get_new_blocks(2)")

    def reuse_evicts_the_hash():
        pool = pool_class(3)
        a = pool.get_new_blocks(1)
        _cache(pool, a, 2)
        block_hash = a[0].block_hash
        pool.free_blocks(a)
        reused = pool.get_new_blocks(2)
        after = "get_new_blocks(1) -> [1]; cache it; free_blocks([1]); get_new_blocks(2)"
        expect(pool.get_cached_block(block_hash) is None and a[0].block_hash is None,
               "a cached free block handed out again must lose its hash (it will hold other tokens)",
               input=after, got=f"block 1 hash {a[0].block_hash!r}, still findable: "
                                f"{pool.get_cached_block(block_hash) is not None}",
               hint="call self._maybe_evict_cached_block(block) on every block you pop")
        check(pool, reused, after=after)

    def random_operations():
        from hypothesis import given, strategies as st

        operation = st.tuples(st.sampled_from(["allocate", "free", "cache", "touch"]), st.integers(0, 99))

        @property_settings(max_examples)
        @given(st.integers(1, 10), st.lists(operation, max_size=30))
        def test(num_blocks, operations):
            pool = pool_class(num_blocks)
            free_order = list(range(1, num_blocks))  # the model: free queue, head first
            tables: list[list] = []
            done = []
            tag = 0
            for op, n in operations:
                if op == "allocate":
                    count = n % 4 + 1
                    done.append(f"get_new_blocks({count})")
                    if count > len(free_order):
                        _expect_raises(lambda: pool.get_new_blocks(count),
                                       f"get_new_blocks({count}) with {len(free_order)} free must raise "
                                       "ValueError", "check the free count first")
                        continue
                    blocks = pool.get_new_blocks(count)
                    expect_equal(ids(blocks), free_order[:count], "get_new_blocks() must pop the least "
                                 "recently freed blocks", input="; ".join(done))
                    del free_order[:count]
                    tables.append(blocks)
                elif op == "free" and tables:
                    blocks = tables.pop(n % len(tables))
                    done.append(f"free_blocks({ids(blocks)})")
                    pool.free_blocks(blocks)
                    for block in blocks:
                        if block.block_id not in {b.block_id for t in tables for b in t}:
                            free_order.append(block.block_id)
                elif op == "cache" and tables:
                    table = tables[n % len(tables)]
                    if any(b.block_hash is not None for b in table):
                        continue
                    tag += 1
                    done.append(f"cache {ids(table)}")
                    _cache(pool, table, tag)
                elif op == "touch":
                    cached = [b for b in pool.blocks if b.block_hash is not None]
                    if not cached:
                        continue
                    block = pool.get_cached_block(cached[n % len(cached)].block_hash)
                    done.append(f"touch([{block.block_id}])")
                    pool.touch([block])
                    if block.block_id in free_order:
                        free_order.remove(block.block_id)
                    tables.append([block])
                else:
                    continue
                after = f"BlockPool({num_blocks}); " + "; ".join(done)
                check(pool, *tables, after=after)
                expect_equal(ids(pool.free_block_queue.get_all_free_blocks()), free_order,
                             "the free queue (head to tail) is not in least-recently-freed order",
                             input=after)

        run_property(test)

    def free_queue_first():
        from microvllm.checks.free_queue import check_free_block_queue

        queue_class = type(pool_class(3).free_block_queue)
        result = check_free_block_queue(queue_class, max_examples=10, quiet=True)
        if not result.passed and not result.not_implemented:
            raise CheckFailure(f"the pool's {queue_class.__name__} fails check_free_block_queue "
                               f"({result.failures[0].name}), so the pool checks below may fail for it",
                               hint="fix the free queue first (its checker says what is wrong): every "
                                    "pool operation goes through it")

    cases = [
        Case("the pool's free queue passes its own checks", free_queue_first),
        Case("block 0 is the reserved null block", null_block_reserved),
        Case("get_new_blocks() pops the head of the free queue with ref_cnt 1", new_blocks_lru_and_ref_counts),
        Case("free_blocks() drops a reference and appends blocks at 0 to the tail", free_blocks_join_the_tail),
        Case("free_blocks() refuses a block already at ref count 0, changing nothing", double_free_is_refused),
        Case("a shared block stays in use until its last holder frees it", shared_blocks_stay_in_use),
        Case("touch() revives a free cached block: out of the free queue", touch_revives_a_free_cached_block),
        Case("reusing a cached free block evicts its hash", reuse_evicts_the_hash),
        Case(f"property: {max_examples} random operation sequences keep the accounting", random_operations),
    ]
    return run_checks("check_block_pool", cases, POOL_HINTS, quiet=quiet)
