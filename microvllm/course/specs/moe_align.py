"""Exercise 17: the (token, expert) pairs sorted by expert, each expert's run padded to a block."""

from microvllm.course.exercise import Exercise, Part
from microvllm.layers.fused_moe.moe_align_block_size import moe_align_block_size

EXERCISE = Exercise(
    number="17", slug="moe_align", title="Mixture of experts: sort the pairs by expert, pad each run to a block",
    lecture="17 · mixture of experts",
    intro="""You write `moe_align_block_size`, the bookkeeping step of a mixture-of-experts layer (vLLM
has a CUDA kernel of that name). The router gave each of `T` tokens `k` experts; that is `T * k`
(token, expert) *pairs*. To run each expert once, on all of its rows, the pairs are listed expert
by expert, and each expert's run is padded up to a multiple of `block_size`, so that one block of
a kernel's rows never holds two experts. The "sorted" experts (`moe_sorted.py`) and the Triton
kernel (`fused_moe.py`) both read the layout your function returns.""",
    setup="""
import torch

from microvllm.layers.fused_moe.moe_align_block_size import AlignedRouting
from microvllm.checks.moe_align import check_moe_align, run_moe_with
""",
    parts=(Part(moe_align_block_size, intro="""`topk_ids [T, k]` is what the router returns; pair `i` is
row `i // k`, column `i % k` of it. The checks on `block_size` and on the ids are given; the rest
is yours. No Python loop is needed: `torch.bincount`, `torch.cumsum`, `torch.argsort(...,
stable=True)` and indexing do it for every pair at once (a loop over experts is correct too, only
slower)."""),),
    todos={
        "moe_align_block_size": "count each expert's kept pairs (ids -1 are left out), round each count up to a "
                                "multiple of block_size, set expert_offsets = [0, cumulative sums]; list the kept "
                                "pairs in expert order (a stable sort), put expert e's r-th pair at "
                                "expert_offsets[e] + r in a tensor filled with T*k, give each block its expert id, "
                                "and return AlignedRouting(sorted_token_ids, expert_ids, total, expert_offsets)",
    },
    contract="""
`moe_align_block_size(topk_ids, block_size, num_experts) -> AlignedRouting`, with `P = T * k` pairs
(pair `i` is token `i // k` going to expert `topk_ids.flatten()[i]`) and `E = num_experts`:

    T = 3, k = 2, E = 4, block_size = 4
    topk_ids          [[2, 0], [0, 1], [2, 0]]       pairs 0..5 go to experts 2 0 0 1 2 0
    expert 0: pairs 1, 2, 5   expert 1: pair 3   expert 2: pairs 0, 4   expert 3: none

    row               0 1 2 3   4 5 6 7   8 9 10 11
    sorted_token_ids  [1 2 5 6 | 3 6 6 6 | 0 4 6  6]   (6 = P: padding, "no pair here")
    expert_ids        [0,        1,        2       ]   one per block of 4 rows
    expert_offsets    [0, 4, 8, 12, 12]               expert e's rows: offsets[e] .. offsets[e+1]
    num_tokens_post_padded = 12

- `expert_offsets` (`long [E + 1]`): `expert_offsets[0] = 0`, and `expert_offsets[e + 1] =
  expert_offsets[e] + ` (expert `e`'s number of pairs, rounded up to a multiple of `block_size`).
  An expert with no pair has an empty run (`offsets[3] == offsets[4]` above) and no block.
- `sorted_token_ids` (`long [expert_offsets[-1]]`): expert `e`'s run, rows `expert_offsets[e] ..
  expert_offsets[e + 1] - 1`, holds its pairs **in pair order** (a stable sort: pair 1 before 2
  before 5), then the padding value `P = T * k` up to the end of its last block. Every pair whose id
  is not -1 appears exactly once; a pair whose id is -1 (an expert another rank holds) appears nowhere.
- `expert_ids` (`long [expert_offsets[-1] // block_size]`): the expert of each block of `block_size` rows.
- `num_tokens_post_padded` (`int`): `expert_offsets[-1]`, the number of rows.
- With `block_size = 1` nothing is padded: the pairs, sorted by expert. The answer is fixed by these
  rules, so yours must equal the package's exactly.
""",
    hints=(
        """Start from the counts: how many pairs does each expert get in the example, and how many rows
after rounding up to `block_size = 4`? Which single torch call counts how often each value occurs in
a tensor, and how do you make it return `E` counts even when the last experts get none? How do you
round `n` up to a multiple of `b` with integer arithmetic only?""",
        """For the order: sort the pair indices `0 .. P-1` by their expert id. With several pairs per
expert, which order do they come out in within one expert, and what does `stable=True` promise? Then
place the sorted pairs: the r-th pair of expert `e` goes to row `expert_offsets[e] + r`.

    sorted by expert  [1 2 5 | 3 | 0 4]          r = 0 1 2 | 0 | 0 1
    placed            [1 2 5 6 | 3 6 6 6 | 0 4 6 6]

How do you get each sorted pair's `r` without a loop (where does expert `e`'s group start in the
*unpadded* sorted list)? And where do the ids -1 go so that they are easy to cut off?""",
        """Before you run this, work out `sorted_token_ids`, `expert_ids` and `expert_offsets` by hand:
```python
# Test case: paste it into a new cell and run it (it uses your function above)
r = moe_align_block_size(torch.tensor([[3, 1], [1, -1], [3, 1]]), 2, 5)
assert r.sorted_token_ids.tolist() == [1, 2, 5, 6, 0, 4] and r.num_tokens_post_padded == 6, r
assert r.expert_ids.tolist() == [1, 1, 3] and r.expert_offsets.tolist() == [0, 0, 4, 4, 6, 6], r
```""",
    ),
    checks=("result = check_moe_align(moe_align_block_size)",),
    engine_intro="""`run_moe_with(moe_align_block_size)` writes a tiny random Qwen3-MoE (8 experts, top-2)
to a temporary folder and runs four prompts greedily with `enforce_eager=True`, twice: with the
package's `moe_align_block_size` and with yours in its place. Its experts run block by block, the
way the Triton kernel runs them: block `b` is rows `b * 4 .. b * 4 + 3` of `sorted_token_ids`, run
with the weights of expert `expert_ids[b]`, so every field you return is used, and most steps have
an expert with no pair (the message counts them). The tokens must be the same. It takes a few
seconds (5 to 6 s measured on a shared, busy 2-core CPU). What it cannot see: an unstable sort
passes this run, as its rows only move within their own expert's run; the contract asks for the
stable order so that the layout is one exact answer, and `check_moe_align` above checks it.""",
    engine="run_moe_with(moe_align_block_size)",
)
