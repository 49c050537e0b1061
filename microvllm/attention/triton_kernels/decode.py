"""Decode-only paged attention: the first Triton kernel of notebook 06.

In a decode step every request brings exactly one new query token, the last of its
sequence (position ``seq_len - 1``), which may look at every key of that sequence.
One Triton *program* computes one (request, query head) pair; it walks the
request's block table one page at a time::

    grid = (num_reqs, num_heads)          program (req, head)

    q = query[query_start_loc[req], head, :]                       [head_dim]
    kv_head = head // (num_heads // num_kv_heads)                  (GQA / MQA)

    block_table[req] = [ 7, 2, 9 ]  ->  pages of kv_cache[:, p, :, kv_head, :]
                         |  |  |
    logical block        0  1  2       keys 0..15 | 16..31 | 32..seq_len-1
                                        (block_size = 16; the last page is partial)

    for each page:                     K, V tiles: [block_size, head_dim]
        s   = K @ q * scale            [block_size] scores, masked outside the window
        online softmax: keep the running max m, the running sum l and the
        running weighted sum acc of V rows, rescaling the old ones when m grows
    out[token, head, :] = acc / l

The *online softmax* (as in FlashAttention) never holds all ``seq_len`` scores at
once: after each page it rescales what it has so far by ``exp(m_old - m_new)``.
Everything is accumulated in float32 whatever the input dtype.

Simplifications that the unified kernel (``unified.py``) removes: each program
handles one query head, so the query heads of a GQA group each re-read the same
K/V pages; and the scores use an elementwise product and a sum instead of
``tl.dot`` (a single query row is too small for the matrix units). Nor does it
split long contexts across programs (vLLM's "flash decoding" two-stage kernel).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from microvllm.attention.metadata import AttentionMetadata


@triton.jit
def decode_attention_kernel(
    out_ptr, query_ptr,                 # [num_tokens, num_heads, head_dim]
    key_cache_ptr, value_cache_ptr,     # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table_ptr,                    # [num_reqs, max_blocks_per_req] int32
    seq_lens_ptr,                       # [num_reqs] int32
    query_start_loc_ptr,                # [num_reqs + 1] int32
    scale,
    stride_query_token, stride_query_head,
    stride_out_token, stride_out_head,
    stride_cache_block, stride_cache_slot, stride_cache_head,
    stride_block_table_req,
    NUM_QUERIES_PER_KV: tl.constexpr,   # query heads per KV head (GQA group size)
    HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,           # tokens per cache page = keys per tile
    SLIDING_WINDOW: tl.constexpr,       # 0: full causal attention
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // NUM_QUERIES_PER_KV

    token = tl.load(query_start_loc_ptr + req)
    if tl.load(query_start_loc_ptr + req + 1) == token:
        return  # this request has no token in this step
    seq_len = tl.load(seq_lens_ptr + req)
    query_pos = seq_len - 1  # the new token is the last of its sequence

    dims = tl.arange(0, HEAD_DIM_PADDED)
    dim_mask = dims < HEAD_DIM
    q = tl.load(query_ptr + token * stride_query_token + head * stride_query_head + dims,
                mask=dim_mask, other=0.0).to(tl.float32)

    # Keys this query may see: first_key .. query_pos.
    first_key = 0
    if SLIDING_WINDOW > 0:
        first_key = tl.maximum(query_pos - SLIDING_WINDOW + 1, 0)

    m = float("-inf")   # running max of the scores
    l = 0.0             # running sum of exp(score - m)
    acc = tl.zeros([HEAD_DIM_PADDED], dtype=tl.float32)  # running sum of exp(...) * V
    slots = tl.arange(0, BLOCK_SIZE)
    block_table_row = block_table_ptr + req * stride_block_table_req

    # Pages wholly before the window are never loaded.
    for logical_block in range(first_key // BLOCK_SIZE, tl.cdiv(seq_len, BLOCK_SIZE)):
        ### BEGIN SOLUTION
        physical_block = tl.load(block_table_row + logical_block).to(tl.int64)
        key_pos = logical_block * BLOCK_SIZE + slots
        visible = (key_pos >= first_key) & (key_pos <= query_pos)  # also: key_pos < seq_len

        tile = (physical_block * stride_cache_block + slots[:, None] * stride_cache_slot
                + kv_head * stride_cache_head + dims[None, :])         # [BLOCK_SIZE, HEAD_DIM]
        tile_mask = visible[:, None] & dim_mask[None, :]
        k = tl.load(key_cache_ptr + tile, mask=tile_mask, other=0.0).to(tl.float32)
        v = tl.load(value_cache_ptr + tile, mask=tile_mask, other=0.0).to(tl.float32)

        s = tl.sum(k * q[None, :], axis=1) * scale                     # [BLOCK_SIZE]
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m, tl.max(s, axis=0))
        # If nothing was visible yet, m_new is -inf and s - m_new would be NaN;
        # subtracting 0 instead gives exp(-inf) = 0 for every masked key.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe)                                         # [BLOCK_SIZE]
        alpha = tl.exp(m - m_safe)       # rescales the old sums to the new max
        l = l * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m = m_new
        ### END SOLUTION

    ### BEGIN SOLUTION
    # A query that saw no key at all (l == 0) gets zeros, not 0/0 = NaN.
    out = acc / tl.where(l == 0.0, 1.0, l)
    tl.store(out_ptr + token * stride_out_token + head * stride_out_head + dims,
             out.to(out_ptr.dtype.element_ty), mask=dim_mask)
    ### END SOLUTION


def decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
                     *, scale: float, sliding_window: int | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention for a decode-only batch (every request has 0 or 1 query token).

    ``query``/``out``: ``[num_tokens, num_heads, head_dim]``; ``kv_cache``:
    ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (already holding this
    step's keys). Rows of ``out`` that belong to no request are left untouched."""
    if metadata.max_query_len > 1:
        raise ValueError(f"decode_attention handles one query token per request, but "
                         f"max_query_len is {metadata.max_query_len}: use unified_attention")
    if out is None:
        out = torch.empty_like(query)
    if metadata.num_actual_tokens == 0:
        return out
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    grid = (metadata.num_reqs, num_heads)
    decode_attention_kernel[grid](
        out, query, key_cache, value_cache,
        metadata.block_table, metadata.seq_lens, metadata.query_start_loc,
        scale,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        metadata.block_table.stride(0),
        NUM_QUERIES_PER_KV=num_heads // num_kv_heads,
        HEAD_DIM=head_dim, HEAD_DIM_PADDED=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size, SLIDING_WINDOW=sliding_window or 0,
    )
    return out
