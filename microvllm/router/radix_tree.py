"""The prefix-aware router's guess of what each replica caches: a tree of block hashes.

SGLang's ``cache_aware`` router (and vLLM Router's, its fork) keeps an *approximate* radix
tree of the text it sent to each worker: it never asks the worker what it holds, it
remembers where it sent what, and forgets the oldest when a worker's share grows too big.
Here the tree's edges are the engine's own block hashes, so a match is counted in blocks
the replica can really reuse::

    prompts sent      replica 0: [h0 h1 h2]        replica 1: [h0 h1 h5], [h7]
    tree              root ── h0 {0, 1} ── h1 {0, 1} ─┬─ h2 {0}
                         │                            └─ h5 {1}
                         └─ h7 {1}
    match([h0 h1 h5 h6])  ->  {replica 0: 2 blocks, replica 1: 3 blocks}

Each node records, per replica, when the router last sent that block there. With more than
``max_blocks`` nodes for one replica, its least recently sent *leaf* is dropped first (a
parent outlives its children, as in the engine, which frees a request's blocks tail first).
Because a block hash already names its whole prefix, ``holds(replica, h)`` is one dict
lookup; ``match`` walks the request's hashes from the root, O(blocks); eviction scans the
replica's nodes, O(nodes) per dropped leaf, plenty for a course's sizes.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from microvllm.core.kv_cache_utils import BlockHash


@dataclass(eq=False)
class _Node:
    block_hash: BlockHash | None                       # None: the root
    parent: _Node | None
    children: dict[BlockHash, _Node] = field(default_factory=dict)
    last_sent: dict[int, int] = field(default_factory=dict)   # replica -> tick of its last insert


class ApproximatePrefixTree:
    """Per replica, the block-hash chains the router sent there, at most ``max_blocks`` each."""

    def __init__(self, num_replicas: int, max_blocks: Sequence[int | None] | int | None = None) -> None:
        if not isinstance(max_blocks, Sequence):
            max_blocks = [max_blocks] * num_replicas
        self.max_blocks = list(max_blocks)
        self.root = _Node(None, None)
        self.nodes: dict[BlockHash, _Node] = {}
        self.num_blocks = [0] * num_replicas          # nodes each replica holds
        self._tick = itertools.count()

    def insert(self, replica: int, block_hashes: Sequence[BlockHash]) -> None:
        """Record that ``block_hashes`` (one prompt's chain) went to ``replica``; evict if too big."""
        tick = next(self._tick)
        node = self.root
        for block_hash in block_hashes:
            child = node.children.get(block_hash)
            if child is None:
                child = node.children[block_hash] = self.nodes[block_hash] = _Node(block_hash, node)
            if replica not in child.last_sent:
                self.num_blocks[replica] += 1
            child.last_sent[replica] = tick
            node = child
        limit = self.max_blocks[replica]
        while limit is not None and self.num_blocks[replica] > limit:
            self._drop_oldest_leaf(replica)

    def holds(self, replica: int, block_hash: BlockHash) -> bool:
        node = self.nodes.get(block_hash)
        return node is not None and replica in node.last_sent

    def match(self, block_hashes: Sequence[BlockHash]) -> list[int]:
        """Per replica: how many leading blocks of ``block_hashes`` it is believed to hold."""
        matched = [0] * len(self.num_blocks)
        for depth, block_hash in enumerate(block_hashes, 1):
            node = self.nodes.get(block_hash)
            if node is None:
                break
            for replica in node.last_sent:
                if matched[replica] == depth - 1:
                    matched[replica] = depth
        return matched

    def view(self, replica: int) -> ReplicaView:
        """``replica``'s blocks as a container: ``block_hash in tree.view(1)``."""
        return ReplicaView(self, replica)

    def clear(self, replica: int) -> None:
        """Forget everything sent to ``replica`` (its prefix cache was reset, or it died):
        one pass over the nodes, not one per block, as a proxy does it between requests."""
        for node in [node for node in self.nodes.values() if replica in node.last_sent]:
            del node.last_sent[replica]
            self._remove_if_unused(node)
        self.num_blocks[replica] = 0

    def _drop_oldest_leaf(self, replica: int) -> None:
        leaves = [node for node in self.nodes.values() if replica in node.last_sent
                  and not any(replica in child.last_sent for child in node.children.values())]
        oldest = min(leaves, key=lambda node: node.last_sent[replica])
        del oldest.last_sent[replica]
        self.num_blocks[replica] -= 1
        self._remove_if_unused(oldest)

    def _remove_if_unused(self, node: _Node) -> None:
        """Remove ``node`` if no replica holds it and it has no children, then its parents
        that became the same."""
        while node is not self.root and not node.last_sent and not node.children:
            assert node.parent is not None and node.block_hash is not None
            del node.parent.children[node.block_hash]
            del self.nodes[node.block_hash]
            node = node.parent


class ReplicaView:
    """One replica's part of the tree, as a read-only container of block hashes."""

    def __init__(self, tree: ApproximatePrefixTree, replica: int) -> None:
        self.tree, self.replica = tree, replica

    def __contains__(self, block_hash: object) -> bool:
        return isinstance(block_hash, bytes) and self.tree.holds(self.replica, block_hash)  # type: ignore[arg-type]

    def __len__(self) -> int:
        return self.tree.num_blocks[self.replica]

    def __repr__(self) -> str:
        return f"<replica {self.replica}: {len(self)} blocks in the router's tree>"
