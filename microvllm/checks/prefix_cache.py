"""Checks for exercise 04: prefix hashing and ``KVCacheManager.get_computed_blocks``.

    check_hash_block_tokens(hash_block_tokens)     chained, deterministic, the engine's digests
    check_get_computed_blocks(KVCacheManager)      longest usable cached prefix, never the last token

The property test of ``get_computed_blocks`` is the KV cache state machine: hypothesis
admits, grows, frees and preempts requests, touches and evicts cached blocks, on pools of
1 to 64 blocks with full-attention, sliding-window or both groups; every hit is read
back from a shadow KV cache, so a hit on the wrong content fails.
"""

from __future__ import annotations

from microvllm.checks.fakes import make_request
from microvllm.checks.kv_cache_machine import kv_cache_machine
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
from microvllm.core import FullAttentionSpec, SlidingWindowSpec, kv_cache_utils as reference

B = 4

# The engine's hash of two chained blocks (tokens [1, 2, 3] with extra key "s", then [4, 5, 6]):
# fixed forever, so a prefix hash means the same in every process and run.
GOLDEN_DIGEST = "1665b54b504f243c116dc7ffa24cf9cc1d4b782f8017d35c8b6ab3dc7a8aa816"

_SCHEME = ("sha256(bytes(parent) + struct.pack(f'<{len(token_ids)}q', *token_ids)), plus "
           "b'|' + _encode_extra_keys(extra_keys) when there are extra keys; parent None means "
           "ROOT_BLOCK_HASH; wrap the digest in BlockHash(...)")


# ====================================================================== hashing


def check_hash_block_tokens(hash_block_tokens, *, max_examples: int = 100,
                            quiet: bool = False) -> CheckResult:
    """Check a ``hash_block_tokens(parent, token_ids, extra_keys=None)`` implementation."""

    def show(*args) -> str:
        return "hash_block_tokens(" + ", ".join(repr(a) for a in args) + ")"

    def is_a_block_hash():
        h = hash_block_tokens(None, [1, 2, 3, 4])
        if type(h).__name__ == "BlockHash" and not isinstance(h, reference.BlockHash):
            raise CheckFailure("the hash is a BlockHash of another class of that name (its module was "
                               "imported or defined twice)", input=show(None, [1, 2, 3, 4]),
                               hint="use microvllm.core.kv_cache_utils.BlockHash (the engine's), and do not "
                                    "redefine it or reload its module")
        expect(isinstance(h, reference.BlockHash) and len(h) == 32,
               "the hash must be a BlockHash of 32 bytes (a sha256 digest)", input=show(None, [1, 2, 3, 4]),
               got=f"{type(h).__name__} of length {len(h) if hasattr(h, '__len__') else '?'}",
               hint="return BlockHash(hashlib.sha256(payload).digest())")
        expect_equal(hash_block_tokens(None, [1, 2, 3, 4]), h, "the same input must give the same hash",
                     input=show(None, [1, 2, 3, 4]) + " twice")

    def root_parent():
        expect_equal(hash_block_tokens(reference.ROOT_BLOCK_HASH, [1, 2]), hash_block_tokens(None, [1, 2]),
                     "parent None must mean ROOT_BLOCK_HASH (the first block's parent)",
                     input=show(None, [1, 2]) + " vs the same with ROOT_BLOCK_HASH",
                     hint="parent = ROOT_BLOCK_HASH if parent_block_hash is None else parent_block_hash")

    def chained():
        h0 = hash_block_tokens(None, [1, 2, 3, 4])
        h1 = hash_block_tokens(h0, [5, 6, 7, 8])
        expect(h1 != hash_block_tokens(None, [5, 6, 7, 8]),
               "the same tokens after another prefix must hash differently",
               input="hash(h0, [5, 6, 7, 8]) vs hash(None, [5, 6, 7, 8])", got="the same hash",
               hint="put the parent's bytes first in what you hash: the hash then names the whole prefix")

    def tokens_matter():
        pairs = [([1, 2, 3, 4], [1, 2, 3, 5]), ([1, 2], [2, 1]), ([1], [1, 0]), ([256], [1, 1]),
                 ([0], [])]
        for a, b in pairs:
            expect(hash_block_tokens(None, a) != hash_block_tokens(None, b),
                   "different token lists must hash differently", input=f"{a} vs {b}", got="the same hash",
                   hint="pack every token id as a fixed-width int64 ('<q'), so that [256] and [1, 1] "
                        "or [1] and [1, 0] give different bytes")

    def extra_keys_matter():
        plain = hash_block_tokens(None, [1, 2])
        expect(hash_block_tokens(None, [1, 2], ("salt",)) != plain, "extra keys (a cache salt) must change "
               "the hash", input=show(None, [1, 2], ("salt",)), got="the hash without extra keys",
               hint="append b'|' + _encode_extra_keys(extra_keys) when extra_keys is not empty")
        expect(hash_block_tokens(None, [1], ("ab", "c")) != hash_block_tokens(None, [1], ("a", "bc")),
               "extra keys ('ab', 'c') and ('a', 'bc') must hash differently", got="the same hash",
               hint="use _encode_extra_keys: it prefixes each key with its type and length")

    def engine_digest():
        got = hash_block_tokens(hash_block_tokens(None, [1, 2, 3], ("s",)), [4, 5, 6])
        expect_equal(got.hex() if hasattr(got, "hex") else got, GOLDEN_DIGEST,
                     "the digest must be the engine's exact one (stable across processes and runs)",
                     input="hash_block_tokens(hash_block_tokens(None, [1, 2, 3], ('s',)), [4, 5, 6]).hex()",
                     hint="not Python's hash() (salted per process); hash exactly " + _SCHEME)

    def random_inputs():
        from hypothesis import given, strategies as st

        tokens = st.lists(st.integers(0, 2**31 - 1), max_size=8)
        extra = st.one_of(st.none(), st.lists(st.one_of(st.text(max_size=4), st.integers(-5, 5)),
                                              max_size=2).map(tuple))

        @property_settings(max_examples)
        @given(st.lists(st.tuples(tokens, extra), min_size=1, max_size=4))
        def test(blocks):
            parent = expected_parent = None
            for token_ids, extra_keys in blocks:
                parent = hash_block_tokens(parent, token_ids, extra_keys)
                expected_parent = reference.hash_block_tokens(expected_parent, token_ids, extra_keys)
                if parent != expected_parent:
                    raise CheckFailure("a chain of blocks hashed differently from the engine",
                                       input=f"blocks (token_ids, extra_keys) = {blocks}",
                                       expected=repr(expected_parent), got=repr(parent),
                                       hint="hash exactly " + _SCHEME)

        run_property(test)

    cases = [
        Case("returns a 32-byte BlockHash, the same for the same input", is_a_block_hash),
        Case("parent None means ROOT_BLOCK_HASH", root_parent),
        Case("the parent's hash is chained in", chained),
        Case("every token id and its position count", tokens_matter),
        Case("extra keys (cache salt) count, unambiguously", extra_keys_matter),
        Case("the digest is the engine's (stable across processes)", engine_digest),
        Case(f"property: {max_examples} random chains hash like the engine", random_inputs),
    ]
    return run_checks("check_hash_block_tokens", cases, quiet=quiet)


# ======================================================================== hits

HIT_HINTS = [
    (r"holds \(token, position\)",
     "a hit block must hold exactly the tokens of the new request at that place: look blocks "
     "up by request.block_hashes[i], from the first block on, and stop at the first miss"),
    (r"num_hit|hit of", "the hit is a whole number of blocks and at most num_tokens - 1 tokens"),
]


def check_get_computed_blocks(manager_class, *, max_examples: int = 60,
                              quiet: bool = False) -> CheckResult:
    """Check ``get_computed_blocks`` of a ``KVCacheManager`` subclass (or a whole class)."""

    def manager(groups=None, num_blocks=16, enable_caching=True):
        return manager_class(groups or [FullAttentionSpec(B)], num_blocks, B, enable_caching)

    def admit(kv, request):
        hit_blocks, num_hit = kv.get_computed_blocks(request)
        kv.allocate_slots(request, request.num_tokens - num_hit, num_hit, hit_blocks)
        request.num_computed_tokens = request.num_tokens

    def lookup(kv, request, what):
        result = kv.get_computed_blocks(request)
        ok = isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], int)
        expect(ok, "get_computed_blocks() must return (KVCacheBlocks, number of hit tokens)",
               input=what, got=repr(result))
        return result

    def hit(kv, prompt, name="b", **kwargs):
        request = make_request(name, prompt, B, **kwargs)
        blocks, num_hit = lookup(kv, request, f"request {name!r} with {len(prompt)} tokens")
        return request, blocks, num_hit

    def never_the_last_token():
        kv = manager()
        admit(kv, make_request("a", list(range(8)), B))
        _, blocks, num_hit = hit(kv, list(range(8)))
        if num_hit in (0, 1) and len(blocks.blocks[0]) <= 1:   # counted in blocks, not tokens
            hint = ("the hit is counted in tokens: hit blocks x block_size (one block of 4 = 4 tokens), "
                    "and every group's hit is compared in tokens too")
        else:
            hint = "look up at most (num_tokens - 1) // block_size blocks: here 7 // 4 = 1"
        expect_equal(num_hit, 4, "a hit must never cover the last token (it is recomputed for its logits)"
                     if num_hit > 4 else "8 cached tokens must hit one full block (4 tokens): the last is recomputed",
                     input="request a = tokens 0..7 (2 full blocks of 4) admitted; request b = the same 8 tokens",
                     hint=hint)
        expect_equal(blocks.get_block_ids(), ([1],), "the hit blocks (one list per cache group)",
                     input="the same 8 tokens")
        _, _, num_hit = hit(kv, list(range(9)), "c")
        expect_equal(num_hit, 8, "9 tokens whose first 8 are cached must hit 8",
                     input="request c = tokens 0..8")

    def freed_blocks_still_hit():
        kv = manager()
        a = make_request("a", list(range(9)), B)
        admit(kv, a)
        kv.free(a)
        _, blocks, num_hit = hit(kv, list(range(9)))
        expect_equal((num_hit, blocks.get_block_ids()), (8, ([1, 2],)),
                     "a finished request's blocks sit free in the queue but must still hit",
                     input="a = tokens 0..8 admitted and freed; b = the same tokens",
                     hint="get_cached_block() finds free cached blocks too")

    def resumed_after_preemption():
        kv = manager()
        a = make_request("a", list(range(5)), B)
        admit(kv, a)
        for token in range(5, 13):   # 8 generated tokens, one decode step each
            a.append_output_token_ids(token)
            kv.allocate_slots(a, 1)
            a.num_computed_tokens += 1
        kv.free(a)                   # preempted: its blocks are freed, their hashes stay
        a.num_computed_tokens = 0
        blocks, num_hit = lookup(kv, a, "request a again")
        expect_equal((num_hit, blocks.get_block_ids()), (12, ([1, 2, 3],)),
                     "a request resumed after preemption hits its generated tokens' blocks too",
                     input="a = 5 prompt tokens + 8 generated (13 tokens, blocks 0..3, 4..7, 8..11 full "
                           "and cached), preempted, then looked up again",
                     hint="the hit is capped by request.num_tokens - 1 (prompt AND output tokens), not by "
                          "the prompt's length: a resumed request recomputes everything it does not hit")

    def stops_at_the_first_miss():
        kv = manager()
        a = make_request("a", list(range(12)), B)
        admit(kv, a)
        kv.free(a)
        kv.block_pool._maybe_evict_cached_block(kv.block_pool.blocks[2])
        _, blocks, num_hit = hit(kv, list(range(12)) + [99])
        expect_equal((num_hit, blocks.get_block_ids()), (4, ([1],)),
                     "a hit must stop at the first missing block",
                     input="blocks of tokens 0..3, 4..7, 8..11 cached, then the middle one evicted",
                     hint="block 8..11 is useless without the KV of 4..7 before it: break at the first miss")

    def no_touching():
        kv = manager()
        a = make_request("a", list(range(9)), B)
        admit(kv, a)
        kv.free(a)
        before = [(blk.ref_cnt, blk.is_free) for blk in kv.block_pool.blocks]
        hit(kv, list(range(9)))
        expect([(blk.ref_cnt, blk.is_free) for blk in kv.block_pool.blocks] == before,
               "get_computed_blocks() must not touch the blocks (allocate_slots does that)",
               input="a lookup of cached free blocks", got="ref counts or the free queue changed")

    def caching_off_and_salt():
        kv = manager(enable_caching=False)
        admit(kv, make_request("a", list(range(9)), B))
        expect_equal(hit(kv, list(range(9)))[2], 0, "with enable_caching=False there are no hits",
                     hint="return self.create_empty_block_list(), 0 when caching is off")
        kv = manager()
        admit(kv, make_request("a", list(range(9)), B, cache_salt="alice"))
        expect_equal(hit(kv, list(range(9)), cache_salt="bob")[2], 0,
                     "another cache salt must not hit", input="a salted 'alice', b salted 'bob'")

    def groups_agree():
        groups = [FullAttentionSpec(B), SlidingWindowSpec(B, 5)]
        kv = manager(groups, 64)
        a = make_request("a", list(range(20)), B)
        admit(kv, a)
        kv.free(a)
        pool = kv.block_pool
        pool._maybe_evict_cached_block(pool.get_cached_block(a.block_hashes[3], 1))
        _, blocks, num_hit = hit(kv, list(range(20)) + [1])
        what = "full + sliding-window (W=5) groups; 5 blocks cached, block 3 evicted in the sliding group"
        expect_equal((num_hit, [len(g) for g in blocks.blocks]), (20, [5, 5]),
                     "each group's hit has the same length", input=what,
                     hint="ask every manager's find_longest_cache_hit(request.block_hashes, max_length)")
        pool._maybe_evict_cached_block(pool.get_cached_block(a.block_hashes[4], 0))
        _, blocks, num_hit = hit(kv, list(range(20)) + [1])
        expect_equal((num_hit, [len(g) for g in blocks.blocks]), (12, [3, 3]),
                     "groups that disagree must all retry at the shortest hit",
                     input=what + "; then block 4 evicted in the full group",
                     hint="the full group stops at 16 tokens; at 16 the sliding group needs block 3, "
                          "which is gone: retry every group at the shortest length until all agree")

    def random_workloads():
        from hypothesis.stateful import run_state_machine_as_test

        machine = type("KVCacheMachine", (kv_cache_machine(),), {"manager_class": manager_class})
        run_property(lambda: run_state_machine_as_test(
            machine, settings=property_settings(max_examples, stateful_step_count=25)))

    cases = [
        Case("a hit never covers the last token", never_the_last_token),
        Case("freed blocks that keep their hash still hit", freed_blocks_still_hit),
        Case("a request resumed after preemption hits its output tokens too", resumed_after_preemption),
        Case("a hit stops at the first missing block", stops_at_the_first_miss),
        Case("a lookup touches nothing", no_touching),
        Case("no hits with caching off, or with another cache salt", caching_off_and_salt),
        Case("several cache groups agree on the shortest hit", groups_agree),
        Case(f"property: {max_examples} random workloads read back the right KV", random_workloads),
    ]
    return run_checks("check_get_computed_blocks", cases, HIT_HINTS, quiet=quiet)
