"""The state group of a hybrid model (``MambaSpec``, ``MambaManager``): one page per
request beside the attention blocks, from the first token to the last, freed with the
request or on preemption; no prefix hits for a hybrid without state snapshots; and, under
random workloads (chunked prefill, preemption, stop rules), the fake runner's shadow
checks that every step continues exactly the state its request left (never another's)."""

from hypothesis import HealthCheck, given, settings

from microvllm.checks.scheduler import run_workload, workloads
from microvllm.core import FullAttentionSpec, KVCacheManager, MambaSpec
from tests.core.core_helpers import make_request, make_scheduler, run_steps

B = 4
HYBRID = [FullAttentionSpec(B), MambaSpec(B)]


def test_one_state_page_per_request_from_first_token_to_last():
    kv = KVCacheManager(HYBRID, 16, B)
    a = make_request("a", list(range(10)), B)
    new = kv.allocate_slots(a, 6)                    # a first chunk
    assert [len(g) for g in new.blocks] == [2, 1]
    state_page = kv.get_block_ids("a")[1]
    a.num_computed_tokens = 6
    assert [len(g) for g in kv.allocate_slots(a, 4).blocks] == [1, 0]   # the rest: no new state page
    a.num_computed_tokens = 10
    for _ in range(5):                                 # decode: one slot at a time
        a.num_computed_tokens -= 1                     # (re-allocating the last position's slot)
        kv.allocate_slots(a, 1)
        a.num_computed_tokens += 1
    assert kv.get_block_ids("a")[1] == state_page
    kv.check_invariants()
    kv.free(a)
    kv.check_invariants()
    assert kv.block_pool.get_num_free_blocks() == kv.num_usable_blocks


def test_the_pool_counts_the_state_page():
    kv = KVCacheManager(HYBRID, 4, B)                  # 3 usable blocks
    a = make_request("a", list(range(8)), B)
    assert kv.num_blocks_needed(8) == 3                # 2 attention blocks + 1 state page
    assert kv.allocate_slots(a, 8) is not None
    b = make_request("b", [1], B)
    assert kv.allocate_slots(b, 1) is None            # no room for b's attention block and state page
    kv.check_invariants()


def test_a_hybrid_gets_no_prefix_hit_where_full_attention_alone_would():
    prompt = list(range(12))
    for groups, expected in (([FullAttentionSpec(B)], 12), (HYBRID, 0)):
        kv = KVCacheManager(groups, 32, B)
        a = make_request("a", prompt, B)
        kv.allocate_slots(a, len(prompt))
        a.num_computed_tokens = len(prompt)
        kv.free(a)
        blocks, hit = kv.get_computed_blocks(make_request("b", prompt + [99], B))
        assert hit == expected, groups
        assert all(len(g) * B == hit for g in blocks.blocks)


def test_preemption_frees_the_state_and_the_request_starts_over():
    s, runner = make_scheduler(HYBRID, num_blocks=9, block_size=B, max_num_batched_tokens=8, max_model_len=40)
    for i in range(3):
        s.add_request(make_request(f"r{i}", list(range(i, i + 10)), B, max_tokens=12, ignore_eos=True))
    records = run_steps(s, runner)
    assert any(r.output.preempted_req_ids for r in records), "the pool was meant to be too small for all three"
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == s.kv_cache_manager.num_usable_blocks


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_on_a_hybrid_keep_every_state_continuous(workload):
    groups, config, requests = workload
    hybrid = [FullAttentionSpec(config["block_size"]), MambaSpec(config["block_size"])]
    # The workload's pool fits every request alone counted as its own groups' full attention;
    # a hybrid needs that for its attention group plus one page.
    run_workload((hybrid, {**config, "num_blocks": config["num_blocks"] + 1}, requests))
