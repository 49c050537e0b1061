"""Exercise 19: the scheduler side of a KV connector (``core/scheduler_kv_connector.py``):
which blocks to load for a waiting request and whether it must wait, and the delayed free."""

from microvllm.core.scheduler_kv_connector import plan_kv_load, release_finished_sends
from microvllm.course.exercise import Exercise, Part

EXERCISE = Exercise(
    number="19", slug="kv_connector", title="KV connectors: the scheduler side of a second KV tier",
    lecture="19 · KV connectors: disaggregated prefill and a second KV tier",
    intro="""You write the two decisions a KV connector's scheduler side makes for the engine, the ones
vLLM's scheduler asks its connector about (`get_num_new_matched_tokens`, and the `finished_sending`
report that ends a delayed free). `plan_kv_load` says, for a waiting request, which of its blocks the
other side (a second tier, or a prefill instance) should copy in past what the local prefix cache
already has, and whether the request must wait for that copy before it may be scheduled.
`release_finished_sends` frees the blocks of finished requests whose KV the worker reported sent,
once. The package's `OffloadingConnector` calls your `plan_kv_load` for every waiting request it may
admit next, and the scheduler calls your `release_finished_sends` after every step: a wrong answer
either loads KV the request already has, runs the model on blocks not loaded yet, or hands a block to
another request while the worker still reads it.""",
    setup="""
from microvllm.core.kv_cache_utils import hash_new_full_blocks
from microvllm.core.scheduler_kv_connector import KVLoadPlan
from microvllm.checks.kv_connector import check_kv_connector, make_hashes, run_kv_tier_with
""",
    parts=(Part(plan_kv_load, intro="""`block_hashes[i]` is the engine's chained hash of the request's
block `i` (lecture 04): equal hashes mean equal tokens *and* equal prefix. `remote_has` supports
`h in remote_has` (the tier's index, a dict). `num_local_tokens` is the local prefix hit, whole
blocks."""),
           Part(release_finished_sends, intro="""`kv_sending` maps a finished request's id to its blocks,
held since `request_finished` answered delay_free=True; `finished_sending` is what the worker
reported this step (a set, or None)."""),),
    todos={
        "plan_kv_load": "from block num_local_tokens // block_size up to (not including) the last token's block "
                        "(num_tokens - 1) // block_size, take the indices whose hash is in remote_has, stopping at "
                        "the first miss; return KVLoadPlan(len * block_size, tuple(indices), bool(indices))",
        "release_finished_sends": "for each reported id in sorted order, pop it from kv_sending (None if absent) and "
                                  "collect what was there; return the list",
    },
    contract="""
`plan_kv_load(block_hashes, num_tokens, num_local_tokens, block_size, remote_has) -> KVLoadPlan`

    block hashes        h0   h1   h2   h3 | last 2 tokens     (block_size 4, num_tokens 14)
    local prefix hit    h0                                     num_local_tokens = 4
    remote_has          h0   h1   h2        h5
    ->                       h1   h2                           KVLoadPlan(8, (1, 2), load_async=True)

- Load only blocks **past the local hit**: from block `num_local_tokens // block_size` on.
- **In a row**, stopping at the first block `remote_has` lacks (each hash covers its parents).
- **Never the block of the last token** (`(num_tokens - 1) // block_size`) or beyond: the last token
  is always computed, its logits give the first new token.
- `num_external_tokens = len(block_indices) * block_size`; `load_async` is True exactly when there is
  something to load: the request then waits in WAITING_FOR_REMOTE_KVS and may be scheduled only
  after the worker reports the load (`finished_recving`). Nothing to load: `KVLoadPlan(0, (), False)`,
  the request may be scheduled now.

`release_finished_sends(kv_sending, finished_sending) -> list`

    kv_sending {"a": blocks_a, "b": blocks_b}    finished_sending {"a", "z"}
    ->  [blocks_a]                               kv_sending {"b": blocks_b}   (b is still being sent)

- Free (return) the blocks of the **reported** requests only, in `sorted(finished_sending)` order,
  each **taken out** of `kv_sending`: a request reported again, or never delayed ("z"), frees nothing.
""",
    hints=(
        """`plan_kv_load` is one loop over a range of block indices. Which index is the first one the
local cache does not have? Which is the first one you may not load (the block holding token
`num_tokens - 1`)? What do you do at the first hash `remote_has` lacks: skip it, or stop?""",
        """`release_finished_sends`: `dict.pop(key, None)` takes an entry out and says None when it was
not there. Why must the entry leave `kv_sending`, not just be read? (What happens to a block's
reference count when a worker reports the same request twice?) And `finished_sending` may be None.""",
        """Work these out by hand before you run them:
```python
# Test case: paste it into a new cell and run it (it uses your functions above)
h = make_hashes(16)   # 4 full blocks h0..h3 of 4 tokens
assert plan_kv_load(h, 16, 4, 4, set(h)) == KVLoadPlan(8, (1, 2), True)     # not h3: the last token's block
assert plan_kv_load(h, 18, 0, 4, {h[0], h[2]}) == KVLoadPlan(4, (0,), True)  # h1 missing ends the run
assert plan_kv_load(h, 18, 16, 4, set(h)) == KVLoadPlan(0, (), False)
sending = {"a": (3, 4), "b": (5,)}
assert release_finished_sends(sending, {"a"}) == [(3, 4)] and sending == {"b": (5,)}
assert release_finished_sends(sending, {"a"}) == []
```""",
    ),
    checks=("result = check_kv_connector(plan_kv_load, release_finished_sends)",),
    engine_intro="""`run_kv_tier_with(plan_kv_load, release_finished_sends)` writes a tiny random Llama to a
temporary folder and runs the engine with the in-process `OffloadingConnector` (a second KV tier) on
12 prompts, one after another, greedy: 48-token prefixes that come back after the KV pool lost them.
The tier is small too and evicts its least recently used blocks, so a prefix can come back with a
block missing from the tier and later ones still held. Some prompts end on a block boundary, the
last one finds every block in the pool already, and every report of finished sends also names a
request the scheduler never delayed. Once with the package's scheduler side, once with your two
functions in its place (put back afterwards). It compares the tokens, the prefix-cache hits (tier
loads included) and the blocks loaded, counts the calls to yours, and says where yours answers
what the engine cannot show (a wait with nothing to load). It takes a few seconds.""",
    engine="run_kv_tier_with(plan_kv_load, release_finished_sends)",
)
