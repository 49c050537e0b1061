"""Unified paged attention: prefill chunks and decodes of one step in one launch.

This follows vLLM V1's ``triton_unified_attention`` (its 2D variant). The batch is
the flat row of tokens described in ``metadata.py``; each request's query rows are
the *last* ``query_len`` tokens of its sequence::

    request i:  | cached context (context_len) | this step's chunk (query_len) |
    positions     0 ..................................................... seq_len-1
    query row k sits at position context_len + k and sees keys 0 .. context_len + k
    (with a sliding window W: only keys context_len + k - W + 1 .. context_len + k)

A decode is just a chunk of length 1, so one kernel serves every mix of requests.

**Work split.** A program handles one *q-block* (``BLOCK_Q`` consecutive query
tokens of one request) for one KV head. Its tile of ``BLOCK_M`` rows packs those
tokens with all the query heads that share the KV head (GQA), so each K/V page is
loaded once for the whole group::

    rows of the q tile (group = 2 query heads per KV head, BLOCK_Q = 8, BLOCK_M = 16)
    row m:        0   1   2   3   4   5  ...  14  15
    token m//2:   t0  t0  t1  t1  t2  t2 ...  t7  t7
    head  m%2:    h0  h1  h0  h1  h0  h1 ...  h0  h1    (of this KV head's group)

    grid = (num_q_blocks, num_kv_heads)

A group whose size is not a power of two is padded (``GROUP_PADDED``); the
padding rows are masked off like the rows past the end of a chunk.

**Which request owns q-block b?** Request i's q-blocks start at
``query_start_loc[i] // BLOCK_Q + i``: at least as many as the requests before it
need, and computable without a prefix sum. A program finds its request by binary
search over those starts; the few q-blocks past the end of a request exit at once::

    query_start_loc = [0, 3, 4, 5]        (BLOCK_Q = 4: a 3-token chunk, two decodes)
    first q-block   = [0//4+0, 3//4+1, 4//4+2] = [0, 1, 3]
    q-block         0     1     2       3
    request         r0    r1    r1      r2
                                (idle: r1 has no 2nd q-block, exits at once)
    grid size       = num_tokens // BLOCK_Q + num_reqs = 5 // 4 + 3 = 4

**The KV loop.** Each iteration loads one page of the cache (``BLOCK_SIZE`` keys,
found through the block table) and runs the online softmax of ``decode.py`` on a
``[BLOCK_M, BLOCK_SIZE]`` score tile, now with ``tl.dot`` on the matrix units::

    S   = Q @ K^T * scale           [BLOCK_M, BLOCK_SIZE]   float32
    S   = -inf where the key is after the query (causal) or outside its window
    acc = acc * exp(m_old - m_new) + exp(S - m_new) @ V      [BLOCK_M, head_dim]

Only pages that some row of the tile can see are visited: from the window start
of the tile's first token to the causal end of its last token.

Where vLLM goes further: its tiles need not be one page (it looks the page up per
key), its block sizes adapt to the batch, and a second variant splits very long
contexts over several programs and merges their partial softmaxes ("3D" kernel).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from microvllm.attention.metadata import AttentionMetadata


@triton.jit
def find_request(query_start_loc_ptr, num_reqs, q_block, BLOCK_Q: tl.constexpr):
    """The request owning ``q_block``: the last i with
    ``query_start_loc[i] // BLOCK_Q + i <= q_block`` (binary search)."""
    lo: tl.int32 = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_q_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_q_block <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def unified_attention_kernel(
    out_ptr, query_ptr,                 # [num_tokens, num_heads, head_dim]
    key_cache_ptr, value_cache_ptr,     # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table_ptr,                    # [num_reqs, max_blocks_per_req] int32
    seq_lens_ptr,                       # [num_reqs] int32
    query_start_loc_ptr,                # [num_reqs + 1] int32
    num_reqs,
    scale,
    stride_query_token, stride_query_head,
    stride_out_token, stride_out_head,
    stride_cache_block, stride_cache_slot, stride_cache_head,
    stride_block_table_req,
    NUM_QUERIES_PER_KV: tl.constexpr,   # query heads per KV head (GQA group size)
    GROUP_PADDED: tl.constexpr,         # ... rounded up to a power of two
    HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,           # tokens per cache page = keys per tile
    BLOCK_Q: tl.constexpr,              # query tokens per program
    BLOCK_M: tl.constexpr,              # rows of the q tile = BLOCK_Q * GROUP_PADDED
    SLIDING_WINDOW: tl.constexpr,       # 0: full causal attention
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)

    # ---- which request, and which of its query tokens ------------------------
    req = find_request(query_start_loc_ptr, num_reqs, q_block, BLOCK_Q)
    req_start = tl.load(query_start_loc_ptr + req)
    query_len = tl.load(query_start_loc_ptr + req + 1) - req_start
    q_block_in_req = q_block - (req_start // BLOCK_Q + req)
    if q_block_in_req * BLOCK_Q >= query_len:
        return  # an idle q-block past the end of this request's chunk
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - query_len   # tokens already in the cache before this chunk

    rows = tl.arange(0, BLOCK_M)
    token_in_req = q_block_in_req * BLOCK_Q + rows // GROUP_PADDED       # [BLOCK_M]
    head_in_group = rows % GROUP_PADDED
    head = kv_head * NUM_QUERIES_PER_KV + head_in_group
    row_valid = (token_in_req < query_len) & (head_in_group < NUM_QUERIES_PER_KV)
    query_pos = context_len + token_in_req     # position of each row in its sequence

    dims = tl.arange(0, HEAD_DIM_PADDED)
    dim_mask = dims < HEAD_DIM
    row_offsets = ((req_start + token_in_req)[:, None] * stride_query_token
                   + head[:, None] * stride_query_head + dims[None, :])
    q = tl.load(query_ptr + row_offsets, mask=row_valid[:, None] & dim_mask[None, :],
                other=0.0)                                       # [BLOCK_M, HEAD_DIM_PADDED]

    # ---- the pages any row of this tile can see --------------------------------
    first_pos = context_len + q_block_in_req * BLOCK_Q
    last_pos = context_len + tl.minimum(q_block_in_req * BLOCK_Q + BLOCK_Q, query_len) - 1
    first_key = 0
    if SLIDING_WINDOW > 0:
        first_key = tl.maximum(first_pos - SLIDING_WINDOW + 1, 0)
    end_key = tl.maximum(last_pos + 1, 0)       # causal: nothing after the last row

    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)   # running max per row
    l = tl.zeros([BLOCK_M], dtype=tl.float32)                 # running sum of exp
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], dtype=tl.float32)
    slots = tl.arange(0, BLOCK_SIZE)
    block_table_row = block_table_ptr + req * stride_block_table_req

    for logical_block in range(first_key // BLOCK_SIZE, tl.cdiv(end_key, BLOCK_SIZE)):
        physical_block = tl.load(block_table_row + logical_block).to(tl.int64)
        key_pos = logical_block * BLOCK_SIZE + slots                      # [BLOCK_SIZE]
        key_in_seq = key_pos < seq_len   # the last page may be partly filled
        page = physical_block * stride_cache_block + kv_head * stride_cache_head
        # K is loaded transposed, [HEAD_DIM, BLOCK_SIZE], ready for Q @ K^T.
        k_t = tl.load(key_cache_ptr + page + slots[None, :] * stride_cache_slot + dims[:, None],
                      mask=dim_mask[:, None] & key_in_seq[None, :], other=0.0)
        v = tl.load(value_cache_ptr + page + slots[:, None] * stride_cache_slot + dims[None, :],
                    mask=key_in_seq[:, None] & dim_mask[None, :], other=0.0)

        # input_precision="ieee": float32 inputs are multiplied exactly rather than
        # rounded to TF32; float16/bfloat16 inputs use the matrix units either way.
        s = tl.dot(q, k_t, input_precision="ieee") * scale             # [BLOCK_M, BLOCK_SIZE]
        visible = (key_pos[None, :] <= query_pos[:, None]) & row_valid[:, None]
        if SLIDING_WINDOW > 0:
            visible = visible & (key_pos[None, :] > query_pos[:, None] - SLIDING_WINDOW)
        s = tl.where(visible, s, float("-inf"))

        # Online softmax, one row per query (see decode.py): a row that has seen
        # no key yet has m_new = -inf; subtracting 0 then keeps exp() at 0, not NaN.
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        l = l * alpha + tl.sum(p, axis=1)
        # P is cast to V's dtype so the second product also runs on the matrix units.
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m = m_new

    out = acc / tl.where(l == 0.0, 1.0, l)[:, None]   # no visible key -> zeros
    out_offsets = ((req_start + token_in_req)[:, None] * stride_out_token
                   + head[:, None] * stride_out_head + dims[None, :])
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty),
             mask=row_valid[:, None] & dim_mask[None, :])


def tile_shape(num_queries_per_kv: int, max_query_len: int) -> tuple[int, int]:
    """``(BLOCK_Q, BLOCK_M)``: query tokens per program and rows of its q tile.

    ``tl.dot`` needs at least 16 rows. Decode-heavy batches get 16-row tiles (one
    token's group of heads, padded); long prefill chunks get 64 rows, so each K/V
    page is reused by more queries before it is dropped."""
    group_padded = triton.next_power_of_2(num_queries_per_kv)
    target_rows = 64 if max_query_len * group_padded >= 64 else 16
    block_m = max(target_rows, group_padded)
    return block_m // group_padded, block_m


def unified_attention(query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
                      *, scale: float, sliding_window: int | None = None,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """Paged attention for any mix of prefill chunks and decodes.

    ``query``/``out``: ``[num_tokens, num_heads, head_dim]``; ``kv_cache``:
    ``[2, num_blocks, block_size, num_kv_heads, head_dim]``, already holding this
    step's keys. ``block_size`` must be a power of two of at least 16 (one page is
    one ``tl.dot`` tile). Rows of ``out`` that belong to no request are left
    untouched."""
    if out is None:
        out = torch.empty_like(query)
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    num_queries_per_kv = num_heads // num_kv_heads
    block_q, block_m = tile_shape(num_queries_per_kv, metadata.max_query_len)
    num_q_blocks = metadata.num_actual_tokens // block_q + metadata.num_reqs
    if metadata.num_actual_tokens == 0:
        return out
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    unified_attention_kernel[(num_q_blocks, num_kv_heads)](
        out, query, key_cache, value_cache,
        metadata.block_table, metadata.seq_lens, metadata.query_start_loc,
        metadata.num_reqs, scale,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        metadata.block_table.stride(0),
        NUM_QUERIES_PER_KV=num_queries_per_kv,
        GROUP_PADDED=triton.next_power_of_2(num_queries_per_kv),
        HEAD_DIM=head_dim, HEAD_DIM_PADDED=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size, BLOCK_Q=block_q, BLOCK_M=block_m,
        SLIDING_WINDOW=sliding_window or 0,
    )
    return out
