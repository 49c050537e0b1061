"""prefix_aware: send a request where its prompt's leading KV blocks probably are.

SGLang's ``cache_aware`` policy (vLLM Router's, its fork, has the same knobs): route to the
worker whose tree shares the longest prefix with the prompt, unless the load is out of
balance. Balance is judged with two thresholds, both of which must be crossed (the names
are theirs)::

    best  = the replica holding the most leading blocks (ties: the less loaded one)
    least = the least loaded replica (requests, then KV cache usage, then index)
    overloaded  <=>  best.load - least.load > balance_abs_threshold
                and  best.load > balance_rel_threshold * least.load
    route to  least  if best holds no block, or best is overloaded;  else to  best

Here a match is counted in the engine's own block hashes (``hash_block_tokens``' chain,
the replicas' ``block_size``), so "replica 1 matches 4 blocks" means "replica 1 probably
has these 4 KV blocks cached": a block counts only if every block before it does, exactly
as the engine's ``find_longest_cache_hit`` stops at its first miss. The policy learns
from its own decisions (``ApproximatePrefixTree``); ``kv_events.py`` has the exact version.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from microvllm.router.least_loaded import least_loaded_replica
from microvllm.router.policy import Choice, ReplicaState, RoutedRequest, RoutingPolicy
from microvllm.router.radix_tree import ApproximatePrefixTree

BALANCE_ABS_THRESHOLD = 4      # requests (SGLang's default is 64: a course runs a handful)
BALANCE_REL_THRESHOLD = 1.5


def choose_prefix_replica(request: RoutedRequest, replicas: Sequence[ReplicaState], *,
                          balance_abs_threshold: int = BALANCE_ABS_THRESHOLD,
                          balance_rel_threshold: float = BALANCE_REL_THRESHOLD) -> Choice:
    """The replica for ``request``: the longest cached prefix, unless that replica is overloaded.

        request.block_hashes      h0   h1   h2   h3
        replica 0 holds           h0   h1                    -> matches 2 blocks   load 3
        replica 1 holds           h0   h1   h2        h9     -> matches 3 blocks   load 5
        replica 2 holds                h1   h2   h3          -> matches 0 blocks   load 1
                                                                (h0 missing: h1.. cannot be hits)
        best = replica 1 (3 blocks). Overloaded? 5 - 1 = 4 > balance_abs_threshold = 4? no
        -> Choice(replica=1, reason="...", matched_blocks=3)

    - A replica matches ``k`` blocks when it holds ``request.block_hashes[0]``, ...,
      ``[k - 1]`` (``h in replica.cached_block_hashes``) and not ``[k]``: stop at the first
      miss, as each hash covers its parent's.
    - ``best``: the most matched blocks; among equals, the least loaded (``load``, then
      ``kv_cache_usage``, then ``index``). ``least``: ``least_loaded_replica(replicas)``.
    - ``best`` is overloaded when ``best.load - least.load > balance_abs_threshold`` and
      ``best.load > balance_rel_threshold * least.load``.
    - No block matched anywhere, or ``best`` overloaded: ``least``, with its own matched count.
    Returns ``Choice(replica index, a reason in words, matched blocks of that replica)``.
    """
    ### BEGIN SOLUTION
    matched = {}
    for replica in replicas:
        count = 0
        for block_hash in request.block_hashes:
            if block_hash not in replica.cached_block_hashes:
                break   # a later block's hash covers this one: no hit past a miss
            count += 1
        matched[replica.index] = count
    best = min(replicas, key=lambda r: (-matched[r.index], r.load, r.kv_cache_usage, r.index))
    least = least_loaded_replica(replicas)
    num_blocks = len(request.block_hashes)
    if matched[best.index] == 0:
        return Choice(least.index, f"no replica holds the prompt's first block: least loaded "
                                   f"({least.load} requests)", matched[least.index])
    if (best.load - least.load > balance_abs_threshold
            and best.load > balance_rel_threshold * least.load):
        return Choice(least.index, f"replica {best.index} holds {matched[best.index]} of {num_blocks} blocks "
                                   f"but is overloaded ({best.load} requests vs {least.load}): least loaded",
                      matched[least.index])
    return Choice(best.index, f"holds {matched[best.index]} of {num_blocks} blocks "
                              f"({best.load} requests)", matched[best.index])
    ### END SOLUTION


ChooseFunction = Callable[..., Choice]


class PrefixAwarePolicy(RoutingPolicy):
    """``choose_prefix_replica`` over the router's approximate prefix tree.

    ``choose``: your own ``choose_prefix_replica`` (exercise 20) in place of the package's.
    ``max_blocks_per_replica``: how much the tree remembers per replica; None: the replica's
    number of usable KV blocks (what its cache could hold at most)."""

    name = "prefix_aware"

    def __init__(self, *, balance_abs_threshold: int = BALANCE_ABS_THRESHOLD,
                 balance_rel_threshold: float = BALANCE_REL_THRESHOLD,
                 max_blocks_per_replica: int | None = None, choose: ChooseFunction | None = None) -> None:
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.max_blocks_per_replica = max_blocks_per_replica
        self.choose_fn = choose or choose_prefix_replica
        self.tree = ApproximatePrefixTree(0)

    def reset(self, num_blocks_per_replica: Sequence[int]) -> None:
        limits = [self.max_blocks_per_replica or n for n in num_blocks_per_replica]
        self.tree = ApproximatePrefixTree(len(limits), limits)

    def choose(self, request: RoutedRequest, replicas: Sequence[ReplicaState]) -> Choice:
        needed = 1 + max(r.index for r in replicas)
        if len(self.tree.num_blocks) < needed:
            # used alone, without a Router: a tree of max_blocks_per_replica (None: unbounded).
            # Fewer replicas than the tree's keep it: a proxy shows only those in rotation.
            self.tree = ApproximatePrefixTree(needed, self.max_blocks_per_replica)
        states = [replace(r, cached_block_hashes=self.tree.view(r.index)) for r in replicas]
        return self.choose_fn(request, states, balance_abs_threshold=self.balance_abs_threshold,
                              balance_rel_threshold=self.balance_rel_threshold)

    def on_routed(self, request: RoutedRequest, choice: Choice) -> None:
        self.tree.insert(choice.replica, request.block_hashes)

    def forget(self, replica: int) -> None:
        if replica < len(self.tree.num_blocks):
            self.tree.clear(replica)
