"""Exercise 06: the Triton paged-attention decode kernel."""

from microvllm.attention.triton_kernels.decode import decode_attention, decode_attention_kernel
from microvllm.course.exercise import Exercise, Part

EXERCISE = Exercise(
    number="06", slug="decode_kernel", title="A Triton paged-attention decode kernel",
    lecture="06 · attention: the torch reference, then the Triton kernel",
    intro="""You write the heart of the decode kernel: the loop over one request's KV pages with an
online softmax, and the final normalization and store. Without a GPU it runs in Triton's CPU
interpreter (slow, so the shapes are tiny).""",
    extra_setup_first="""
# Triton's CPU interpreter must be switched on before triton is imported (no-op with a GPU).
from microvllm.attention.triton_kernels import ensure_triton_can_run
ensure_triton_can_run()
""",
    setup="""
import torch
import triton
import triton.language as tl

from microvllm.attention import register_backend
from microvllm.attention.metadata import AttentionMetadata
from microvllm.attention.triton_backend import TritonAttentionBackend
from microvllm.checks import check_decode_kernel, run_engine_with
""",
    parts=(Part(decode_attention_kernel, intro="""One program per (request, query head). The code
before the loop is given: it finds the query row, loads `q`, and computes the first visible key
(`first_key`) for a sliding window. You write the loop body (one page per iteration) and the end."""),
           Part(decode_attention, intro="""The launcher (given): the grid is `(num_reqs, num_heads)`;
strides tell the kernel how to walk the tensors.""")),
    todos={
        "decode_attention_kernel": [
            "for this page: load its physical block id, the K/V tiles of the visible keys, the scaled "
            "scores, then update m, l and acc (online softmax)",
            "store acc / l (zeros when no key was visible) into the output row",
        ],
    },
    contract="""
For each (request `req`, query head `head`) with a token this step, at position
`query_pos = seq_len - 1`, and each key position `key_pos` in `first_key .. query_pos`:

    out[token, head] = sum_j softmax_j(scale * q · k_j) * v_j         (float32 accumulation)

where `k_j, v_j` live in the paged cache: logical block `key_pos // BLOCK_SIZE` of the request is
physical block `block_table[req, key_pos // BLOCK_SIZE]`, slot `key_pos % BLOCK_SIZE`, KV head
`head // NUM_QUERIES_PER_KV` (GQA). Per page, in the loop:
- load the page's physical block id (as int64, for large offsets);
- `visible = (key_pos >= first_key) & (key_pos <= query_pos)`; load the `[BLOCK_SIZE, HEAD_DIM_PADDED]`
  K and V tiles with `mask=visible[:, None] & dim_mask[None, :], other=0.0` — slots outside the
  sequence hold NaN in the checker's caches, so an unmasked load poisons the result;
- scores `s = sum(k * q) * scale`, `-inf` where not visible;
- online softmax: `m_new = max(m, max(s))`; `p = exp(s - m_new)`; `alpha = exp(m - m_new)`;
  `l = l * alpha + sum(p)`; `acc = acc * alpha + sum(p[:, None] * v)`; `m = m_new` (use 0 instead
  of `m_new` while it is still `-inf`, or `-inf - (-inf)` gives NaN).

At the end: `out = acc / l` (`l == 0`: no visible key, store zeros), cast to the output dtype,
stored at `out_ptr + token * stride_out_token + head * stride_out_head + dims` with `mask=dim_mask`.
""",
    hints=(
        """Pointers are plain integers plus offsets. A K tile's offsets are
`physical_block * stride_cache_block + slots[:, None] * stride_cache_slot + kv_head * stride_cache_head + dims[None, :]`
(`slots = tl.arange(0, BLOCK_SIZE)` is given).""",
        """`tl.sum(k * q[None, :], axis=1)` is the `[BLOCK_SIZE]` vector of dot products; `tl.max(s, axis=0)`
and `tl.sum(p, axis=0)` reduce it to scalars. `tl.where(cond, a, b)` is the masked select.""",
        """Before you run this, work it out on paper: after page 0 (scores 1, 2), what are `m`, `l`
and `acc`? How does page 1 (score 3, then a NaN slot) rescale them? With `sliding_window=1` no key of
page 0 is visible: what are `m`, `m_new` and `alpha` then, and does your loop avoid `-inf - (-inf)`?
```python
# Test case: paste it into a new cell and run it (it uses your kernel above)
# One request, one head, head_dim 2, pages of 2 slots; q = [1, 0], keys [1, 0], [2, 0], [3, 0] (scores
# 1, 2, 3), values [1, 1], [2, 2], [3, 3]; logical page 0 is physical block 2, page 1 is block 1, and
# the slot after the last key holds NaN.
kv_cache = torch.full((2, 3, 2, 1, 2), float("nan"))        # [K/V, blocks, slots, kv heads, dim]
for key_pos, block, slot in ((0, 2, 0), (1, 2, 1), (2, 1, 0)):
    kv_cache[0, block, slot, 0] = torch.tensor([key_pos + 1.0, 0.0])
    kv_cache[1, block, slot, 0] = key_pos + 1.0
metadata = AttentionMetadata(num_actual_tokens=1, max_query_len=1, max_seq_len=3,
                             query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
                             seq_lens=torch.tensor([3], dtype=torch.int32),
                             block_table=torch.tensor([[2, 1]], dtype=torch.int32), slot_mapping=torch.tensor([2]))
query = torch.tensor([[[1.0, 0.0]]])
every_key = decode_attention(query, kv_cache, metadata, scale=1.0)
last_key_only = decode_attention(query, kv_cache, metadata, scale=1.0, sliding_window=1)  # page 0 unseen
assert round(every_key[0, 0, 0].item(), 4) == 2.5752, every_key     # softmax([1, 2, 3]) · [1, 2, 3]
assert last_key_only.tolist() == [[[3.0, 3.0]]], last_key_only
```""",
    ),
    checks=("check_decode_kernel(decode_attention)",),
    engine_intro="""Attention backends are chosen by name from a registry. This registers a backend
that is the engine's Triton backend with *your* kernel for decode-only steps
(`use_decode_kernel=True`; prefill steps still use the unified kernel), then runs the engine with
`attention_backend="exercise-decode"`. The reference engine uses the torch backend: the greedy tokens
must be the same.""",
    engine='''
@register_backend("exercise-decode")
class ExerciseDecodeBackend(TritonAttentionBackend):
    """The Triton backend, with your decode kernel for decode-only steps."""

    def __init__(self):
        super().__init__(use_decode_kernel=True)
        self._decode_attention = decode_attention  # yours


run_engine_with(attention_backend="exercise-decode", label="your decode kernel",
                prompts=["The scheduler decides which requests run", "Héllo wörld 🙂"], max_tokens=6)
''',
)
