"""What every routing policy sees and returns: one request, each replica's state, a choice.

    Router                              policy.choose(request, replicas) -> Choice
      request  RoutedRequest            prompt_token_ids, block_hashes (the engine's own chain)
      replicas [ReplicaState, ...]      load (running + waiting), kv_cache_usage,
                                        cached_block_hashes (what the policy believes it holds)
      Choice(replica=1, reason="holds 4 of 5 blocks", matched_blocks=4)

A policy is a small class with ``choose``; one that learns from its own decisions (the
prefix tree) also has ``on_routed``, and one that is told what each replica caches (KV
events) has ``stored`` / ``removed`` / ``cleared`` (``kv_events.py``). The router calls
``reset`` once it knows how many replicas there are and how many KV blocks each has.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass

from microvllm.core.kv_cache_utils import BlockHash, hash_new_full_blocks


@dataclass(frozen=True)
class RoutedRequest:
    """A request as the router sees it: its prompt tokens and their block hashes.

    ``block_hashes[i]`` names block ``i`` *and every block before it* (``hash_block_tokens``
    chains its parent's hash), computed with the replicas' own ``block_size``: two prompts
    share ``block_hashes[:k]`` exactly when they share their first ``k * block_size`` tokens.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    block_hashes: tuple[BlockHash, ...]
    block_size: int

    @classmethod
    def from_token_ids(cls, request_id: str, token_ids, block_size: int) -> "RoutedRequest":
        """The request with its block hashes computed as the engine will compute them."""
        hashes: list = []
        hash_new_full_blocks(hashes, list(token_ids), block_size)
        return cls(request_id, tuple(token_ids), tuple(hashes), block_size)


@dataclass(frozen=True)
class ReplicaState:
    """One replica at the moment of a choice.

    ``num_running`` / ``num_waiting`` / ``kv_cache_usage``: the engine's gauges (vLLM's
    ``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``).
    ``cached_block_hashes``: the block hashes the policy believes the replica holds (its
    prefix tree's guess, or the exact set its KV events describe); empty for policies
    that do not look at the cache.
    """

    index: int
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    cached_block_hashes: Container[BlockHash] = frozenset()

    @property
    def load(self) -> int:
        """Requests the replica holds: running + waiting."""
        return self.num_running + self.num_waiting


@dataclass(frozen=True)
class Choice:
    """Where a request goes and why. ``matched_blocks``: the prompt's leading blocks the
    chosen replica is believed to hold (0 for policies that do not look)."""

    replica: int
    reason: str
    matched_blocks: int = 0


class RoutingPolicy:
    """The interface: ``choose``; ``reset`` and ``on_routed`` do nothing unless overridden."""

    name = "policy"

    def reset(self, num_blocks_per_replica: Sequence[int]) -> None:
        """The router's replicas: ``num_blocks_per_replica[i]`` usable KV blocks on replica i."""

    def choose(self, request: RoutedRequest, replicas: Sequence[ReplicaState]) -> Choice:
        raise NotImplementedError

    def on_routed(self, request: RoutedRequest, choice: Choice) -> None:
        """Called after ``request`` was sent to ``choice.replica``."""

    def forget(self, replica: int) -> None:
        """Called when ``replica`` left the rotation (it died, or stopped answering): what
        it cached is gone or out of reach, so a policy that remembers it forgets it."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
