"""The policies by name: ``make_policy("prefix_aware", balance_abs_threshold=8)``."""

from __future__ import annotations

from microvllm.router.kv_events import KVEventsPolicy
from microvllm.router.least_loaded import LeastLoadedPolicy
from microvllm.router.policy import RoutingPolicy
from microvllm.router.prefix_aware import PrefixAwarePolicy
from microvllm.router.round_robin import RoundRobinPolicy

POLICIES: dict[str, type[RoutingPolicy]] = {
    cls.name: cls for cls in (RoundRobinPolicy, LeastLoadedPolicy, PrefixAwarePolicy, KVEventsPolicy)}


def make_policy(name: str, **options) -> RoutingPolicy:
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}: choose one of {', '.join(POLICIES)}")
    return POLICIES[name](**options)
