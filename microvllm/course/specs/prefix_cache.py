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
        "hash_block_tokens": "hash the parent (ROOT_BLOCK_HASH if None), the token ids and any extra keys "
                             "into a BlockHash with the properties of the contract",
        "KVCacheManager.get_computed_blocks": "ask every group's manager for its longest hit below "
                                              "num_tokens, retry all at the shortest until they agree; "
                                              "return (KVCacheBlocks, hit tokens)",
    },
    contract="""
`hash_block_tokens(parent_block_hash, token_ids, extra_keys=None) -> BlockHash` names a full
block *and everything before it*. What must hold:
- **a digest**: a `BlockHash` of 32 bytes (sha256), the same for the same input in every process and
  run (never Python's `hash()`, which is salted per process);
- **it names the whole prefix**: the same tokens after another parent hash differently; a parent of
  `None` means `ROOT_BLOCK_HASH` (the first block's parent), so both give the same hash;
- **every token and its place count**: `[1, 2]` and `[2, 1]`, `[256]` and `[1, 1]`, `[1]` and
  `[1, 0]`, `[0]` and `[]` all hash differently;
- **extra keys count, unambiguously**: a cache salt changes the hash; `("ab", "c")` and
  `("a", "bc")` differ (`_encode_extra_keys` writes each key with its type and length); no extra
  keys (`None` or empty) hashes like a block without them;
- **the engine's digest**: the check compares one chain with a fixed digest (the engine's, the same
  in every run), so your bytes must be laid out as the engine's are. The properties above leave
  that layout open; hint 1 gives it.

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
        """The engine's byte layout: the parent's 32 bytes first (then the hash names the whole
prefix), then every token id as 8 bytes, little-endian (`struct.pack(f"<{len(token_ids)}q",
*token_ids)`: a fixed width, so `[256]` and `[1, 1]`, or `[1]` and `[1, 0]`, can never give the
same bytes), then, only when there are extra keys, `b"|" + _encode_extra_keys(extra_keys)`. Hash
those bytes with `hashlib.sha256` and wrap the digest in `BlockHash`.""",
        """Which `max_length`? Not `request.num_tokens`: with exactly 32 tokens in blocks of 16
that would hit both blocks, leaving nothing to compute and so no logits to sample from. Pass
`request.num_tokens - 1` (the managers round down to whole blocks: 31 tokens -> 1 block).""",
        """Before you run this, predict how many tokens each request hits when request `a`'s two blocks
of 4 are cached: requests of 3, 8, 9 and 12 tokens that start with the same tokens. Why does the
8-token request hit only 4, and the 12-token one only 8?
```python
# Test case: paste it into a new cell and run it (it uses your hash and your class above)
from microvllm.checks.fakes import make_request
from microvllm.core import FullAttentionSpec
assert hash_block_tokens(None, [1, 2]).hex()[:16] == "fb5472e425077a1d"
kv = KVCacheManager([FullAttentionSpec(4)], num_blocks=16, block_size=4)
a = make_request("a", list(range(8)), 4)           # blocks of 4: two full blocks
kv.allocate_slots(a, 8)                            # a's blocks are computed and cached
hits = {n: kv.get_computed_blocks(make_request(f"r{n}", list(range(n)), 4))[1] for n in (3, 8, 9, 12)}
assert hits == {3: 0, 8: 4, 9: 8, 12: 8}, hits
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
