"""Exercise 03: the free block queue and the block pool."""

from microvllm.core.block_pool import BlockPool
from microvllm.core.kv_cache_utils import FreeKVCacheBlockQueue
from microvllm.course.exercise import Exercise, Part

EXERCISE = Exercise(
    number="03", slug="block_pool", title="The block pool and its free queue",
    lecture="03 · KV cache and the block allocator",
    intro="""You write the paged KV cache's allocator: the doubly linked free queue (`popleft`,
`remove`, `append`, all O(1)) and the three `BlockPool` operations the KV cache manager calls:
`get_new_blocks`, `free_blocks` and `touch`.""",
    setup="""
from collections.abc import Iterable, Sequence

from microvllm.core.block_pool import BlockHashWithGroupId
from microvllm.core.kv_cache_utils import BlockHash, KVCacheBlock
from microvllm.checks import check_block_pool, check_free_block_queue, run_engine_with
""",
    parts=(Part(FreeKVCacheBlockQueue, intro="""The links live in the blocks themselves
(`prev_free_block`, `next_free_block`); `fake_free_list_head` and `fake_free_list_tail` are
sentinels, so no operation needs an "is the list empty?" branch."""),
           Part(BlockPool, intro="""`__init__` builds *your* `FreeKVCacheBlockQueue` (the name
resolves to the class above). Write `get_new_blocks`, `free_blocks` and `touch`; the prefix-cache
methods below them are the engine's code, for lecture 04.""")),
    todos={
        "FreeKVCacheBlockQueue.popleft": "unlink and return the block after the head sentinel "
                                         "(ValueError if the queue is empty)",
        "FreeKVCacheBlockQueue.remove": "unlink the block from its neighbours in O(1), clear its links, "
                                        "count it out (ValueError if it is not in the queue)",
        "FreeKVCacheBlockQueue.append": "link the block in just before the tail sentinel, count it in "
                                        "(ValueError if it is already queued)",
        "BlockPool.get_new_blocks": "pop num_blocks blocks from the free queue, evict their old hashes, "
                                    "set ref_cnt 1 (ValueError if too few are free)",
        "BlockPool.free_blocks": "drop one reference per block; append blocks that reach 0 to the free "
                                 "queue (ValueError for a block already at 0)",
        "BlockPool.touch": "take one reference per block, first removing free ones (ref_cnt 0) from "
                           "the free queue",
    },
    contract="""
A usable block is always in exactly one of two states:

| state | `ref_cnt` | in the free queue? | |
|---|---|---|---|
| in use | > 0, = the number of block tables holding it | no | |
| free | 0 | yes, in least-recently-freed order | may still carry its hash (a cached block) |

`FreeKVCacheBlockQueue` (every operation O(1)):
- `popleft()` unlinks and returns the block after `fake_free_list_head`; ValueError when empty.
- `remove(block)` unlinks a block from anywhere; ValueError if it is not in the queue
  (`prev_free_block is None`). A removed block has both links set to `None`.
- `append(block)` links it in before `fake_free_list_tail`; ValueError if already queued.
- `num_free_blocks` always equals the number of queued blocks.

`BlockPool` (block 0 is the null block: never handed out, never counted):
- `get_new_blocks(n)` pops the `n` least recently freed blocks, evicts the hash of any that
  was cached (`self._maybe_evict_cached_block`), sets `ref_cnt = 1`; ValueError (and no
  change) when fewer than `n` are free.
- `free_blocks(blocks)` drops one reference from each non-null block, in order; a block whose
  count reaches 0 joins the queue's tail and keeps its hash. If any block is already at 0, it
  raises ValueError **before anything changes**: check every block first, then change them.
- `touch(blocks)` takes one reference on each non-null block (prefix-cache hits); a block at 0
  sits in the free queue and must be removed from it first, or it could be handed out twice.
""",
    hints=(
        """Draw the four pointers that change when a block leaves the middle of the list: its
neighbours' `next_free_block` / `prev_free_block`, and its own two links (set to `None`, since
`is_free` is `prev_free_block is not None`).""",
        """`popleft()` is `remove()` of `fake_free_list_head.next_free_block`, unless that is the
tail sentinel (empty queue). `append()` links the block between `fake_free_list_tail.prev_free_block`
and the tail.""",
        """Before you run this, predict: after a refused `free_blocks`, what are the ref counts and how
many blocks are free? Which block must the pool hand out after `touch` revived `b`? (A block listed
twice in one call drops two references: `free_blocks([a, a])` with `a.ref_cnt == 1` is refused too.)
```python
# Test case: paste it into a new cell and run it (it uses your classes above)
pool = BlockPool(num_blocks=5)              # blocks 1..4 are usable (block 0 is the null block)
a, b = pool.get_new_blocks(2)
pool.free_blocks([b])
refused = False
try:
    pool.free_blocks([a, b])                # b is already free: the whole call is refused
except ValueError:
    refused = True
assert refused and (a.ref_cnt, b.ref_cnt, pool.get_num_free_blocks()) == (1, 0, 3), (a.ref_cnt, b.ref_cnt)
pool.touch([b])                             # a prefix-cache hit on the free block b
assert (b.ref_cnt, pool.get_num_free_blocks()) == (1, 2)
assert [block.block_id for block in pool.get_new_blocks(2)] == [3, 4]   # never b again
```""",
    ),
    checks=("check_free_block_queue(FreeKVCacheBlockQueue)", "check_block_pool(BlockPool)"),
    engine_intro="""`components={"block_pool": BlockPool}` makes the engine's KV cache manager allocate
every block through your pool. The pool here is small (`num_kv_blocks=6`, 5 usable blocks of 16
tokens), so requests are preempted and freed blocks revived as prefix-cache hits. Every greedy
token must equal the reference engine's; after every call of your `get_new_blocks`, `free_blocks`
and `touch` the pool's accounting is checked, and after every step its block tables, free blocks
and cached blocks must be the reference pool's (the LRU order decides which blocks come next).""",
    engine='run_engine_with({"block_pool": BlockPool})',
)
