"""kv_events: route on what each replica *really* caches, as its KV events tell it.

vLLM Router's ``kv_aware`` idea (and NVIDIA Dynamo's KV router): each engine publishes
every change to its prefix cache, and the router keeps an exact copy of each replica's set
of cached block hashes instead of guessing from where it sent prompts::

    replica 1's events            the router's copy of replica 1
    BlockStored([h0, h1, h2])     {h0, h1, h2}
    BlockRemoved([h2])            {h0, h1}
    AllBlocksCleared()            {}

The choice itself is the prefix-aware one (``choose_prefix_replica``) over those exact
sets. The policy takes its events through three calls, whatever carries them:
``stored(replica, hashes)``, ``removed(replica, hashes)``, ``cleared(replica)``.
``apply_event`` turns an event record of vLLM's names (``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared``: the block pool's own records, or vLLM's msgspec structs decoded from
the ZMQ stream of ``distributed/kv_events.py``, one ``KVEventBatch`` per engine step) into
those calls. ``BlockPoolPoller``
makes the same calls for engines in this process by comparing each block pool's cached
hashes with the last poll (so it sees the cache after each step, not every change in it).

On the wire a block hash is vLLM's external form, the digest's low 64 bits as an int
(``core/kv_cache_utils.py``'s ``maybe_convert_block_hash``), so the copy keeps that form:
a ``BlockHash`` from the engine or an int from the stream name the same block.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace

from microvllm.core.kv_cache_utils import BlockHash, maybe_convert_block_hash
from microvllm.router.policy import Choice, ReplicaState, RoutedRequest, RoutingPolicy
from microvllm.router.prefix_aware import (
    BALANCE_ABS_THRESHOLD,
    BALANCE_REL_THRESHOLD,
    ChooseFunction,
    choose_prefix_replica,
)


class CachedBlocks(set):
    """One replica's cached blocks, in external form; ``BlockHash in`` it works too."""

    def __contains__(self, block_hash: object) -> bool:
        return isinstance(block_hash, (bytes, int)) and super().__contains__(maybe_convert_block_hash(block_hash))


class KVEventsPolicy(RoutingPolicy):
    """``choose_prefix_replica`` over each replica's cached block hashes, kept from its events."""

    name = "kv_events"

    def __init__(self, *, balance_abs_threshold: int = BALANCE_ABS_THRESHOLD,
                 balance_rel_threshold: float = BALANCE_REL_THRESHOLD, choose: ChooseFunction | None = None) -> None:
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.choose_fn = choose or choose_prefix_replica
        self.cached: list[CachedBlocks] = []

    def reset(self, num_blocks_per_replica: Sequence[int]) -> None:
        self.cached = [CachedBlocks() for _ in num_blocks_per_replica]

    # ------------------------------------------------------------ the event feed
    def stored(self, replica: int, block_hashes: Iterable[BlockHash | int]) -> None:
        self._replica(replica).update(maybe_convert_block_hash(h) for h in block_hashes)

    def removed(self, replica: int, block_hashes: Iterable[BlockHash | int]) -> None:
        self._replica(replica).difference_update(maybe_convert_block_hash(h) for h in block_hashes)

    def cleared(self, replica: int) -> None:
        self._replica(replica).clear()

    def forget(self, replica: int) -> None:
        self.cleared(replica)   # a restarted replica starts empty; its events tell the rest

    def apply_event(self, replica: int, event) -> None:
        """One event record of vLLM's names: ``BlockStored`` / ``BlockRemoved`` (each with
        ``block_hashes``) or ``AllBlocksCleared``. Others (a future kind) are ignored."""
        kind = type(event).__name__
        if kind == "BlockStored":
            self.stored(replica, event.block_hashes)
        elif kind == "BlockRemoved":
            self.removed(replica, event.block_hashes)
        elif kind == "AllBlocksCleared":
            self.cleared(replica)

    def _replica(self, replica: int) -> CachedBlocks:
        while len(self.cached) <= replica:
            self.cached.append(CachedBlocks())
        return self.cached[replica]

    # --------------------------------------------------------------- the choice
    def choose(self, request: RoutedRequest, replicas: Sequence[ReplicaState]) -> Choice:
        states = [replace(r, cached_block_hashes=self._replica(r.index)) for r in replicas]
        return self.choose_fn(request, states, balance_abs_threshold=self.balance_abs_threshold,
                              balance_rel_threshold=self.balance_rel_threshold)


class BlockPoolPoller:
    """A KV event feed for engines in this process: ``poll(policy)`` compares each engine's
    cached block hashes (cache group 0 of its block pool) with the last poll and calls
    ``policy.stored`` / ``removed`` / ``cleared`` with the difference. O(cached blocks)."""

    def __init__(self, engines: Sequence) -> None:
        self.engines = list(engines)
        self.seen: list[set[BlockHash]] = [set() for _ in self.engines]

    def poll(self, policy: KVEventsPolicy) -> None:
        for replica, engine in enumerate(self.engines):
            pool = engine.kv_cache_manager.block_pool
            now = {block_hash for block_hash, group in pool.cached_block_hash_to_block if group == 0}
            before = self.seen[replica]
            if before and not now:
                policy.cleared(replica)
            else:
                if before - now:
                    policy.removed(replica, before - now)
                if now - before:
                    policy.stored(replica, now - before)
            self.seen[replica] = now
