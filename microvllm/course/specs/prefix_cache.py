"""Exercise 04: prefix hashing and the longest cached prefix."""

from microvllm.core.kv_cache_manager import KVCacheManager
from microvllm.core.kv_cache_utils import hash_block_tokens
from microvllm.course.exercise import Exercise, Part

EXERCISE = Exercise(
    number="04", slug="prefix_cache", title="Prefix hashing and cache hits",
    lecture="04 · the prefix cache",
    intro="""You write how a full block is named (`hash_block_tokens`: its parent's hash chained
with its tokens) and how a new request finds its longest cached prefix
(`KVCacheManager.get_computed_blocks`).""",
    setup="""
import hashlib
import struct
from collections.abc import Sequence

import microvllm.core.kv_cache_manager
from microvllm.core.kv_cache_manager import KVCacheBlocks
from microvllm.core.kv_cache_utils import ROOT_BLOCK_HASH, BlockHash, _encode_extra_keys
from microvllm.core.request import Request
from microvllm.checks import check_get_computed_blocks, check_hash_block_tokens, run_engine_with
""",
    parts=(Part(hash_block_tokens),
           Part(KVCacheManager, methods=("get_computed_blocks",), intro="""Your class is the engine's
`KVCacheManager` with your `get_computed_blocks`. Each cache group has a manager in
`self.single_type_managers` whose `find_longest_cache_hit(block_hashes, max_length)` returns its
longest usable run of cached blocks (full attention: from the start, up to the first miss).""")),
    todos={
        "hash_block_tokens": "sha256 of the parent's bytes (ROOT_BLOCK_HASH if None), the token ids as "
                             "int64 little-endian, and b'|' + the encoded extra keys; return a BlockHash",
        "KVCacheManager.get_computed_blocks": "ask every group's manager for its longest hit below "
                                              "num_tokens, retry all at the shortest until they agree; "
                                              "return (KVCacheBlocks, hit tokens)",
    },
    contract="""
`hash_block_tokens(parent_block_hash, token_ids, extra_keys=None) -> BlockHash`:
- `sha256(bytes(parent) + struct.pack(f"<{len(token_ids)}q", *token_ids))`, where `parent` is
  `ROOT_BLOCK_HASH` when `parent_block_hash` is None; when `extra_keys` is non-empty, append
  `b"|" + _encode_extra_keys(extra_keys)` to the bytes before hashing;
- deterministic across processes (never Python's `hash()`), and exactly the engine's digest:
  the checker compares with a fixed value.

`get_computed_blocks(request) -> (KVCacheBlocks, num_hit_tokens)`:
- caching off: `(self.create_empty_block_list(), 0)`;
- never the whole sequence: the hit covers at most `request.num_tokens - 1` tokens, so the
  last prompt token is recomputed and produces the logits to sample from;
- each group's manager gives its hit with
  `find_longest_cache_hit(request.block_hashes, max_length)`; if the groups' hits differ in
  length, ask them all again with the shortest length, until they agree;
- returns one list of blocks per group (`KVCacheBlocks(tuple(hits))`) and the hit length in
  tokens (blocks × `self.block_size`); it touches nothing (`allocate_slots` does).
""",
    hints=(
        """The hash names the whole prefix because the parent's 32 bytes go first. Pack tokens
with a fixed width (`"<q"`: 8 bytes, little-endian): then `[256]` and `[1, 1]`, or `[1]` and
`[1, 0]`, can never give the same bytes.""",
        """Which `max_length`? Not `request.num_tokens`: with exactly 32 tokens in blocks of 16
that would hit both blocks, leaving nothing to compute and so no logits to sample from. Pass
`request.num_tokens - 1` (the managers round down to whole blocks: 31 tokens -> 1 block).""",
        """```python
hit_length = request.num_tokens - 1
while True:
    hits = [m.find_longest_cache_hit(request.block_hashes, hit_length)
            for m in self.single_type_managers]
    shortest = min(len(blocks) for blocks in hits) * self.block_size
    if all(len(blocks) * self.block_size == shortest for blocks in hits):
        break
    hit_length = shortest
return KVCacheBlocks(tuple(hits)), shortest
```""",
    ),
    checks=("check_hash_block_tokens(hash_block_tokens)", "check_get_computed_blocks(KVCacheManager)"),
    engine_intro="""`components={"kv_cache_manager": KVCacheManager}` makes the scheduler find every
prefix hit through your `get_computed_blocks`, and `hash_block_tokens=hash_block_tokens` makes every
request's block hashes with your hash. Seven prompts, in blocks of 8 tokens: two share 16 tokens;
one holds a block whose tokens another prompt has after a different first block (a hash that forgets
the parent finds it); one repeats an earlier prompt with its own cache salt (it must hit nothing); and
a request preempted after generating a block's worth of tokens comes back and must hit its prompt
*and* its output. The greedy tokens must not change, and every step must find exactly the
reference's hits (and so hold the same blocks).""",
    engine='run_engine_with({"kv_cache_manager": KVCacheManager}, hash_block_tokens=hash_block_tokens)',
)
