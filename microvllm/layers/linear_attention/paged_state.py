"""A linear-attention layer's state in the paged KV cache, and one engine step over it.

A state page is one block of the KV tensor the layer shares with an attention layer
(``models/kv_cache_layout.py``): the conv state over the keys half of the page, the
recurrent state over the values half, each padded to ``block_size x num_kv_heads x
head_dim`` values (the worker raises the block size until both fit, as vLLM does)::

    kv_cache        [2, num_blocks, block_size, num_kv_heads, head_dim]
    kv_cache[0, b]  -> conv      [conv_dim, K-1]     (the first conv_dim*(K-1) values)
    kv_cache[1, b]  -> recurrent [H_v, d_k, d_v]     (the first H_v*d_k*d_v values)

The state group's block table (``core/kv_cache_spec.py``, ``MambaSpec``) has a page per
block of tokens: the page of block j holds the state after the tokens up to the end of
block j. A request computing tokens c .. e-1 this step reads the page of block (c-1)//B
(nothing if c = 0: a fresh state), runs its tokens one block at a time, and writes the
state reached at each block boundary into that block's page (a snapshot a later request
may resume from) and the state after token e-1 into the page of block (e-1)//B::

    B = 4, c = 6, e = 13:    read page[1] (state after 6 tokens)
                             tokens 6, 7      -> page[1] = state after 8    (snapshot)
                             tokens 8..11     -> page[2] = state after 12   (snapshot)
                             token 12         -> page[3] = state after 13   (live)

Requests are run one by one, decode or prefill alike: plain code to read. vLLM runs the
batch's decodes in one kernel call and its prefills in one varlen kernel call
(``fused_recurrent_gated_delta_rule``, ``chunk_gated_delta_rule``), with the pages' indices
passed to the kernel.
"""

from __future__ import annotations

import torch

from microvllm.attention.metadata import AttentionMetadata
from microvllm.layers.linear_attention.gated_deltanet import GatedDeltaNet, LinearAttentionState


def state_page_sizes(layer: GatedDeltaNet) -> tuple[int, int]:
    """Values of one request's (conv, recurrent) state in ``layer``."""
    return layer.conv_dim * (layer.conv_kernel - 1), layer.num_v_heads * layer.head_k_dim * layer.head_v_dim


def state_views(layer: GatedDeltaNet, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(conv [num_blocks, conv_dim, K-1], recurrent [num_blocks, H_v, d_k, d_v])``: views of
    ``kv_cache``'s pages, no copy (writing ``conv[b]`` writes block b's keys half)."""
    conv_size, recurrent_size = state_page_sizes(layer)
    num_blocks, page = kv_cache.shape[1], kv_cache[0, 0].numel()
    if max(conv_size, recurrent_size) > page:
        raise ValueError(f"a state of ({conv_size}, {recurrent_size}) values does not fit a page half of "
                         f"{page}: raise block_size")
    conv = kv_cache[0].reshape(num_blocks, page)[:, :conv_size].unflatten(1, (layer.conv_dim, layer.conv_kernel - 1))
    recurrent = kv_cache[1].reshape(num_blocks, page)[:, :recurrent_size].unflatten(
        1, (layer.num_v_heads, layer.head_k_dim, layer.head_v_dim))
    return conv, recurrent


def forward_paged(layer: GatedDeltaNet, x: torch.Tensor, kv_cache: torch.Tensor,
                  metadata: AttentionMetadata) -> torch.Tensor:
    """``x [T, hidden]`` (every request's tokens of this step, flattened as for attention)
    -> ``[T, hidden]``, each request resumed from its state page and its pages written."""
    conv, recurrent = state_views(layer, kv_cache)
    block_size = kv_cache.shape[2]
    rows = metadata.per_step.get("block_table_rows")
    if rows is None:   # once per step, shared by every layer of the group
        rows = metadata.per_step["block_table_rows"] = metadata.block_table.tolist()
    assert metadata.query_start_loc_cpu is not None and metadata.seq_lens_cpu is not None
    qsl, seq_lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
    out = torch.empty_like(x)
    for i, table in enumerate(rows):
        first_row, end = qsl[i], seq_lens[i]
        start = end - (qsl[i + 1] - first_row)           # tokens computed before this step
        state = LinearAttentionState()                   # a new sequence: zeros
        if start > 0:
            page = table[(start - 1) // block_size]
            # copies: the page may be a snapshot other requests share, never written here
            state = LinearAttentionState(conv[page].clone(), recurrent[page].clone())
        position = start
        for boundary in [*range((start // block_size + 1) * block_size, end, block_size), end]:
            rows_now = slice(first_row + position - start, first_row + boundary - start)
            out[rows_now], state = layer(x[rows_now], state)
            page = table[(boundary - 1) // block_size]
            conv[page].copy_(state.conv)
            recurrent[page].copy_(state.recurrent)
            position = boundary
    return out
