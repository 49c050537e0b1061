"""A course router: which of N engine replicas serves each request (chapter 20, past one engine).

    policy.py        RoutedRequest, ReplicaState, Choice, RoutingPolicy (the interface)
    round_robin.py   0, 1, ..., N-1, 0, ...
    least_loaded.py  fewest running + waiting requests, then the emptiest KV cache
    radix_tree.py    the router's approximate tree of block hashes it sent to each replica
    prefix_aware.py  longest cached prefix unless overloaded (SGLang's / vLLM Router's cache_aware)
    kv_events.py     the same choice over each replica's exact cache, kept from its KV events
    router.py        Router: replicas in one process, route(prompts) -> RouteReport
    workload.py      shared system prompts; compare_policies -> hit rate per policy
    http_proxy.py    the same policies over HTTP, in front of `microvllm serve` replicas
"""

from microvllm.router.http_proxy import HTTPProxy
from microvllm.router.kv_events import BlockPoolPoller, KVEventsPolicy
from microvllm.router.least_loaded import LeastLoadedPolicy, least_loaded_replica
from microvllm.router.policies import POLICIES, make_policy
from microvllm.router.policy import Choice, ReplicaState, RoutedRequest, RoutingPolicy
from microvllm.router.prefix_aware import PrefixAwarePolicy, choose_prefix_replica
from microvllm.router.radix_tree import ApproximatePrefixTree
from microvllm.router.round_robin import RoundRobinPolicy
from microvllm.router.router import Decision, ReplicaReport, Router, RouteReport
from microvllm.router.workload import (
    POLICY_NAMES,
    PolicyComparison,
    compare_policies,
    make_replicas,
    shared_prefix_workload,
)

__all__ = [
    "POLICIES", "POLICY_NAMES", "ApproximatePrefixTree", "BlockPoolPoller", "Choice", "Decision",
    "HTTPProxy", "KVEventsPolicy", "LeastLoadedPolicy", "PolicyComparison", "PrefixAwarePolicy", "ReplicaReport",
    "ReplicaState", "RoundRobinPolicy", "RouteReport", "RoutedRequest", "Router", "RoutingPolicy",
    "choose_prefix_replica", "compare_policies", "least_loaded_replica", "make_policy", "make_replicas",
    "shared_prefix_workload",
]
