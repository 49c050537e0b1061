"""Property test: random sequences of cache operations never break the pool's accounting.

A hypothesis state machine admits, grows, frees and preempts requests, touches
cached blocks directly, looks up prefixes and resets the cache, on pools of 1 to
64 blocks with full-attention, sliding-window or both groups. After every
operation: ``check_invariants()``. Every computed token is "written" to a
shadow KV cache and every key a query attends to is read back, so a wrong
prefix hit or a block handed out twice fails too.
"""

from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from microvllm.core import FullAttentionSpec, KVCacheManager, SlidingWindowSpec
from tests.core.core_helpers import ShadowKVCache, first_needed_position, make_request

# Prompts share prefixes often (a few common "system prompts" cut anywhere, then
# a short random tail), so prefix hits, shared blocks and evictions are common.
COMMON_PREFIXES = [list(range(16)), [5] * 16, [1, 2] * 8]
tokens = st.builds(
    lambda prefix, cut, tail: prefix[:cut] + tail,
    st.sampled_from(COMMON_PREFIXES), st.integers(0, 16), st.lists(st.integers(0, 2), max_size=6),
).filter(bool)


class KVCacheMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(1, 64), block_size=st.integers(1, 4),
                kind=st.sampled_from(["full", "sliding", "hybrid"]), window=st.integers(1, 9),
                enable_caching=st.sampled_from([True, True, True, False]))
    def setup(self, num_blocks, block_size, kind, window, enable_caching):
        full, sliding = FullAttentionSpec(block_size), SlidingWindowSpec(block_size, window)
        self.groups = {"full": [full], "sliding": [sliding], "hybrid": [full, sliding]}[kind]
        self.block_size = block_size
        self.kv = KVCacheManager(self.groups, num_blocks, block_size, enable_caching)
        self.shadow = ShadowKVCache(block_size)
        self.live = {}  # request id -> Request holding blocks
        self.held = []  # blocks touched directly, outside any request
        self.next_id = 0

    # -------------------------------------------------------------- helpers

    def check_hit(self, request, hit_blocks, num_hit):
        bs = self.block_size
        assert num_hit % bs == 0 and num_hit <= request.num_tokens - 1
        if not self.kv.enable_caching:
            assert num_hit == 0
        for spec, blocks in zip(self.groups, hit_blocks.blocks):
            assert len(blocks) * bs == num_hit
            for index, block in enumerate(blocks):
                if block.is_null:
                    # Only blocks the next query (at num_hit) never reads may be null.
                    assert (index + 1) * bs <= first_needed_position(spec, num_hit)
                    continue
                assert block.block_hash == request.block_hashes[index]
                for pos in range(index * bs, (index + 1) * bs):
                    self.shadow.check_read(block.block_id, pos, request.all_token_ids[pos], "hit")

    def compute(self, request, num_new):
        start = request.num_computed_tokens
        self.shadow.compute(self.groups, self.kv.get_block_ids(request.request_id), request.all_token_ids,
                            start, num_new, request.request_id)
        request.num_computed_tokens += num_new

    def pick(self, data):
        return self.live[data.draw(st.sampled_from(sorted(self.live)))]

    # ---------------------------------------------------------------- rules

    @rule(prompt=tokens, chunk=st.integers(1, 20))
    def admit(self, prompt, chunk):
        request = make_request(f"r{self.next_id}", prompt, self.block_size)
        self.next_id += 1
        hit_blocks, num_hit = self.kv.get_computed_blocks(request)
        self.check_hit(request, hit_blocks, num_hit)
        num_new = min(request.num_tokens - num_hit, chunk)
        before = [(b.ref_cnt, b.block_hash, b.is_free) for b in self.kv.block_pool.blocks]
        new = self.kv.allocate_slots(request, num_new, num_hit, hit_blocks)
        if new is None:  # all or nothing
            assert [(b.ref_cnt, b.block_hash, b.is_free) for b in self.kv.block_pool.blocks] == before
            assert not any(self.kv.get_block_ids(request.request_id))
            return
        request.num_computed_tokens = num_hit
        self.compute(request, num_new)
        self.live[request.request_id] = request

    @precondition(lambda self: self.live)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 2), min_size=1, max_size=3), chunk=st.integers(1, 8))
    def grow(self, data, extra, chunk):
        """A decode (append sampled tokens) or the next prefill chunk."""
        request = self.pick(data)
        if request.num_computed_tokens == request.num_tokens:
            request.append_output_token_ids(extra)
        num_new = min(request.num_tokens - request.num_computed_tokens, chunk)
        held_before = {b.block_id for table in self.kv.get_blocks(request.request_id).blocks for b in table}
        new = self.kv.allocate_slots(request, num_new)
        if new is None:  # preempt: nothing new was taken, then everything goes back
            held_after = {b.block_id for table in self.kv.get_blocks(request.request_id).blocks for b in table}
            assert held_after <= held_before | {0}
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

    @rule(data=st.data())
    def evict_cached_free_block(self, data):
        """Memory pressure elsewhere: a free cached block is reused, leaving a gap in a cached prefix."""
        cached_free = [b for b in self.kv.block_pool.blocks if b.block_hash is not None and b.ref_cnt == 0]
        if cached_free:
            self.kv.block_pool._maybe_evict_cached_block(data.draw(st.sampled_from(cached_free)))

    @precondition(lambda self: self.held)
    @rule()
    def release_touched_block(self):
        self.kv.block_pool.free_blocks([self.held.pop()])

    @rule(prompt=tokens)
    def lookup(self, prompt):
        request = make_request("probe", prompt, self.block_size)
        self.check_hit(request, *self.kv.get_computed_blocks(request))

    @rule()
    def reset_prefix_cache(self):
        in_use = self.kv.block_pool.get_num_free_blocks() < self.kv.block_pool.num_usable_blocks
        assert self.kv.reset_prefix_cache() is (not in_use)

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
            assert self.kv.block_pool.get_num_free_blocks() == self.kv.block_pool.num_usable_blocks


KVCacheMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestKVCacheStateMachine = KVCacheMachine.TestCase
