"""KVCacheManager: the scheduler's only door to the KV cache.

    Scheduler --get_computed_blocks / allocate_slots / free--> KVCacheManager
                                                                 | one per cache group
                            FullAttentionManager, SlidingWindowManager, MambaManager
                                                                 | all share
                                                             BlockPool

It answers three questions, each in O(blocks of the request):
- how much of this new request is already cached? (``get_computed_blocks``)
- can this request get slots for its next tokens? (``allocate_slots``; None = no)
- this request is done or preempted: take its blocks back (``free``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from microvllm.core.block_pool import BlockPool
from microvllm.core.kv_cache_invariants import InvariantError, check_kv_cache_invariants
from microvllm.core.kv_cache_spec import KVCacheSpec
from microvllm.core.kv_cache_utils import KVCacheBlock
from microvllm.core.request import Request
from microvllm.core.single_type_kv_cache_manager import (
    SingleTypeKVCacheManager,
    get_manager_for_kv_cache_spec,
)


class PoolTooSmallError(ValueError):
    """The KV pool cannot hold even one request on its own: it would never run."""

    def __init__(self, request_id: str, num_tokens: int, num_blocks_needed: int,
                 num_usable_blocks: int, block_size: int) -> None:
        super().__init__(
            f"request {request_id!r} needs {num_blocks_needed} KV blocks for {num_tokens} tokens "
            f"but the pool has only {num_usable_blocks} usable blocks (block_size={block_size}): "
            "raise num_kv_blocks or shorten the prompt"
        )
        self.request_id = request_id
        self.num_tokens = num_tokens
        self.num_blocks_needed = num_blocks_needed
        self.num_usable_blocks = num_usable_blocks


@dataclass
class KVCacheBlocks:
    """Blocks of one request, one list per cache group: ``blocks[group][i]``."""

    blocks: tuple[list[KVCacheBlock], ...]

    def get_block_ids(self) -> tuple[list[int], ...]:
        """Block ids per group, e.g. ``([3, 8, 1],)`` for one group. O(blocks)."""
        return tuple([block.block_id for block in group] for group in self.blocks)


class KVCacheManager:
    """Block tables of all requests, over all cache groups, on one shared BlockPool."""

    def __init__(self, kv_cache_groups: list[KVCacheSpec], num_blocks: int, block_size: int,
                 enable_caching: bool = True, block_pool_class: type[BlockPool] = BlockPool, *,
                 num_lookahead_tokens: int = 0, max_model_len: int | None = None,
                 enable_kv_cache_events: bool = False) -> None:
        """``num_lookahead_tokens``: slots every allocation holds beyond its new tokens, for a
        draft model that writes the KV of its drafts before they are scheduled
        (speculative decoding; vLLM passes the same number to each ``allocate_slots`` call),
        never past ``max_model_len``. ``enable_kv_cache_events``: the pool records
        what enters and leaves the prefix cache (``take_events``)."""
        if not kv_cache_groups:
            raise ValueError("kv_cache_groups is empty: a model needs at least one cache group")
        for spec in kv_cache_groups:
            if spec.block_size != block_size:
                raise ValueError(
                    f"{type(spec).__name__} has block_size {spec.block_size} but the manager uses "
                    f"{block_size}: all cache groups must share one block size"
                )
        self.kv_cache_groups = list(kv_cache_groups)
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.num_lookahead_tokens, self.max_model_len = num_lookahead_tokens, max_model_len
        self.block_pool = (block_pool_class(num_blocks, enable_caching, enable_kv_cache_events=True)
                           if enable_kv_cache_events else block_pool_class(num_blocks, enable_caching))
        self.single_type_managers: list[SingleTypeKVCacheManager] = [
            get_manager_for_kv_cache_spec(spec, self.block_pool, group_id)
            for group_id, spec in enumerate(self.kv_cache_groups)
        ]

    # ------------------------------------------------------------- prefix hit

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """The longest cached prefix of a new request: (hit blocks, hit tokens).

        Never the whole sequence: the last token is always recomputed, so the
        model produces logits to sample the next token from.

            tokens      [ t0 .. t15 | t16 .. t31 | t32 .. t39 ]   B = 16, 40 tokens
            cached?        yes           yes        (partial)
            max hit     num_tokens - 1 = 39 -> 2 full blocks -> 32 tokens

            (with exactly 32 tokens, max hit = 31 -> 1 block -> 16 tokens)

        With several groups, the hit is the longest one all groups agree on.
        Blocks are not touched here; ``allocate_slots`` does that.
        Cost: O(groups * blocks of the request) per round, usually one round.
        """
        ### BEGIN SOLUTION
        if not self.enable_caching:
            return self.create_empty_block_list(), 0
        hit_length = request.num_tokens - 1
        while True:
            hits = [m.find_longest_cache_hit(request.block_hashes, hit_length)
                    for m in self.single_type_managers]
            shortest = min(len(blocks) for blocks in hits) * self.block_size
            if all(len(blocks) * self.block_size == shortest for blocks in hits):
                break
            # Groups disagree: retry all at the shortest length. A sliding-window
            # hit cut shorter may need other blocks, so it is searched again.
            hit_length = shortest
        return KVCacheBlocks(tuple(hits)), shortest
        ### END SOLUTION

    # --------------------------------------------------------------- allocate

    def allocate_slots(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: KVCacheBlocks | None = None, *,
                       delay_cache_blocks: bool = False) -> KVCacheBlocks | None:
        """Make room for ``num_new_tokens`` more tokens; return the NEW blocks, or None.

            | computed       | new computed   | new tokens     | empty |
            | (KV in blocks) | (prefix hits)  | (this step)    | slots |
            |<-------------->|<-------------->|<-------------->|
              request.         num_new_         num_new_tokens
              num_computed_    computed_tokens
              tokens
            |<------------ num_tokens_need_slot ------------->|
            |<--- blocks held after the call (whole blocks) ---------->|

        - computed: tokens whose KV is already in the request's blocks;
        - new computed: prefix-cache hits (``get_computed_blocks``), admission only;
        - new tokens: what the runner computes this step (a prefill chunk, or
          the one decode token); their slots are allocated here;
        - empty slots: the rest of the last block, filled by later tokens.

        Returns None, with nothing allocated or touched, when the pool lacks the
        blocks; the scheduler then preempts someone or stops admitting.
        (Sliding-window blocks that fell out of the window are released first
        either way: they are never needed again.)
        On success: touches the hits, allocates, and registers blocks that are
        now full in the prefix cache. O(blocks of the request).

        ``delay_cache_blocks=True`` (a KV connector's load: the "new tokens" are loaded,
        not computed, and arrive a step later) registers nothing: ``cache_blocks`` does,
        once the load is done.
        """
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens is {num_new_tokens}: allocate_slots needs at least 1 token")
        hit_blocks = new_computed_blocks.blocks if new_computed_blocks is not None \
            else tuple([] for _ in self.single_type_managers)
        request_id = request.request_id

        for manager in self.single_type_managers:
            if self.enable_caching:   # a state group's snapshots of the last step, before its old pages go
                manager.cache_blocks(request, min(request.num_computed_tokens, request.num_tokens))
            manager.remove_skipped_blocks(request_id, request.num_computed_tokens)

        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        num_tokens_need_slot = num_computed_tokens + num_new_tokens
        if self.num_lookahead_tokens:
            num_tokens_need_slot += self.num_lookahead_tokens
            if self.max_model_len is not None:
                num_tokens_need_slot = max(min(num_tokens_need_slot, self.max_model_len),
                                           num_computed_tokens + num_new_tokens)
        num_blocks_to_allocate = sum(
            manager.get_num_blocks_to_allocate(request_id, num_tokens_need_slot, hits)
            for manager, hits in zip(self.single_type_managers, hit_blocks)
        )
        if num_blocks_to_allocate > self.block_pool.get_num_free_blocks():
            return None

        # Touch every group's hits before allocating anything: a free cached hit
        # of one group must leave the free queue before another group's
        # allocation could pop (evict) it.
        for manager, hits in zip(self.single_type_managers, hit_blocks):
            self.block_pool.touch(hits)
            manager.save_new_computed_blocks(request_id, hits)
        new_blocks = [manager.allocate_new_blocks(request_id, num_tokens_need_slot)
                      for manager in self.single_type_managers]

        if self.enable_caching and not delay_cache_blocks:
            # Registered when scheduled: a request admitted later in this step may
            # hit them, as every layer writes the step's KV before attention reads.
            # Only tokens computed by this step (never lookahead slots, never drafts).
            num_tokens_to_cache = min(num_computed_tokens + num_new_tokens, request.num_tokens)
            for manager in self.single_type_managers:
                manager.cache_blocks(request, num_tokens_to_cache)
        return KVCacheBlocks(tuple(new_blocks))

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's full blocks up to ``num_computed_tokens`` in the prefix
        cache (after a KV connector's load; vLLM's name). O(blocks of the request)."""
        if self.enable_caching:
            for manager in self.single_type_managers:
                manager.cache_blocks(request, num_computed_tokens)

    def detach_blocks(self, request_id: str) -> KVCacheBlocks:
        """Take a request's block tables away from it WITHOUT freeing them: the caller now
        holds their references and must give them back with ``free_blocks`` (a KV
        connector's delayed free, or blocks held for a request between its load and its
        admission). O(groups)."""
        blocks = tuple(manager.req_to_blocks.pop(request_id, []) for manager in self.single_type_managers)
        for manager in self.single_type_managers:
            manager.num_cached_block.pop(request_id, None)
        return KVCacheBlocks(blocks)

    def free_blocks(self, blocks: KVCacheBlocks) -> None:
        """Give back references taken with ``detach_blocks``, tail first (as ``free``). O(blocks)."""
        for group in blocks.blocks:
            self.block_pool.free_blocks(reversed(group))

    def free(self, request: Request | str) -> None:
        """Return all of a request's blocks to the pool, tail first. O(blocks of the request)."""
        request_id = request if isinstance(request, str) else request.request_id
        for manager in self.single_type_managers:
            if self.enable_caching and not isinstance(request, str):   # a state group's last snapshots
                manager.cache_blocks(request, min(request.num_computed_tokens, request.num_tokens))
            manager.free(request_id)

    # --------------------------------------------------------------- queries

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        """The request's block tables (the live lists: do not modify). O(groups)."""
        return KVCacheBlocks(tuple(m.req_to_blocks.get(request_id, []) for m in self.single_type_managers))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block ids, one list per group. O(blocks of the request)."""
        return self.get_blocks(request_id).get_block_ids()

    def create_empty_block_list(self) -> KVCacheBlocks:
        return KVCacheBlocks(tuple([] for _ in self.single_type_managers))

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use (0.0 .. 1.0). O(1)."""
        return self.block_pool.get_usage()

    @property
    def num_usable_blocks(self) -> int:
        return self.block_pool.num_usable_blocks

    def forget_cached_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take these blocks out of the prefix cache (their KV cannot be trusted). O(len(blocks))."""
        self.block_pool.evict_cached_blocks(blocks)

    def take_events(self) -> list:
        """The block pool's KV cache events since the last call (vLLM's name)."""
        return self.block_pool.take_events()

    def reset_prefix_cache(self) -> bool:
        """Forget all cached hashes; False (no change) while any block is in use."""
        return self.block_pool.reset_prefix_cache()

    # ------------------------------------------------------------- capacity

    def num_blocks_needed(self, num_tokens: int) -> int:
        """Blocks one request of ``num_tokens`` tokens holds at most, all groups. O(groups)."""
        return sum(spec.max_blocks_held(num_tokens) for spec in self.kv_cache_groups)

    def num_blocks_needed_for_chunk(self, num_computed_tokens: int, num_new_tokens: int) -> int:
        """Blocks a request holds (all groups) after allocating ``num_new_tokens``
        more slots past ``num_computed_tokens``. O(groups)."""
        return sum(spec.num_blocks_needed(num_computed_tokens, num_new_tokens) for spec in self.kv_cache_groups)

    def num_blocks_to_start(self, num_prompt_tokens: int, max_chunk_tokens: int) -> int:
        """The most blocks (all groups) a request holds while its prompt is computed in
        chunks of ``max_chunk_tokens`` (the step's token budget) and its first new token
        is decoded: a pool with fewer usable blocks can never start it. O(groups * chunks).

            prompt 10, budget 4:   [0..3]  [4..7]  [8, 9]  then decode token 10

        With full attention this is just the blocks of ``num_prompt_tokens + 1`` tokens.
        A sliding window frees old blocks between chunks, but one chunk's blocks are all
        held at once, so a big budget can need more blocks than ``num_blocks_needed``.
        """
        chunks, start = [], 0
        while start < num_prompt_tokens:
            size = min(max_chunk_tokens, num_prompt_tokens - start)
            chunks.append((start, size))
            start += size
        chunks.append((num_prompt_tokens, 1))
        lookahead = self.num_lookahead_tokens   # held beyond each chunk (speculative decoding)
        if lookahead and self.max_model_len is not None:
            return max(self.num_blocks_needed_for_chunk(
                start, max(min(size + lookahead, self.max_model_len - start), size)) for start, size in chunks)
        return max(self.num_blocks_needed_for_chunk(start, size + lookahead) for start, size in chunks)

    def can_fit_ever(self, num_tokens: int) -> bool:
        """Could a request of ``num_tokens`` tokens run with the pool all to itself? O(groups)."""
        return self.num_blocks_needed(num_tokens) <= self.block_pool.num_usable_blocks

    def check_can_fit_ever(self, request: Request, num_tokens: int | None = None) -> None:
        """Raise PoolTooSmallError if ``request`` (``num_tokens``, default all of
        its tokens) can never fit, even in an empty pool."""
        num_tokens = request.num_tokens if num_tokens is None else num_tokens
        if not self.can_fit_ever(num_tokens):
            raise PoolTooSmallError(request.request_id, num_tokens, self.num_blocks_needed(num_tokens),
                                    self.block_pool.num_usable_blocks, self.block_size)

    # ------------------------------------------------------------ invariants

    def check_invariants(self, extra_block_tables: Iterable[Iterable[KVCacheBlock | int]] | None = None) -> None:
        """Check the pool's accounting against every block table. O(blocks).

        ``extra_block_tables``: block lists held outside this manager (e.g. a
        test that called ``block_pool.touch`` itself); each counts as a table.
        Raises ``InvariantError`` saying what is wrong.
        """
        tables: list[Iterable[KVCacheBlock | int]] = []
        for manager in self.single_type_managers:
            tables.extend(manager.req_to_blocks.values())
        if extra_block_tables is not None:
            tables.extend(extra_block_tables)
        check_kv_cache_invariants(self.block_pool, tables)
        for manager in self.single_type_managers:
            for request_id, blocks in manager.req_to_blocks.items():
                _check_null_blocks_form_a_prefix(request_id, blocks, manager.kv_cache_group_id)


def _check_null_blocks_form_a_prefix(request_id: str, blocks: list[KVCacheBlock], group_id: int) -> None:
    seen_real = False
    for index, block in enumerate(blocks):
        if block.is_null and seen_real:
            raise InvariantError(
                f"request {request_id!r}, group {group_id}: block-table entry {index} is the null block "
                "after a real block; only positions before the sliding window may be null"
            )
        seen_real = seen_real or not block.is_null
