"""Exercise 18: one token of the gated delta rule, every head at once (the recurrence of a
Gated DeltaNet layer, Qwen3.5's linear attention)."""

from microvllm.course.exercise import Exercise, Part
from microvllm.layers.linear_attention.gated_delta_rule import gated_delta_step

EXERCISE = Exercise(
    number="18", slug="gated_delta_step", title="Hybrid models: one step of the gated delta rule",
    lecture="18 · hybrid models: linear attention beside full attention",
    intro="""You write `gated_delta_step`, one token of the recurrence that Qwen3.5's linear-attention
layers (Gated DeltaNet) run in place of attention. A head keeps no list of past keys and values: it
keeps one matrix, its **state** `S` (`d_k x d_v`), and each token first lets it fade, then writes
into it a *correction*, what its value should be minus what `S` already recalls for its key, and
is read with the query. The package's `recurrent_gated_delta_rule`, the form decode runs, is a
loop of your function, one call per token; the engine's prefill form (`chunk_gated_delta_rule`)
computes the same numbers another way, and the checker holds yours against it. This one function
is the idea of the whole layer: the projections, the short convolution and the gates around it
only prepare its inputs, and the cache manager only stores what it returns.""",
    setup="""
import math

import torch

from microvllm.layers.linear_attention.gated_delta_rule import l2_normalize
from microvllm.checks.gated_delta import check_gated_delta_step, run_gated_deltanet_with
""",
    parts=(Part(gated_delta_step, intro="""Two blocks: first bring `q_t` and `k_t` into the form the
rule reads (normalised, `q` scaled, one row per value head), then the rule itself. Every head at
once: no Python loop over heads is needed (`torch.einsum` or broadcasting with `[:, :, None]` does
a matrix-vector product per head). `l2_normalize` is given (imported in the setup cell)."""),),
    todos={
        "gated_delta_step": [
            "L2-normalise q_t and k_t over d_k in float32 (l2_normalize), scale q_t by d_k ** -0.5, and repeat "
            "each key head for the `group` value heads it serves (repeat_interleave along dim 0)",
            "decay the state (S = exp(g_t) * state, per head, a new tensor), recall v_old = S^T k_t, write "
            "k_t (beta_t (v_t - v_old))^T into S, and return (S^T q_t, S), all float32",
        ],
    },
    contract="""
`gated_delta_step(q_t, k_t, v_t, g_t, beta_t, state) -> (o_t, new_state)`, one token of one
sequence, every head at once:

    q_t, k_t     [H_k, d_k]        as the layer's projections and conv made them (not normalised)
    v_t          [H_v, d_v]        H_v = group * H_k value heads
    g_t, beta_t  [H_v]             g_t <= 0: the log of the decay;  beta_t in (0, 1): write strength
    state        [H_v, d_k, d_v]   float32: the state after the sequence's previous token
    returns      o_t [H_v, d_v], new_state [H_v, d_k, d_v], both float32; `state` left unchanged

Key head `h` serves value heads `h * group .. h * group + group - 1` (as grouped-query attention
shares a KV head). For value head `h`, with `q = l2(q_t) / sqrt(d_k)` and `k = l2(k_t)` (each
divided by its length, `l2_normalize`; only the query is scaled):

    S      = exp(g_t[h]) * state[h]              1. forget a little of everything, first
    v_old  = S^T k                               2. what S recalls for this key now   [d_v]
    S      = S + k (beta_t[h] (v_t[h] - v_old))^T  3. write the correction, not the value
    o_t[h] = S^T q                               4. read the new state with the query  [d_v]

A worked case (one head, `d_k = 4`, `d_v = 2`, `g = 0`, `beta = 1/2`): the state recalls `[1, 0]`
for key `[1, 0, 0, 0]`; with `v = [3, 0]` the correction is `1/2 ([3, 0] - [1, 0]) = [1, 0]`, so
row 0 of S grows from `[1, 0]` to `[2, 0]`, and the query `[2, 0, 0, 0]` (normalised `[1, 0, 0, 0]`,
scaled by `1/sqrt(4)`) reads `o = [1, 0]`. The answer is fixed by these rules: yours must equal the
package's within float32 rounding, and a loop of your steps must equal `chunk_gated_delta_rule`.
""",
    hints=(
        """Shapes first: after your first block, `q_t` and `k_t` must have `H_v` rows, one per value
head. With `H_k = 2` key heads (rows `a`, `b`) and `H_v = 4` value heads, `group = 2`:

    k_t (H_k = 2 rows)       a         b
    value head               0    1    2    3
    reads key head           ?    ?    ?    ?

Fill in the last row from the contract (key head `h` serves value heads `h * group` onwards).
Which torch call turns the rows `[a, b]` into that row, and which one into `[a, b, a, b]`, its wrong
twin (the two agree when `H_k = 1`)? And in which order do normalising, scaling and repeating
happen: does it change the answer?""",
        """One value head at a time, with the hand cases' sizes (`d_k = 4`, `d_v = 2`):

    S       4 x 2      rows indexed by d_k (a key's coordinates), columns by d_v
    k, q    4          v, v_old, the correction c    2

    recall   S^T k   4 x 2 matrix, 4 vector -> 2 numbers     which axis of S is summed?
    write    k c^T   4 vector, 2 vector -> 4 x 2, like S    which one is the row?

For all heads at once, `S` is `[H, 4, 2]` and `k` is `[H, 4]`: which axis of `k` must line up
with which axis of `S`, and where must a new axis of size 1 go so that broadcasting multiplies
per head without a loop (or, with `torch.einsum`, which letters name the axes)? Then the order:
does the recall read the state before or after the decay, and does `o_t` read it before or after
the write? And which state does the step start from: zeros, or the one it was given?""",
        """Work these out by hand before you run them (one head, `d_k = 4`, `d_v = 2`):
```python
# Test case: paste it into a new cell and run it (it uses your function above)
state = torch.zeros(1, 4, 2)
state[0, 0] = torch.tensor([2.0, 0.0])
state[0, 3] = torch.tensor([0.0, 2.0])
o, S = gated_delta_step(torch.tensor([[0.0, 0, 0, 1]]), torch.tensor([[1.0, 0, 0, 0]]), torch.tensor([[4.0, 0]]),
                        torch.tensor([math.log(0.5)]), torch.tensor([1.0]), state)
assert torch.allclose(S[0, 0], torch.tensor([4.0, 0])) and torch.allclose(S[0, 3], torch.tensor([0.0, 1])), S
assert torch.allclose(o, torch.tensor([[0.0, 0.5]])), o
assert state[0, 0, 0] == 2.0, "the state passed in must not change"
```""",
    ),
    checks=("result = check_gated_delta_step(gated_delta_step)",),
    engine_intro="""`run_gated_deltanet_with(gated_delta_step)` runs the engine on a tiny random Qwen3.5 (6
Gated DeltaNet layers beside 2 of gated full attention), `enforce_eager=True`, greedy, on 3 prompts
with chunked prefill (16 tokens a step), twice: with the package's `gated_delta_step`, then with
yours in its place. Prefill chunks go through the chunked form; every decode step goes through
`recurrent_gated_delta_rule`, a loop of your function, once per request and Gated DeltaNet layer,
the state read from and written back to its page in the KV cache. It compares the tokens and their
log-probabilities (a tiny random model's greedy tokens can survive a small error), counts the calls
to your function, and puts the package's back afterwards. It takes under half a minute on a
2-core CPU, a little longer on a busy one; its last line starts with ✓ or ✗.""",
    engine="run_gated_deltanet_with(gated_delta_step)",
)
