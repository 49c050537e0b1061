"""Exercise 20: the prefix-aware router's choice of replica (``router/prefix_aware.py``)."""

from microvllm.course.exercise import Exercise, Part
from microvllm.router.prefix_aware import choose_prefix_replica

EXERCISE = Exercise(
    number="20", slug="prefix_router", title="A cache-aware router: send each request where its prefix is cached",
    lecture="20 · past one engine",
    intro="""You write `choose_prefix_replica`, the decision at the heart of a cache-aware router (SGLang's
`cache_aware` policy, vLLM Router's fork of it). Several engine replicas serve one model; a request
whose prompt starts like an earlier one is cheaper where that earlier one ran, because its KV blocks
are still in that replica's prefix cache. The router keeps, per replica, the block hashes it
believes are cached there (its own approximate tree, or the exact set the replica's KV events
describe), and chooses the replica with the longest cached prefix, unless that replica is already
much busier than the least loaded one.""",
    setup="""
from microvllm.router import Choice, ReplicaState, RoutedRequest
from microvllm.router.least_loaded import least_loaded_replica
from microvllm.router.prefix_aware import BALANCE_ABS_THRESHOLD, BALANCE_REL_THRESHOLD
from microvllm.checks.prefix_router import check_prefix_choice, run_router_with
""",
    parts=(Part(choose_prefix_replica, intro="""`request.block_hashes` are the engine's own chained hashes
of the prompt's full blocks (`hash_block_tokens`, lecture 04); `replica.cached_block_hashes` supports
`h in ...`; `replica.load` is its running + waiting requests. `least_loaded_replica(replicas)` is
given."""),),
    todos={
        "choose_prefix_replica": "count each replica's matched blocks (request.block_hashes in order, stop at the "
                                 "first one it does not hold); best = most matched (ties: load, kv_cache_usage, "
                                 "index), least = least_loaded_replica(replicas); return Choice(least.index, ..., its "
                                 "matched count) when nothing matched or best is overloaded (both thresholds "
                                 "crossed), else Choice(best.index, reason, matched)",
    },
    contract="""
`choose_prefix_replica(request, replicas, *, balance_abs_threshold=4, balance_rel_threshold=1.5) -> Choice`

    request.block_hashes      h0   h1   h2   h3
    replica 0 holds           h0   h1                 -> matches 2 blocks   load 3
    replica 1 holds           h0   h1   h2      h9    -> matches 3 blocks   load 5
    replica 2 holds                h1   h2   h3       -> matches 0 blocks   load 1  (h0 missing)
    best = replica 1; 5 - 1 = 4 is not > 4: not overloaded  ->  Choice(1, "...", matched_blocks=3)

- **Matching.** A replica matches `k` blocks when it holds `block_hashes[0]` … `block_hashes[k-1]`
  and not `block_hashes[k]`. Each hash covers its parent's, so nothing after the first miss counts
  (replica 2 above matches 0, though it holds h1..h3: the engine could not use them).
- **best**: the most matched blocks; among equals the least loaded (`load`, then
  `kv_cache_usage`, then `index`). **least**: `least_loaded_replica(replicas)`, the same order.
- **Overloaded** (SGLang's and vLLM Router's `balance_abs_threshold` / `balance_rel_threshold`):
  `best.load - least.load > balance_abs_threshold` **and** `best.load > balance_rel_threshold * least.load`.
- Return `Choice(least.index, reason, least's matched blocks)` when no replica matches a block or
  `best` is overloaded; otherwise `Choice(best.index, reason, best's matched blocks)`. The reason
  is any non-empty sentence (the router's report prints it); replica and matched blocks must
  equal the package's.
""",
    hints=(
        """Start with one replica: walk `request.block_hashes` in order and count while each hash is
`in replica.cached_block_hashes`. What must happen at the first hash it lacks, and why does a later
hash that it does hold not count (what does that hash name)?""",
        """With a count per replica (a dict keyed by `replica.index`), "the most blocks, then the fewest
requests, then the lowest usage, then the lowest index" is one `min(replicas, key=...)` with a tuple
key: how do you make "most blocks" sort first in a `min`? Then the two fallbacks: nothing matched
(the best count is 0), and the overload test: are both thresholds needed, or one? Is a load exactly
on a threshold over it?""",
        """Before you run this, work out the answer by hand:
```python
# Test case: paste it into a new cell and run it (it uses your function above)
from microvllm.checks.prefix_router import make_request, replica
req = make_request(list(range(10, 26)))          # 4 full blocks of 4 tokens
h = req.block_hashes
states = [replica(0, h, running=9), replica(1, h[:2], running=4), replica(2, [h[0], h[2]], running=2)]
c = choose_prefix_replica(req, states)
assert (c.replica, c.matched_blocks) == (2, 1), c
```""",
    ),
    checks=("result = check_prefix_choice(choose_prefix_replica)",),
    engine_intro="""`run_router_with(choose_prefix_replica)` writes a tiny random Llama to a temporary
folder, starts two replicas of it in this process (each KV cache holds about half of the system
prompts), and routes 48 requests (6 system prompts of 4 blocks, a short question after each,
shuffled) through the `Router` with the prefix-aware policy: once with the package's choice, once
with yours. The requests arrive 8 between two steps, so a burst fills one replica's queue, and
`balance_abs_threshold` is 2 instead of 4: in this small run the package's choices meet every rule
of the contract (no match, equal matches of unequal load, an overloaded best match, one threshold
crossed but not both, a load exactly on a threshold), and it counts them for you. Every request must
go to the same replica, so the prefix-cache hit rate is the same; round robin's is shown beside it.
One rule it cannot test: the router's tree never holds a prompt's later blocks without its first
ones, so counting past a missing block changes nothing here (the checker's hand case sees it). It
takes a few seconds.""",
    engine="run_router_with(choose_prefix_replica)",
)
