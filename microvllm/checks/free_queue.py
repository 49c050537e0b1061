"""Checks for exercise 03, part 1: the free block queue (``FreeKVCacheBlockQueue``).

    check_free_block_queue(FreeKVCacheBlockQueue)   popleft / remove / append, O(1) remove

Ends with a property test: hypothesis runs random sequences of operations against a plain
Python list and compares the queue (walked through its links, both ways) after each one.
"""

from __future__ import annotations

import time

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
from microvllm.core.kv_cache_utils import KVCacheBlock


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def _queue_ids(queue) -> list[int]:
    """Walk the queue head to tail by its links, checking that prev points back."""
    result, node = [], queue.fake_free_list_head
    for _ in range(100_000):
        nxt = node.next_free_block
        if nxt is None:
            raise CheckFailure("the free queue's links end in None before the tail sentinel",
                               got=f"after blocks {result}",
                               hint="every block in the queue needs next_free_block and prev_free_block set; "
                                    "the last real block's next is fake_free_list_tail")
        if nxt.prev_free_block is not node:
            raise CheckFailure(
                f"the free queue's links disagree after block {node.block_id}: "
                f"block {nxt.block_id}.prev_free_block is not block {node.block_id}",
                got=f"queue so far {result}",
                hint="when you link or unlink a block, update both neighbours: prev.next and next.prev")
        if nxt is queue.fake_free_list_tail:
            return result
        result.append(nxt.block_id)
        node = nxt
    raise CheckFailure("the free queue's next links form a cycle", got=f"queue starts {result[:10]}")


def _expect_queue(queue, expected: list[int], after: str) -> None:
    got = _queue_ids(queue)
    expect_equal(got, expected, f"after {after}, the free queue (head to tail) is wrong", input=after,
                 hint="popleft() takes from the head, append() adds at the tail, remove() unlinks "
                      "in place; the order is least recently freed first")
    expect_equal(len(queue), len(expected), f"after {after}, len(queue) is wrong",
                 hint="keep num_free_blocks in step: -1 in popleft()/remove(), +1 in append()")


def _expect_raises(fn, what: str, hint: str) -> None:
    try:
        fn()
    except ValueError:
        return
    except NotImplementedError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise CheckFailure(what, expected="ValueError", got=f"{type(exc).__name__}: {exc}", hint=hint)
    raise CheckFailure(what, expected="ValueError", got="no error", hint=hint)


def check_free_block_queue(queue_class, *, max_examples: int = 60, quiet: bool = False) -> CheckResult:
    """Check a ``FreeKVCacheBlockQueue`` implementation; print and return the result."""

    def fresh(n: int = 5):
        blocks = [KVCacheBlock(i) for i in range(n)]
        return blocks, queue_class(blocks)

    def new_queue_in_order():
        blocks, queue = fresh()
        _expect_queue(queue, [0, 1, 2, 3, 4], "queue_class(blocks 0..4)")
        expect(all(b.is_free for b in blocks), "a new queue's blocks must all be linked (is_free)")

    def popleft_takes_the_head():
        blocks, queue = fresh()
        got = [queue.popleft().block_id for _ in range(2)]
        expect_equal(got, [0, 1], "popleft() must return the least recently freed block (the head)",
                     input="blocks 0..4; popleft() twice",
                     hint="return fake_free_list_head.next_free_block, after unlinking it")
        expect(not blocks[0].is_free and blocks[0].prev_free_block is None and blocks[0].next_free_block is None,
               "a popped block must have both links cleared (None)", input="popleft() -> block 0",
               got=f"prev={blocks[0].prev_free_block!r}, next={blocks[0].next_free_block!r}",
               hint="is_free is `prev_free_block is not None`: a popped block still linked looks free")
        _expect_queue(queue, [2, 3, 4], "popleft() twice")

    def remove_anywhere():
        blocks, queue = fresh()
        steps = []
        for block_id, expected in ((2, [0, 1, 3, 4]), (0, [1, 3, 4]), (4, [1, 3]), (1, [3]), (3, [])):
            queue.remove(blocks[block_id])
            steps.append(f"remove(block {block_id})")
            _expect_queue(queue, expected, ", ".join(steps))
            expect(not blocks[block_id].is_free, f"block {block_id} still looks free after remove()",
                   hint="set the removed block's prev_free_block and next_free_block to None")

    def append_at_the_tail():
        blocks, queue = fresh()
        queue.popleft()
        queue.remove(blocks[3])
        queue.append(blocks[3])
        queue.append(blocks[0])
        _expect_queue(queue, [1, 2, 4, 3, 0], "popleft(), remove(block 3), append(block 3), append(block 0)")
        for block_id in (1, 2, 4, 3, 0):
            queue.popleft()
        _expect_queue(queue, [], "popping every block")
        queue.append(blocks[2])
        _expect_queue(queue, [2], "append(block 2) to an empty queue")

    def popleft_n_in_order():
        blocks, queue = fresh()
        expect_equal(ids(queue.popleft_n(3)), [0, 1, 2], "popleft_n(3) must take the 3 head blocks in order")
        _expect_queue(queue, [3, 4], "popleft_n(3)")

    def errors_are_explained():
        blocks, queue = fresh(2)
        queue.popleft()
        queue.popleft()
        _expect_raises(queue.popleft, "popleft() on an empty queue must raise ValueError",
                       "when head.next is the tail sentinel the queue is empty: raise, do not return the sentinel")
        _expect_raises(lambda: queue.remove(blocks[0]), "remove() of a block that is not in the queue "
                       "must raise ValueError", "a block not in the queue has prev_free_block None")
        queue.append(blocks[1])
        _expect_raises(lambda: queue.append(blocks[1]), "append() of a block already in the queue must "
                       "raise ValueError", "a queued block has prev_free_block set: appending it again "
                       "would corrupt the links")
        _expect_queue(queue, [1], "the refused calls")

    def remove_is_constant_time():
        def time_removes(num_blocks: int) -> float:
            blocks = [KVCacheBlock(i) for i in range(num_blocks)]
            queue = queue_class(blocks)
            middle = blocks[num_blocks // 2 - 1000:num_blocks // 2 + 1000]
            start = time.perf_counter()
            for block in middle:
                queue.remove(block)
            return time.perf_counter() - start

        small, large = time_removes(4_000), time_removes(128_000)
        expect(large < 0.05 or large < 8 * small,
               "remove() must be O(1): 2,000 removes from the middle of a 128,000-block queue took "
               f"{large / max(small, 1e-9):.0f}x as long as from a 4,000-block queue",
               hint="unlink through the block's own prev/next links; never search or rebuild a list")

    def random_operations():
        from hypothesis import given, strategies as st

        @property_settings(max_examples)
        @given(st.integers(1, 12), st.lists(st.tuples(st.sampled_from(["popleft", "remove", "append"]),
                                                      st.integers(0, 11)), max_size=30))
        def test(num_blocks, operations):
            blocks, queue = fresh(num_blocks)
            model = list(range(num_blocks))
            done = []
            for op, index in operations:
                block = blocks[index % num_blocks]
                if op == "popleft" and model:
                    got = queue.popleft().block_id
                    done.append("popleft()")
                    expect_equal(got, model.pop(0), "popleft() returned the wrong block",
                                 input=f"{num_blocks} blocks; " + ", ".join(done))
                elif op == "remove" and block.block_id in model:
                    queue.remove(block)
                    model.remove(block.block_id)
                    done.append(f"remove(block {block.block_id})")
                elif op == "append" and block.block_id not in model:
                    queue.append(block)
                    model.append(block.block_id)
                    done.append(f"append(block {block.block_id})")
                else:
                    continue
                _expect_queue(queue, model, f"{num_blocks} blocks; " + ", ".join(done))

        run_property(test)

    cases = [
        Case("a new queue holds every block, in order", new_queue_in_order),
        Case("popleft() takes the least recently freed block and unlinks it", popleft_takes_the_head),
        Case("remove() unlinks a block from the middle, the head, the tail", remove_anywhere),
        Case("append() puts a block at the tail", append_at_the_tail),
        Case("popleft_n(n) takes the n head blocks in order", popleft_n_in_order),
        Case("mistakes raise ValueError (empty popleft, remove twice, append twice)", errors_are_explained),
        Case("remove() is O(1)", remove_is_constant_time),
        Case(f"property: {max_examples} random operation sequences match a Python list", random_operations),
    ]
    return run_checks("check_free_block_queue", cases, quiet=quiet)
