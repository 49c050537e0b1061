"""The KV cache property test: a hypothesis state machine over random workloads.

It admits, grows, frees and preempts requests, touches and evicts cached blocks, looks up
prefixes and resets the cache, on pools of 1 to 64 blocks with full-attention,
sliding-window or both groups. Every computed token is "written" to a shadow KV cache and
every key a query attends to (prefix hits included) is read back, and the pool's
accounting is checked after every operation. ``manager_class`` is the KV cache manager
under test: a learner's subclass (exercise 04's checker), or the engine's own
(``tests/core/test_kv_cache_stateful.py`` runs this same machine).
"""

from __future__ import annotations

import functools

from microvllm.checks.fakes import ShadowKVCache, first_needed_position, make_request
from microvllm.checks.report import CheckFailure, expect_equal
from microvllm.core import FullAttentionSpec, KVCacheManager, SlidingWindowSpec


@functools.cache
def kv_cache_machine():
    """The hypothesis state machine class (built on first use: hypothesis is imported lazily)."""
    from hypothesis import strategies as st
    from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

    # Prompts share prefixes often, so hits, shared blocks and evictions are common.
    common_prefixes = [list(range(16)), [5] * 16, [1, 2] * 8]
    tokens = st.builds(lambda prefix, cut, tail: prefix[:cut] + tail, st.sampled_from(common_prefixes),
                       st.integers(0, 16), st.lists(st.integers(0, 2), max_size=6)).filter(bool)

    class Machine(RuleBasedStateMachine):
        """Random KV cache workloads; ``manager_class`` is set by the checker."""

        manager_class = KVCacheManager

        @initialize(num_blocks=st.integers(1, 64), block_size=st.integers(1, 4),
                    kind=st.sampled_from(["full", "sliding", "hybrid"]), window=st.integers(1, 9),
                    enable_caching=st.sampled_from([True, True, True, False]))
        def setup(self, num_blocks, block_size, kind, window, enable_caching):
            full, sliding = FullAttentionSpec(block_size), SlidingWindowSpec(block_size, window)
            self.groups = {"full": [full], "sliding": [sliding], "hybrid": [full, sliding]}[kind]
            self.block_size = block_size
            self.kv = self.manager_class(self.groups, num_blocks, block_size, enable_caching)
            self.shadow = ShadowKVCache(block_size)
            self.live = {}
            self.held = []
            self.next_id = 0

        def check_hit(self, request, hit_blocks, num_hit):
            bs = self.block_size
            where = f"get_computed_blocks(request with tokens {request.all_token_ids})"
            if num_hit % bs or num_hit > request.num_tokens - 1:
                raise CheckFailure("the hit must be whole blocks and at most num_tokens - 1 tokens",
                                   input=where, got=f"{num_hit} hit tokens")
            if not self.kv.enable_caching and num_hit:
                raise CheckFailure("a hit with caching off", input=where, got=f"{num_hit} hit tokens")
            for spec, blocks in zip(self.groups, hit_blocks.blocks):
                if len(blocks) * bs != num_hit:
                    raise CheckFailure("a group's hit blocks do not cover exactly the hit tokens", input=where,
                                       got=f"{len(blocks)} blocks of {bs} for {num_hit} tokens")
                for index, block in enumerate(blocks):
                    if block.is_null:
                        assert (index + 1) * bs <= first_needed_position(spec, num_hit), (
                            f"{where}: hit block {index} is null but the next query reads it")
                        continue
                    if block.block_hash != request.block_hashes[index]:
                        raise CheckFailure(f"hit block {index} holds another prefix's hash", input=where,
                                           expected=request.block_hashes[index], got=block.block_hash)
                    for pos in range(index * bs, (index + 1) * bs):
                        self.shadow.check_read(block.block_id, pos, request.all_token_ids[pos], where)

        def compute(self, request, num_new):
            start = request.num_computed_tokens
            self.shadow.compute(self.groups, self.kv.get_block_ids(request.request_id), request.all_token_ids,
                                start, num_new, request.request_id)
            request.num_computed_tokens += num_new

        def pick(self, data):
            return self.live[data.draw(st.sampled_from(sorted(self.live)))]

        @rule(prompt=tokens, chunk=st.integers(1, 20))
        def admit(self, prompt, chunk):
            request = make_request(f"r{self.next_id}", prompt, self.block_size)
            self.next_id += 1
            hit_blocks, num_hit = self.kv.get_computed_blocks(request)
            self.check_hit(request, hit_blocks, num_hit)
            num_new = min(request.num_tokens - num_hit, chunk)
            before = [(b.ref_cnt, b.block_hash, b.is_free) for b in self.kv.block_pool.blocks]
            if self.kv.allocate_slots(request, num_new, num_hit, hit_blocks) is None:
                # All or nothing: a refused allocation leaves the pool as it was.
                if [(b.ref_cnt, b.block_hash, b.is_free) for b in self.kv.block_pool.blocks] != before:
                    raise CheckFailure("allocate_slots returned None but changed the pool",
                                       input=f"a new request of {request.num_tokens} tokens, {num_new} to compute")
                if any(self.kv.get_block_ids(request.request_id)):
                    raise CheckFailure("allocate_slots returned None but the request holds blocks")
                return
            request.num_computed_tokens = num_hit
            self.compute(request, num_new)
            self.live[request.request_id] = request

        @precondition(lambda self: self.live)
        @rule(data=st.data(), extra=st.lists(st.integers(0, 2), min_size=1, max_size=3),
              chunk=st.integers(1, 8))
        def grow(self, data, extra, chunk):
            request = self.pick(data)
            if request.num_computed_tokens == request.num_tokens:
                request.append_output_token_ids(extra)
            num_new = min(request.num_tokens - request.num_computed_tokens, chunk)
            held_before = {b.block_id for table in self.kv.get_blocks(request.request_id).blocks for b in table}
            if self.kv.allocate_slots(request, num_new) is None:   # preempt: nothing new was taken
                held_after = {b.block_id for table in self.kv.get_blocks(request.request_id).blocks for b in table}
                if not held_after <= held_before | {0}:
                    raise CheckFailure("allocate_slots returned None but the request gained blocks",
                                       expected=sorted(held_before), got=sorted(held_after))
                self.kv.free(request)
                del self.live[request.request_id]
                return
            self.compute(request, num_new)

        @precondition(lambda self: self.live)
        @rule(data=st.data())
        def free(self, data):
            request = self.pick(data)
            self.kv.free(request)
            del self.live[request.request_id]

        @rule(data=st.data())
        def touch_cached_block(self, data):
            cached = [b for b in self.kv.block_pool.blocks if b.block_hash is not None]
            if cached:
                block = data.draw(st.sampled_from(cached))
                self.kv.block_pool.touch([block])
                self.held.append(block)

        @precondition(lambda self: self.held)
        @rule()
        def release_touched_block(self):
            self.kv.block_pool.free_blocks([self.held.pop()])

        @rule()
        def reset_prefix_cache(self):
            in_use = self.kv.block_pool.get_num_free_blocks() < self.kv.block_pool.num_usable_blocks
            if self.kv.reset_prefix_cache() is in_use:
                raise CheckFailure("reset_prefix_cache() must succeed exactly when no block is in use",
                                   expected=not in_use, got=not in_use)

        @rule(data=st.data())
        def evict_cached_free_block(self, data):
            """Memory pressure elsewhere: a free cached block is reused, leaving a gap in a cached prefix."""
            cached_free = [b for b in self.kv.block_pool.blocks if b.block_hash is not None and b.ref_cnt == 0]
            if cached_free:
                self.kv.block_pool._maybe_evict_cached_block(data.draw(st.sampled_from(cached_free)))

        @rule(prompt=tokens)
        def lookup(self, prompt):
            request = make_request("probe", prompt, self.block_size)
            self.check_hit(request, *self.kv.get_computed_blocks(request))

        @invariant()
        def accounting_holds(self):
            if hasattr(self, "kv"):
                self.kv.check_invariants(extra_block_tables=[self.held])

        def teardown(self):
            if hasattr(self, "kv"):
                for request in list(self.live.values()):
                    self.kv.free(request)
                self.kv.block_pool.free_blocks(self.held)
                self.kv.check_invariants()
                expect_equal(self.kv.block_pool.get_num_free_blocks(), self.kv.block_pool.num_usable_blocks,
                             "every block is free once every request is freed")

    return Machine
