"""Exercise 22: the batched LoRA update for a step whose tokens run with different adapters
(``bgmv_shrink`` and ``bgmv_expand_slice``, the ops every wrapped layer calls)."""

from microvllm.course.exercise import Exercise, Part
from microvllm.lora.ops.torch_ops import bgmv_expand_slice, bgmv_shrink

EXERCISE = Exercise(
    number="22", slug="lora_batch", title="Many adapters, one engine: the batched LoRA for a mixed batch",
    lecture="22 · many adapters, one engine (multi-LoRA)",
    intro="""You write the two ops that let one forward pass serve many LoRA adapters at once. An
adapter adds `scaling * B @ (A @ x)` to a layer's output; in a step whose tokens belong to requests
with different adapters (and some with none), every token must use *its own* adapter's `A` and `B`.
The engine keeps the adapters of the step in `max_loras` device slots, stacked (`lora_a [max_loras,
rank, in]`, `lora_b [max_loras, out, rank]`), and gives each token its slot (`-1`: the base model).
`bgmv_shrink` goes down to the rank, `bgmv_expand_slice` comes back up into one slice of the layer's
output (a merged `qkv_proj` has three slices). Every wrapped layer of the engine calls these two on
every step with an adapter (`PunicaWrapperCPU.add_lora_linear`).""",
    setup="""
import torch

from microvllm.checks.lora_batch import check_lora_batch, run_lora_with
""",
    parts=(Part(bgmv_shrink, intro="""The shrink: each token's row times its slot's `A`, times
`scaling`; zeros for a token whose slot is -1. No Python loop over tokens: gather each token's
matrix by indexing the stack with the slot tensor, then one batched matmul (`torch.bmm`). Write the
result into `output_tensor` in place (the caller allocated it)."""),
           Part(bgmv_expand_slice, intro="""The expand: each token's rank-vector times its slot's `B`, into
columns `slice_offset .. slice_offset + slice_size - 1` of `output_tensor`, added to what is there
(`add_inputs=True`, what the engine does) or written over it (`add_inputs=False`). A token whose
slot is -1 gets nothing added (or zeros written).""")),
    todos={
        "bgmv_shrink": "gather each token's A (slot -1: any slot, masked to 0 after), multiply with the token's "
                       "row in one batched matmul, times scaling, and copy into output_tensor",
        "bgmv_expand_slice": "gather each token's B, one batched matmul with its rank-vector, zeros where the slot "
                             "is -1, then add into (or copy over) output_tensor[:, slice_offset:slice_offset + "
                             "slice_size]",
    },
    contract="""
`bgmv_shrink(inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling=1.0)` and
`bgmv_expand_slice(inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset,
slice_size, add_inputs=True)` return nothing: they write `output_tensor` in place.

    tokens           a0  a1  b0  c0  c1        requests a: adapter in slot 1, b: none, c: slot 0
    idx [T]           1   1  -1   0   0        lora_indices_tensor
    shrink   h[t]  = scaling * lora_a[idx[t]] @ x[t]       x [T, in],  lora_a [L, rank, in]  -> h [T, rank]
    expand   y[t, off:off+n] += lora_b[idx[t]] @ h[t]      lora_b [L, n, rank]             -> y [T, out]
             (a token with idx -1: h[t] = 0, and nothing added to y[t])

- `lora_a_weights[s]` is slot `s`'s `A`, `[rank, in]` (peft's `lora_A.weight`): the shrink is
  `A @ x`, not `x @ A`. `lora_b_weights[s]` is slot `s`'s `B`, `[slice_size, rank]`.
- `scaling` multiplies the shrink's result (`lora_alpha / r`); the engine passes 1.0, having folded
  the scaling into `B` when it copied the adapter into its slot, as vLLM does.
- `-1` is not a slot: it means "the base model" and must give exactly 0, whatever the slots hold.
  (Indexing with -1 picks the *last* slot; clamping to 0 picks slot 0: neither is 0.)
- The expand writes only its slice: the other columns of `output_tensor` stay as they were. With
  `add_inputs=True` it adds; with `add_inputs=False` it overwrites the slice (zeros where idx is -1).
- Compute in `inputs`' dtype and write in `output_tensor`'s. No Python loop over tokens (a loop over
  the slots would be correct too, but the point is one gather and one batched matmul per op).
""",
    hints=(
        """What is `lora_a_weights[idx]` when `idx` is a tensor of `T` slots: which shape, and which row is
token `t`'s? Then which single torch call multiplies `T` matrices `[rank, in]` by `T` vectors `[in]`
(make the vectors `[T, in, 1]`)? What does indexing with -1 give, and how do you make those tokens'
rows exactly 0 afterwards (`torch.where` or `masked_fill` with `idx[:, None] < 0`)?""",
        """For the expand, `output_tensor[:, slice_offset:slice_offset + slice_size]` is a *view*: adding into
it (`+=`) or `copy_` into it changes `output_tensor` itself. Which two things differ between
`add_inputs=True` and `False`, and what must a token with idx -1 get in each case?""",
        """Before you run this, work out `h` and `y` by hand:
```python
# Test case: paste it into a new cell and run it (it uses your functions above)
a = torch.tensor([[[1., 0.]], [[0., 2.]]])          # 2 slots, rank 1, in 2
b = torch.tensor([[[1.], [1.]], [[3.], [0.]]])      # 2 slots, out 2, rank 1
x = torch.tensor([[1., 1.], [1., 1.], [1., 1.]])
idx = torch.tensor([1, -1, 0])
h = torch.empty(3, 1)
bgmv_shrink(x, a, h, idx, scaling=0.5)
y = torch.zeros(3, 3)
bgmv_expand_slice(h, b, y, idx, 1, 2)
assert h.tolist() == [[1.0], [0.0], [0.5]], h
assert y.tolist() == [[0.0, 3.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.5, 0.5]], y
```""",
    ),
    checks=("result = check_lora_batch(bgmv_shrink, bgmv_expand_slice)",),
    engine_intro="""`run_lora_with(bgmv_shrink, bgmv_expand_slice)` writes a tiny random Llama and two peft
adapters of it (random `A` and `B`, made offline) to a temporary folder, and runs one batch of
three prompts greedily, one with each adapter and one with the base model, so that every step mixes
two adapters and the base, twice: with the package's ops and with yours in their place. The tokens
must be the same. The engine passes `scaling=1.0` (the scaling is in `B`), which would hide a
scaling mistake: so that the run sees yours, each call of your shrink gets `scaling=2.0` and its
result is halved after (exact in floating point). One rule the run cannot see, and it says so: the
engine's expand always adds (`add_inputs=True`), so the cell runs `add_inputs=False` on your expand
directly, on one case. It takes a few seconds.""",
    engine="run_lora_with(bgmv_shrink, bgmv_expand_slice)",
)
