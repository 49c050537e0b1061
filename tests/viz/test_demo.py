"""The demo traces show what they claim to show (they are the plots' fixtures)."""

import pytest

from microvllm.viz.demo import EOS_TOKEN_ID, QUESTIONS, SYSTEM, Arrival, demo_trace, large_demo_trace, simulate


def test_prefix_trace_shares_blocks_and_hits_cached_free_blocks():
    trace = demo_trace("prefix")
    hits = {r.request_id: (s.step, r.prefix_hit_tokens) for s in trace for r in s.scheduled if r.prefix_hit_tokens}
    assert set(hits) == {"r1", "r3"}
    assert max(max(s.ref_cnts) for s in trace) == 2                  # r0 and r1 share their prefix
    step_r3 = hits["r3"][0]
    before = trace[step_r3 - 1]                                       # r3's hit came from free, cached blocks
    hit_blocks = trace[step_r3].block_tables["r3"][0][: hits["r3"][1] // trace.block_size]
    assert all(before.free[b] and before.block_hashes[b] for b in hit_blocks)
    assert {rid: why for s in trace for rid, why in s.finish_reasons.items()} == {
        "r0": "length", "r1": "stop", "r2": "length", "r3": "length"}
    r1_tokens = [t for s in trace for t in s.new_tokens.get("r1", [])]
    assert len(r1_tokens) == 5 and r1_tokens[-1] == EOS_TOKEN_ID      # "stop": its 5th token was eos
    assert all(s.scheduled for s in trace)                            # no idle steps


def test_preemption_trace_preempts_the_newest_then_resumes_with_cache_hits():
    trace = demo_trace("preemption")
    preempted = [(i, rid) for i, s in enumerate(trace) for rid in s.preempted]
    assert len(preempted) >= 2
    assert min(s.num_free_blocks for s in trace) == 0                 # the pool ran dry
    for i, rid in preempted:
        running_before = list(trace[i - 1].block_tables)              # in admission order
        assert rid in running_before[-len(trace[i].preempted):]       # the newest ones give way
        assert not any(r.is_new for r in trace[i].scheduled)          # nobody admitted while preempting
        assert rid in trace[i].waiting and rid not in trace[i].block_tables
        resumed = next(r for s in trace.steps[i + 1:] for r in s.scheduled if r.request_id == rid)
        assert resumed.is_new and resumed.kind == "prefill" and resumed.prefix_hit_tokens > 0
    finished = {rid for s in trace for rid in s.finished}
    assert finished == {"r0", "r1", "r2", "r3"}                       # preempted ones still finish


@pytest.mark.parametrize("hybrid", [False, True])
def test_sliding_window_trace_releases_blocks_to_the_null_block(hybrid):
    trace = demo_trace("sliding_window", hybrid=hybrid)
    trace.check_consistency()
    group = trace.kv_cache_groups.index("sliding_window")
    nulls = [t[group].count(0) for s in trace for t in s.block_tables.values()]
    assert max(nulls) >= 2
    if hybrid:                                                        # full attention keeps every block
        assert all(0 not in t[0] for s in trace for t in s.block_tables.values())
    assert any(s.free[b] and s.block_hashes[b] for s in trace for b in range(trace.num_blocks))


def test_chunked_trace_splits_a_long_prompt_and_mixes_prefill_with_decode():
    trace = demo_trace("chunked")
    chunks = [r for s in trace for r in s.scheduled if r.request_id == "r1" and r.kind == "prefill"]
    assert len(chunks) >= 3 and sum(r.num_scheduled_tokens for r in chunks) == chunks[0].num_prompt_tokens
    assert any({r.kind for r in s.scheduled} == {"prefill", "decode"} for s in trace)
    assert any(s.num_scheduled_tokens == s.token_budget for s in trace)


def test_large_trace_has_hundreds_of_steps_and_blocks():
    trace = large_demo_trace()
    trace.check_consistency()
    assert len(trace) >= 200 and trace.num_blocks >= 200 and trace.preemption_steps()


def test_seed_changes_the_sampled_tokens_not_the_schedule():
    a, b = demo_trace("preemption"), demo_trace("preemption", seed=1)
    assert a == demo_trace("preemption")                              # deterministic
    assert [s.new_tokens for s in a] != [s.new_tokens for s in b]
    assert [(s.scheduled, s.preempted, s.block_tables) for s in a] == [(s.scheduled, s.preempted, s.block_tables)
                                                                       for s in b]


def test_simulate_without_prefix_caching_has_no_hits_and_no_cached_blocks():
    arrivals = [Arrival(f"r{i}", f"{SYSTEM} {QUESTIONS[i]}", 4, i) for i in range(3)]
    settings = dict(block_size=4, num_blocks=24, max_num_batched_tokens=32, max_num_seqs=4)
    cached = simulate(arrivals, **settings)
    assert any(r.prefix_hit_tokens for s in cached for r in s.scheduled)
    plain = simulate(arrivals, enable_prefix_caching=False, **settings)
    plain.check_consistency()
    assert not any(r.prefix_hit_tokens for s in plain for r in s.scheduled)
    assert all(h is None for s in plain for h in s.block_hashes) and max(max(s.ref_cnts) for s in plain) == 1


def test_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="choose one of"):
        demo_trace("beam_search")
