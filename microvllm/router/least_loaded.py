"""least_loaded: the replica with the fewest requests (running + waiting), then the emptiest
KV cache, then the lowest index.

vLLM Router's / SGLang's shortest-queue idea. It balances work but not caches: a prefix
lands wherever there is room at that moment, so its blocks end up on every replica.
``least_loaded_replica`` is also the fallback of the prefix-aware policies.
"""

from __future__ import annotations

from collections.abc import Sequence

from microvllm.router.policy import Choice, ReplicaState, RoutedRequest, RoutingPolicy


def load_order(replica: ReplicaState) -> tuple[int, float, int]:
    """Sort key, least loaded first: requests, then KV cache usage, then index."""
    return (replica.load, replica.kv_cache_usage, replica.index)


def least_loaded_replica(replicas: Sequence[ReplicaState]) -> ReplicaState:
    """The replica with the fewest requests; ties: the lower KV cache usage, then the lower index."""
    return min(replicas, key=load_order)


class LeastLoadedPolicy(RoutingPolicy):
    name = "least_loaded"

    def choose(self, request: RoutedRequest, replicas: Sequence[ReplicaState]) -> Choice:
        replica = least_loaded_replica(replicas)
        return Choice(replica.index, f"least loaded: {replica.load} requests, "
                                     f"KV cache {replica.kv_cache_usage:.0%} used")
