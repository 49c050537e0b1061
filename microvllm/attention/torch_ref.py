"""Reference paged attention in plain torch: slow, readable, and the oracle that the
fast torch backend (``torch_sdpa.py``) and the Triton kernels are tested against.

For each request we gather its context from the paged cache through its block table
into a dense ``[seq_len, num_kv_heads, head_dim]`` tensor, then run ordinary masked
softmax attention for its query rows.
"""

from __future__ import annotations

import torch

from microvllm.attention.backend import AttentionBackend
from microvllm.attention.metadata import AttentionMetadata


def write_kv_torch(key, value, kv_cache, slot_mapping) -> None:
    """``kv_cache[:, slot // block_size, slot % block_size] = key/value`` for every token."""
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    flat = kv_cache.view(2, num_blocks * block_size, *kv_cache.shape[3:])
    flat[0].index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def gather_context(kv_cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int):
    """Return the dense keys and values ``[seq_len, num_kv_heads, head_dim]`` of one
    request by following its block table (logical block j -> physical block)."""
    block_size = kv_cache.shape[2]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = block_table_row[:num_blocks].long()
    keys = kv_cache[0, blocks].flatten(0, 1)[:seq_len]
    values = kv_cache[1, blocks].flatten(0, 1)[:seq_len]
    return keys, values


def attention_mask(query_len: int, seq_len: int, sliding_window: int | None,
                   device=None) -> torch.Tensor:
    """``[query_len, seq_len]`` bool, True where a query row may see a key.

    Query row k sits at position ``seq_len - query_len + k``: it sees every key at or
    before it, and with a sliding window only the last ``sliding_window`` of those."""
    q_pos = torch.arange(seq_len - query_len, seq_len, device=device)[:, None]
    k_pos = torch.arange(seq_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask


def paged_attention_torch(query, kv_cache, metadata: AttentionMetadata, *, scale: float,
                          sliding_window: int | None = None) -> torch.Tensor:
    num_heads, num_kv_heads = query.shape[1], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    out = torch.zeros_like(query)
    qsl = metadata.query_start_loc_cpu or metadata.query_start_loc.tolist()
    seq_lens = metadata.seq_lens_cpu or metadata.seq_lens.tolist()
    for i, seq_len in enumerate(seq_lens):
        start, end = qsl[i], qsl[i + 1]
        if end == start:
            continue
        keys, values = gather_context(kv_cache, metadata.block_table[i], seq_len)
        # GQA: query head h reads KV head h // group.
        keys = keys.repeat_interleave(group, dim=1).float().transpose(0, 1)      # [h, k, d]
        values = values.repeat_interleave(group, dim=1).float().transpose(0, 1)  # [h, k, d]
        q = query[start:end].float().transpose(0, 1)                             # [h, q, d]
        scores = (q @ keys.transpose(1, 2)) * scale                              # [h, q, k]
        mask = attention_mask(end - start, seq_len, sliding_window, query.device)
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row with no key -> zeros
        out[start:end] = (probs @ values).transpose(0, 1).to(query.dtype)
    return out


class TorchReferenceBackend(AttentionBackend):
    """Readable per-request attention; the correctness oracle (``attention_backend="reference"``)."""

    name = "reference"

    def write_kv(self, key, value, kv_cache, slot_mapping):
        write_kv_torch(key, value, kv_cache, slot_mapping)

    def forward(self, query, kv_cache, metadata, *, scale, sliding_window=None):
        return paged_attention_torch(query, kv_cache, metadata, scale=scale,
                                     sliding_window=sliding_window)
