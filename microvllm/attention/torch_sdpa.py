"""Fast paged attention in torch for CPUs: the default ``attention_backend="torch"``.

The reference (``torch_ref.py``) loops over requests one by one. On a CPU most of a
step is decodes, so this backend treats them all at once:

    decodes (one query each), B requests, longest context S:
        block_table [B, nb] --index_select--> K, V [B, nb*B_s, kv_heads, d]   (padded to S)
        mask        [B, 1, 1, S]        key j visible iff j < seq_len (and inside the window)
        q [B, heads, d] viewed as [B, kv_heads, group, d]
        out = scaled_dot_product_attention(q, K, V, mask)

The view of ``q`` is grouped-query attention folded into the query length: the
``group`` query heads that share one KV head become ``group`` query rows of that
head, so SDPA reads each key and value once per KV head, not once per query head
(and needs no ``enable_gqa``). Gathering whole pages with ``index_select`` is a
plain copy of contiguous rows, several times faster than advanced indexing here.

Prefill chunks (query_len > 1) are few per step and long: one SDPA call each over
that request's gathered context, with a causal mask offset by the context already
cached.

Same inputs, same outputs as the reference; the tests compare them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from microvllm.attention.backend import AttentionBackend
from microvllm.attention.metadata import AttentionMetadata
from microvllm.attention.torch_ref import attention_mask, gather_context, write_kv_torch


def decode_layout(block_table, seq_lens, block_size: int, sliding_window: int | None,
                  dtype: torch.dtype):
    """What every layer's decode attention shares in one step: which pages to gather
    (``table [B, nb]``), how long the padded context is, and the visibility mask."""
    max_len = int(seq_lens.max())
    table = block_table[:, :-(-max_len // block_size)].long()
    k_pos = torch.arange(max_len)[None, :]
    last = (seq_lens.long() - 1)[:, None]                      # the query's own position
    visible = k_pos <= last
    if sliding_window is not None:
        visible &= k_pos > last - sliding_window
    # Additive (0 or -inf, in the query's dtype): SDPA would convert a boolean mask again
    # in every layer.
    mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf"))
    return table, max_len, mask[:, None, None, :]


def _decode_batch(query, kv_cache, layout, scale):
    """``query [B, heads, d]`` each attending over its own context: one SDPA call."""
    table, max_len, mask = layout
    num_reqs = table.shape[0]
    _, _, _, num_kv_heads, head_dim = kv_cache.shape
    group = query.shape[1] // num_kv_heads
    pages = table.flatten()
    # [B * nb, B_s, kv_heads, d] -> [B, S, kv_heads, d]: every request's pages, in order
    keys = kv_cache[0].index_select(0, pages).view(num_reqs, -1, num_kv_heads, head_dim)
    values = kv_cache[1].index_select(0, pages).view(num_reqs, -1, num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(
        query.view(num_reqs, num_kv_heads, group, head_dim),          # group heads -> rows
        keys[:, :max_len].transpose(1, 2), values[:, :max_len].transpose(1, 2),
        attn_mask=mask, scale=scale)
    return out.view(num_reqs, num_kv_heads * group, head_dim)


def _prefill_one(query, kv_cache, block_table_row, seq_len, scale, sliding_window):
    """One request's chunk ``query [q, heads, d]`` over its context ``[seq_len]``."""
    keys, values = gather_context(kv_cache, block_table_row, seq_len)
    query_len = query.shape[0]
    # A whole prompt with nothing cached and no window cutting it is the plain causal
    # triangle: SDPA's is_causal skips the masked half of the work and needs no mask.
    plain_causal = query_len == seq_len and (sliding_window is None or sliding_window >= seq_len)
    mask = None if plain_causal else attention_mask(query_len, seq_len, sliding_window)
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0),
        values.transpose(0, 1).unsqueeze(0), attn_mask=mask, is_causal=plain_causal,
        scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def decode_requests(metadata: AttentionMetadata):
    """The decodes of a step as ``(count, query rows, request ids)``. The runner puts them
    first (``num_decodes``), so rows and ids are both ``0 .. count-1``: plain slices."""
    if metadata.num_decodes is not None:
        n = metadata.num_decodes
        return n, slice(0, n), slice(0, n)
    qsl = metadata.query_start_loc_cpu or metadata.query_start_loc.tolist()
    decodes = [i for i in range(len(qsl) - 1) if qsl[i + 1] - qsl[i] == 1]
    return len(decodes), torch.tensor([qsl[i] for i in decodes]), torch.tensor(decodes)


def prefill_chunks(query, kv_cache, metadata: AttentionMetadata, out, *, scale: float,
                   sliding_window: int | None) -> None:
    """Fill ``out``'s rows of every request with more than one query token: one SDPA each."""
    qsl = metadata.query_start_loc_cpu or metadata.query_start_loc.tolist()
    seq_lens = metadata.seq_lens_cpu or metadata.seq_lens.tolist()
    for i, seq_len in enumerate(seq_lens):
        start, end = qsl[i], qsl[i + 1]
        if end - start > 1:
            out[start:end] = _prefill_one(query[start:end], kv_cache, metadata.block_table[i],
                                          seq_len, scale, sliding_window)


def paged_attention_sdpa(query, kv_cache, metadata: AttentionMetadata, *, scale: float,
                         sliding_window: int | None = None) -> torch.Tensor:
    out = torch.zeros_like(query)
    num_decodes, rows, requests = decode_requests(metadata)
    if num_decodes:
        key = ("decode_layout", sliding_window)
        if key not in metadata.per_step:  # computed by the first layer, reused by the rest
            metadata.per_step[key] = decode_layout(
                metadata.block_table[requests], metadata.seq_lens[requests],
                kv_cache.shape[2], sliding_window, query.dtype)
        out[rows] = _decode_batch(query[rows], kv_cache, metadata.per_step[key], scale)
    prefill_chunks(query, kv_cache, metadata, out, scale=scale, sliding_window=sliding_window)
    return out


class TorchSDPABackend(AttentionBackend):
    """Decodes batched into one SDPA call, prefill chunks one call each."""

    name = "torch"

    def write_kv(self, key, value, kv_cache, slot_mapping):
        write_kv_torch(key, value, kv_cache, slot_mapping)

    def forward(self, query, kv_cache, metadata, *, scale, sliding_window=None):
        return paged_attention_sdpa(query, kv_cache, metadata, scale=scale,
                                    sliding_window=sliding_window)
