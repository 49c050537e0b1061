"""round_robin: replica 0, 1, ..., N-1, 0, 1, ... whatever they hold or how busy they are.

The baseline every router offers (vLLM Router's and SGLang's ``round_robin``): even
request counts, but each replica sees every prefix, so each cache holds a bit of all of
them and keeps evicting what the next request needs.
"""

from __future__ import annotations

from collections.abc import Sequence

from microvllm.router.policy import Choice, ReplicaState, RoutedRequest, RoutingPolicy


class RoundRobinPolicy(RoutingPolicy):
    name = "round_robin"

    def __init__(self) -> None:
        self.next_replica = 0

    def reset(self, num_blocks_per_replica: Sequence[int]) -> None:
        self.next_replica = 0

    def choose(self, request: RoutedRequest, replicas: Sequence[ReplicaState]) -> Choice:
        replica = replicas[self.next_replica % len(replicas)]
        self.next_replica += 1
        return Choice(replica.index, f"round robin: turn of replica {replica.index}")
