"""The Router over two in-process replicas of a tiny Llama: routing is real (the tokens are the
single engine's), the report adds up, and a prefix-aware policy beats round robin on the
workload it exists for (a ratio measured here, with margin)."""

import pytest

from microvllm import LLM, SamplingParams
from microvllm.core.kv_cache_utils import maybe_convert_block_hash
from microvllm.router import BlockPoolPoller, KVEventsPolicy, Router, compare_policies, make_replicas
from microvllm.router.workload import shared_prefix_workload


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from microvllm.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("router") / "llama", "llama", seed=7)


@pytest.fixture(scope="module")
def workload():
    return shared_prefix_workload()


@pytest.fixture(scope="module")
def comparison(tiny_llama, workload):
    return compare_policies(tiny_llama, workload=workload)


def test_the_workload_is_the_one_routing_exists_for(workload):
    assert len(workload.prompts) == 48 and sorted(set(workload.prefix_of)) == list(range(6))
    prefix_blocks = workload.num_prefixes * workload.prefix_blocks
    # each replica's usable blocks hold about half the prefixes, plus room for what runs
    assert prefix_blocks // 2 < workload.num_kv_blocks - 1 < prefix_blocks


def test_prefix_aware_routing_beats_round_robin(comparison):
    print(comparison.table())
    rates = {name: comparison.hit_rate(name) for name in comparison.reports}
    assert rates["prefix_aware"] >= 1.3 * rates["round_robin"], rates
    assert rates["kv_events"] >= 1.3 * rates["round_robin"], rates
    assert rates["least_loaded"] < 1.3 * rates["round_robin"], rates   # balancing load alone does not help


def test_the_report_adds_up(comparison, workload):
    for name, report in comparison.reports.items():
        assert sum(r.requests for r in report.replicas) == len(workload.prompts), name
        assert report.prompt_tokens == sum(len(p) for p in workload.prompts), name
        assert report.hit_tokens == sum(d.hit_tokens for d in report.decisions), name
        assert all(d.reason for d in report.decisions), name
    round_robin = comparison.reports["round_robin"]
    assert [d.replica for d in round_robin.decisions] == [i % 2 for i in range(len(workload.prompts))]


def test_routed_tokens_are_the_single_engines(tiny_llama, workload):
    replicas = make_replicas(tiny_llama, 2, workload)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompts = workload.as_inputs()[:8]
    report = Router(replicas, "prefix_aware").route(prompts, params)
    single = LLM(str(tiny_llama), block_size=workload.block_size, enforce_eager=True, max_model_len=128)
    expected = [list(o.outputs[0].token_ids) for o in single.generate(prompts, params, use_tqdm=False)]
    assert [list(o.outputs[0].token_ids) for o in report.outputs] == expected
    assert {d.replica for d in report.decisions} == {0, 1}
    assert "replica" in report.table()


def test_the_block_pool_poller_feeds_kv_events(tiny_llama, workload):
    replicas = make_replicas(tiny_llama, 2, workload)
    policy = KVEventsPolicy()
    router = Router(replicas, policy)
    assert isinstance(router.kv_event_feed, BlockPoolPoller)
    router.route(workload.as_inputs()[:6], SamplingParams(temperature=0.0, max_tokens=2))
    for index, llm in enumerate(replicas):
        pool = llm.engine.kv_cache_manager.block_pool
        assert policy.cached[index] == {maybe_convert_block_hash(h)
                                        for h, group in pool.cached_block_hash_to_block if group == 0}
    replicas[0].reset_prefix_cache()
    router.kv_event_feed.poll(policy)
    assert policy.cached[0] == set() and policy.cached[1]


def test_the_router_refuses_mixed_block_sizes(tiny_llama):
    a = LLM(str(tiny_llama), block_size=4, max_model_len=64, enforce_eager=True)
    b = LLM(str(tiny_llama), block_size=8, max_model_len=64, enforce_eager=True)
    with pytest.raises(ValueError, match="same block_size"):
        Router([a, b])
