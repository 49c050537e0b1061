"""The state group of a hybrid model (``MambaSpec``, ``MambaManager``): a page per block
of tokens, only the last one or two held; full blocks' pages are snapshots of the state,
registered once computed and hit where every group can resume; freed with the request or
on preemption. Under random workloads (chunked prefill, preemption, prefix hits, stop
rules) the fake runner's shadow checks that every step resumes exactly the state its
request left (or the snapshot of exactly its prefix), never another's."""

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from microvllm.checks.scheduler import run_workload, workloads
from microvllm.core import FullAttentionSpec, KVCacheManager, MambaSpec
from tests.core.core_helpers import make_request, make_scheduler, run_steps

B = 4
HYBRID = [FullAttentionSpec(B), MambaSpec(B)]


def ids(kv, rid):
    return kv.get_block_ids(rid)


def test_state_pages_slide_with_the_request():
    kv = KVCacheManager(HYBRID, 16, B)
    a = make_request("a", list(range(10)), B)
    new = kv.allocate_slots(a, 6)                      # first chunk: tokens 0..5
    assert [len(g) for g in new.blocks] == [2, 2]      # a state page per block it reaches
    a.num_computed_tokens = 6
    kv.allocate_slots(a, 4)                            # tokens 6..9: reads the page of block 1
    table = ids(kv, "a")[1]
    assert table[0] == 0 and 0 not in table[1:] and len(table) == 3   # page 0 released
    for position in (10, 11, 12):                      # decode: sample a token, compute it
        a.append_output_token_ids(position)
        a.num_computed_tokens = position
        kv.allocate_slots(a, 1)
        if position == 10:                             # same block as token 9
            assert len(ids(kv, "a")[1]) == 3
    held = [p for p in ids(kv, "a")[1] if p]           # token 12 starts block 3: reads page 2, writes 3
    assert len(held) == 2
    kv.check_invariants()
    kv.free(a)
    kv.check_invariants()
    assert kv.block_pool.get_num_free_blocks() == kv.num_usable_blocks


def test_the_pool_counts_state_pages():
    kv = KVCacheManager(HYBRID, 6, B)                  # 5 usable blocks
    assert kv.num_blocks_needed(8) == 2 + 2            # one token at a time: 2 attention blocks, 2 pages
    assert kv.num_blocks_to_start(8, 8) == 3 + 2       # a whole 8-token prompt, then its first new token
    a = make_request("a", list(range(8)), B)
    assert kv.allocate_slots(a, 8) is not None
    assert kv.allocate_slots(make_request("b", [1], B), 1) is None
    kv.check_invariants()


def finish(kv, prompt, rid="a"):
    a = make_request(rid, prompt, B)
    kv.allocate_slots(a, len(prompt))
    a.num_computed_tokens = len(prompt)
    kv.free(a)


@pytest.mark.parametrize("prefix_caching,expected", [(True, 12), (False, 0)])
def test_a_hybrid_hits_where_a_snapshot_ends(prefix_caching, expected):
    kv = KVCacheManager([FullAttentionSpec(B), MambaSpec(B, prefix_caching)], 32, B)
    prompt = list(range(12))
    finish(kv, prompt)
    blocks, hit = kv.get_computed_blocks(make_request("b", prompt + [99], B))
    assert hit == expected
    assert all(len(g) * B == hit for g in blocks.blocks)
    if hit:   # the state group's hit is the snapshot at its end, nulls before it
        assert [b.is_null for b in blocks.blocks[1]] == [True, True, False]
    kv.check_invariants()


def test_no_snapshot_before_its_state_is_computed():
    """Attention registers a block when it is scheduled; a state page only once computed."""
    kv = KVCacheManager(HYBRID, 32, B)
    a = make_request("a", list(range(12)), B)
    kv.allocate_slots(a, 12)                           # scheduled, not yet computed
    _, hit = kv.get_computed_blocks(make_request("b", list(range(12)) + [7], B))
    assert hit == 0
    a.num_computed_tokens = 12                         # the step ran
    kv.allocate_slots(a, 1)                            # a's next step registers its snapshots
    _, hit = kv.get_computed_blocks(make_request("c", list(range(12)) + [7], B))
    assert hit == 12


def test_the_hit_stops_at_the_last_snapshot_attention_agrees_with():
    kv = KVCacheManager(HYBRID, 32, B)
    finish(kv, list(range(9)))                         # snapshots at 4 and 8
    _, hit = kv.get_computed_blocks(make_request("b", list(range(8)) + [50, 51, 52, 53, 54], B))
    assert hit == 8
    _, hit = kv.get_computed_blocks(make_request("c", list(range(6)), B))   # shorter than 2 blocks
    assert hit == 4


def test_preemption_frees_the_state_and_the_request_starts_over():
    s, runner = make_scheduler(HYBRID, num_blocks=9, block_size=B, max_num_batched_tokens=8, max_model_len=40)
    for i in range(3):
        s.add_request(make_request(f"r{i}", list(range(i, i + 10)), B, max_tokens=12, ignore_eos=True))
    records = run_steps(s, runner)
    assert any(r.output.preempted_req_ids for r in records), "the pool was meant to be too small for all three"
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == s.kv_cache_manager.num_usable_blocks


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(kinds=("mamba_hybrid",)))
def test_random_workloads_on_a_hybrid_keep_every_state_continuous(workload):
    run_workload(workload)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_arrivals_and_aborts_on_a_hybrid_keep_the_pool_and_every_state_right(data):
    """Requests arrive between steps (many sharing prefixes, so snapshots get hit), some are
    aborted while waiting or running, the pool is small enough to preempt; after every step
    the pool's accounting and every block table are checked (``run_steps``), the fake runner
    checks every state read, and at the end every block is free."""
    block_size = data.draw(st.integers(1, 4), "block_size")
    groups = [FullAttentionSpec(block_size), MambaSpec(block_size, data.draw(st.booleans(), "snapshots"))]
    max_model_len = 32
    num_blocks = 2 * -(-(max_model_len + 1) // block_size) + 2 + data.draw(st.integers(0, 8), "extra blocks")
    s, runner = make_scheduler(groups, num_blocks=num_blocks, block_size=block_size,
                               max_num_batched_tokens=data.draw(st.integers(2, 24), "budget"),
                               max_model_len=max_model_len, max_num_seqs=data.draw(st.integers(1, 4), "max_num_seqs"))
    prefixes = [[3] * 12, list(range(12)), [7, 8] * 6]
    next_id = 0
    for _ in range(data.draw(st.integers(1, 30), "steps")):
        for _ in range(data.draw(st.integers(0, 2), "arrivals")):
            prompt = prefixes[data.draw(st.integers(0, 2))][:data.draw(st.integers(0, 12))] + \
                data.draw(st.lists(st.integers(0, 5), max_size=8))
            s.add_request(make_request(f"r{next_id}", prompt or [1], block_size,
                                       max_tokens=data.draw(st.integers(1, 10)), ignore_eos=True))
            next_id += 1
        if s.requests and data.draw(st.integers(0, 4), "abort?") == 0:
            s.finish_requests(data.draw(st.sampled_from(sorted(s.requests)), "aborted"))
            s.check_invariants()
        run_steps(s, runner, until_done=False, num_steps=1)
    run_steps(s, runner, max_steps=2000)
    kv = s.kv_cache_manager
    kv.check_invariants()
    assert kv.block_pool.get_num_free_blocks() == kv.num_usable_blocks


def test_a_request_computed_past_its_tokens_registers_only_its_full_blocks():
    """A stop can leave num_computed_tokens one past the request's tokens (the stopping
    token was computed, then not kept): only blocks of its tokens have hashes."""
    kv = KVCacheManager(HYBRID, 32, B)
    a = make_request("a", list(range(7)), B)
    kv.allocate_slots(a, 8)
    a.num_computed_tokens = 8                          # one past its 7 tokens: a block boundary
    kv.free(a)                                         # registers 1 snapshot, not 2
    kv.check_invariants()
    _, hit = kv.get_computed_blocks(make_request("b", list(range(7)) + [1, 2], B))
    assert hit == 4
