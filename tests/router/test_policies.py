"""The policies on hand-made replica states, the prefix tree, and the KV event feed."""

from microvllm.checks.prefix_router import OTHER, REQUEST, H, make_request, replica
from microvllm.router import (
    ApproximatePrefixTree,
    KVEventsPolicy,
    LeastLoadedPolicy,
    PrefixAwarePolicy,
    RoundRobinPolicy,
    make_policy,
)
from microvllm.router.policy import ReplicaState


def test_round_robin_cycles_whatever_the_state():
    policy = RoundRobinPolicy()
    states = [replica(0, H, running=9), replica(1), replica(2)]
    assert [policy.choose(REQUEST, states).replica for _ in range(5)] == [0, 1, 2, 0, 1]


def test_least_loaded_counts_requests_then_kv_usage_then_index():
    policy = LeastLoadedPolicy()
    assert policy.choose(REQUEST, [replica(0, running=2), replica(1, waiting=1)]).replica == 1
    assert policy.choose(REQUEST, [replica(0, running=1, usage=0.5), replica(1, waiting=1, usage=0.25)]).replica == 1
    assert policy.choose(REQUEST, [ReplicaState(0), ReplicaState(1)]).replica == 0


def test_prefix_aware_follows_its_own_decisions_and_balances():
    policy = PrefixAwarePolicy(balance_abs_threshold=2, balance_rel_threshold=1.5)
    idle = [replica(0), replica(1)]
    first = policy.choose(REQUEST, idle)
    assert first.replica == 0 and first.matched_blocks == 0
    policy.on_routed(REQUEST, first)
    again = policy.choose(REQUEST, [replica(0, running=2), replica(1)])   # 2 - 0 is not > 2: stays
    assert (again.replica, again.matched_blocks) == (0, 4), again
    busy = policy.choose(REQUEST, [replica(0, running=3), replica(1)])    # both thresholds crossed
    assert busy.replica == 1 and "overloaded" in busy.reason
    other = make_request(list(range(100, 112)))
    assert policy.choose(other, [replica(0), replica(1, running=1)]).matched_blocks == 0


def test_the_tree_matches_by_chain_and_forgets_the_oldest_leaf_first():
    tree = ApproximatePrefixTree(2, max_blocks=5)
    tree.insert(0, H)                  # 4 blocks
    tree.insert(1, H[:2])
    assert tree.match(H) == [4, 2]
    assert tree.match(OTHER) == [0, 0]
    tree.insert(0, OTHER[:2])          # 6 blocks for replica 0 > 5: drop its oldest leaf, H[3]
    assert not tree.holds(0, H[3]) and tree.holds(0, H[2]) and tree.holds(1, H[1])
    assert tree.match(H) == [3, 2] and len(tree.view(0)) == 5
    tree.clear(0)
    assert tree.match(H) == [0, 2] and len(tree.view(0)) == 0
    tree.clear(1)
    assert not tree.nodes   # nodes no replica holds are removed


def test_kv_events_keep_an_exact_copy_and_accept_vllm_event_records():
    from dataclasses import dataclass

    @dataclass
    class BlockStored:
        block_hashes: list

    @dataclass
    class BlockRemoved:
        block_hashes: list

    class AllBlocksCleared:
        pass

    policy = make_policy("kv_events")
    assert isinstance(policy, KVEventsPolicy)
    policy.reset([10, 10])
    policy.apply_event(1, BlockStored(list(H[:3])))
    choice = policy.choose(REQUEST, [replica(0), replica(1, running=1)])
    assert (choice.replica, choice.matched_blocks) == (1, 3)
    policy.apply_event(1, BlockRemoved([H[1]]))          # a hole: only block 0 still counts
    assert policy.choose(REQUEST, [replica(0), replica(1)]).matched_blocks == 1
    policy.apply_event(1, BlockStored([int.from_bytes(H[1], "big") & (2**64 - 1)]))   # the wire's int form
    assert policy.choose(REQUEST, [replica(0), replica(1)]).matched_blocks == 3
    policy.apply_event(1, AllBlocksCleared())
    assert policy.choose(REQUEST, [replica(0), replica(1)]).replica == 0


def test_an_unknown_policy_is_refused_with_the_names():
    import pytest

    with pytest.raises(ValueError, match="round_robin, least_loaded, prefix_aware, kv_events"):
        make_policy("cache_aware")
