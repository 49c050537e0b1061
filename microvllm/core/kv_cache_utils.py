"""The building blocks of the paged KV cache: a block, its hash, the free queue.

The runner owns one big KV tensor cut into ``num_blocks`` fixed-size blocks of
``block_size`` token slots each. Everything in ``core/`` only does the
bookkeeping: which block holds which tokens of which request.

    KV tensor (runner)   | blk 0 | blk 1 | blk 2 | blk 3 | ...
    KVCacheBlock (here)    id=0    id=1    id=2    id=3      ref_cnt, block_hash

A *full* block (all ``block_size`` slots written) gets a hash that names its
content *and everything before it*, so equal hashes mean equal KV values:

    tokens      [ t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9 ]   block_size = 4
    block hash      h0       ->     h1       ->  (not full: no hash)
    h0 = sha256(ROOT || tokens 0..3 || extra keys: the adapter's, the cache salt)
    h1 = sha256(h0   || tokens 4..7 || extra keys: the adapter's)

This file has no dependency on the rest of the engine (and no torch).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of size ``b`` hold ``a`` tokens."""
    return -(-a // b)


# --------------------------------------------------------------------------- #
# Prefix hashing
# --------------------------------------------------------------------------- #


class BlockHash(bytes):
    """The sha256 digest (32 bytes) naming a full block and its whole prefix.

    A ``bytes`` subclass, so it compares and hashes like bytes; it only prints
    shorter (``BlockHash(3fa2c1…)``) so traces and notebooks stay readable.
    ``.hex()`` gives the full 64-character hex string.
    """

    __slots__ = ()

    def __repr__(self) -> str:
        return f"BlockHash({self.hex()[:8]}…)"

    def short(self) -> str:
        """First 8 hex digits, for tables and plots."""
        return self.hex()[:8]


# The parent "hash" of the first block. A constant (not random, not Python's
# hash()) so that hashes agree across processes and runs.
ROOT_BLOCK_HASH = BlockHash(hashlib.sha256(b"microvllm prefix cache root").digest())


def _encode_extra_keys(extra_keys: Sequence[object]) -> bytes:
    """A stable byte encoding of extra keys (str, int, or a tuple of those), tagged by type.

    The tag and length prefix keep e.g. ("ab", "c") and ("a", "bc") apart, and a tuple
    such as the adapter's ``("lora", "sql", "/a/sql")`` apart from a cache salt ``"sql"``.
    """
    parts = []
    for key in extra_keys:
        if isinstance(key, str):
            raw = key.encode("utf-8")
            parts.append(b"s" + struct.pack("<I", len(raw)) + raw)
        elif isinstance(key, int):
            parts.append(b"i" + struct.pack("<q", key))
        elif isinstance(key, tuple):
            parts.append(b"t" + struct.pack("<I", len(key)) + _encode_extra_keys(key))
        else:
            raise TypeError(f"extra key {key!r} must be str, int or a tuple of those to be hashed stably")
    return b"".join(parts)


def hash_block_tokens(
    parent_block_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: Sequence[object] | None = None,
) -> BlockHash:
    """Hash one full block: its parent's hash, its token ids, its extra keys.

    Deterministic: sha256 over ``parent digest || int64 token ids || extra
    keys``. Chaining the parent makes the hash depend on the whole prefix, so
    two blocks with the same tokens at different places never collide.
    Cost: O(block_size).
    """
    ### BEGIN SOLUTION
    parent = ROOT_BLOCK_HASH if parent_block_hash is None else parent_block_hash
    payload = bytes(parent) + struct.pack(f"<{len(token_ids)}q", *token_ids)
    if extra_keys:
        payload += b"|" + _encode_extra_keys(extra_keys)
    return BlockHash(hashlib.sha256(payload).digest())
    ### END SOLUTION


def _gen_lora_extra_hash_keys(lora_request) -> tuple:
    """The adapter's extra key, in every block's hash (vLLM: ``_gen_lora_extra_hash_keys``).

    A block's KV is a function of the tokens up to it and of the weights that computed
    them. The base model's weights are the engine's; an adapter's vary, so its blocks are
    keyed by what determines its weights, never by the name a client calls it::

        lora_request                                   its blocks' extra key
        None (the base model)                          ()
        ("sql", 1, "/a/sql", lora_digest="9f2c…")      (("lora", "9f2c…"),)
        ("sql", 2, "/b/sql", lora_digest="41d7…")      (("lora", "41d7…"),)   same name, other files: no hit
        ("sql-2", 3, "/a/sql", lora_digest="9f2c…")    (("lora", "9f2c…"),)   same files: a hit
        ("sql", 1, "/a/sql"), no digest                (("lora", "sql", "/a/sql"),)   a bare core's

    ``lora_digest`` is the sha256 of the adapter's config and weights files
    (``lora/peft_helper.py`` ``adapter_digest``), which the front end takes once per
    adapter. So a name unloaded and loaded again from another folder, or from the same
    folder after its files were replaced, can never read the old adapter's KV (vLLM keys
    by the name alone, and did); the same files under any id or name still share theirs.
    A request that reached a core without the front end (a test's ``Request``) has no
    digest and is keyed by its name and path. The key is a tuple: a cache salt that spells
    it (a string) cannot reach an adapter's blocks.
    """
    if lora_request is None:
        return ()
    digest = getattr(lora_request, "lora_digest", "")
    if digest:
        return (("lora", digest),)
    return (("lora", lora_request.lora_name, lora_request.lora_path),)


def hash_new_full_blocks(
    block_hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None = None,
    lora_request: object | None = None,
) -> None:
    """Append hashes for blocks of ``token_ids`` that became full since last call.

    Incremental: ``block_hashes`` already covers ``len(block_hashes)`` blocks,
    only the new full ones are hashed. The cache salt goes into the first
    block only; chaining carries it into every later hash. A LoRA adapter's key
    (``_gen_lora_extra_hash_keys``: the digest of its files) goes into every block:
    the same tokens under two adapters (or one and the base model) have different KV.
    Cost: O(new full blocks * block_size).
    """
    start = len(block_hashes) * block_size
    lora_keys = _gen_lora_extra_hash_keys(lora_request)
    while start + block_size <= len(token_ids):
        parent = block_hashes[-1] if block_hashes else None
        salt_keys = (cache_salt,) if (start == 0 and cache_salt is not None) else ()
        extra = (lora_keys + salt_keys) or None
        block_hashes.append(
            hash_block_tokens(parent, token_ids[start : start + block_size], extra)
        )
        start += block_size


# --------------------------------------------------------------------------- #
# Blocks and the free queue
# --------------------------------------------------------------------------- #


class KVCacheBlock:
    """Metadata of one KV block (the tensor itself lives in the runner).

    ref_cnt           how many block tables hold this block right now
    block_hash        set once the block is full and registered in the prefix
                      cache; kept after the block is freed (a later request can
                      still hit it) until the block is reused for other tokens
    kv_cache_group_id which cache group's hash table holds it (see BlockPool)
    prev/next_free_block  links of the free queue; both None when not in it
    is_null           True only for block 0, the reserved null block
    """

    __slots__ = (
        "block_id",
        "ref_cnt",
        "block_hash",
        "kv_cache_group_id",
        "prev_free_block",
        "next_free_block",
        "is_null",
    )

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.kv_cache_group_id = 0
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None
        self.is_null = False

    @property
    def is_free(self) -> bool:
        """In the free queue? O(1): only queued blocks have a previous link."""
        return self.prev_free_block is not None

    def __repr__(self) -> str:
        hash_str = self.block_hash.short() if self.block_hash is not None else None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={hash_str})"


class FreeKVCacheBlockQueue:
    """Free blocks as a doubly linked list, least recently freed first.

        head <-> b3 <-> b7 <-> b1 <-> tail        (head, tail: sentinels)
                 ^popleft()            ^append()  (freed blocks join here)

    The links live in the blocks themselves (``prev_free_block`` /
    ``next_free_block``), so every operation below is O(1):

    - popleft(): take the least recently freed block (the LRU victim);
    - remove(block): a cached block became a prefix-cache hit, take it out
      from wherever it sits (a Python list would make this O(n));
    - append(block): a block's ref count reached 0.

    Freeing a request's blocks tail-first (see ``KVCacheManager.free``) puts
    its last blocks nearer the head, so they are evicted before its first
    blocks, which other requests are more likely to share.
    The sentinels mean no operation needs an "is the list empty?" branch.
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self.fake_free_list_head = KVCacheBlock(block_id=-1)
        self.fake_free_list_tail = KVCacheBlock(block_id=-1)
        chain = [self.fake_free_list_head, *blocks, self.fake_free_list_tail]
        for left, right in zip(chain, chain[1:]):
            left.next_free_block = right
            right.prev_free_block = left

    def popleft(self) -> KVCacheBlock:
        """Take the least recently freed block. O(1)."""
        ### BEGIN SOLUTION
        first = self.fake_free_list_head.next_free_block
        if first is self.fake_free_list_tail:
            raise ValueError("no free blocks left: popleft() on an empty free queue")
        self.remove(first)
        return first
        ### END SOLUTION

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Take the ``n`` least recently freed blocks. O(n)."""
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free blocks but only {self.num_free_blocks} are free")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from anywhere in the queue. O(1)."""
        ### BEGIN SOLUTION
        prev_block, next_block = block.prev_free_block, block.next_free_block
        if prev_block is None or next_block is None:
            raise ValueError(f"block {block.block_id} is not in the free queue, cannot remove it")
        prev_block.next_free_block = next_block
        next_block.prev_free_block = prev_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1
        ### END SOLUTION

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the tail (most recently freed). O(1)."""
        ### BEGIN SOLUTION
        if block.prev_free_block is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        last = self.fake_free_list_tail.prev_free_block
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = block
        self.num_free_blocks += 1
        ### END SOLUTION

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """All free blocks, head (next victim) first. O(free blocks); for tests and tracing."""
        result = []
        node = self.fake_free_list_head.next_free_block
        while node is not None and node is not self.fake_free_list_tail:
            result.append(node)
            node = node.next_free_block
        return result

    def __len__(self) -> int:
        return self.num_free_blocks


def maybe_convert_block_hash(block_hash: bytes | int) -> int:
    """vLLM's external form of a block hash (its name; KV events and routers use it): the
    digest's low 64 bits as an int. An int is already in that form and stays as it is."""
    return block_hash if isinstance(block_hash, int) else int.from_bytes(block_hash, "big") & ((1 << 64) - 1)
