"""Write this step's keys and values into the paged KV cache (vLLM: ``reshape_and_cache``).

Token ``t``'s key and value go to one *slot* of the cache, ``slot_mapping[t]``,
chosen by the KV cache manager::

    slot = physical_block * block_size + offset_in_block

    key   [num_tokens, num_kv_heads, head_dim]          slot_mapping [num_tokens]
             |  token t                                        |
             v                                                 v
    kv_cache[0, slot // block_size, slot % block_size, :, :] = key[t]
    kv_cache[1, slot // block_size, slot % block_size, :, :] = value[t]

One Triton program per token copies its whole ``[num_kv_heads, head_dim]`` tile of
keys and of values. A negative slot (vLLM's ``-1``) marks a padding token that has
no place in the cache: its program writes nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def write_kv_kernel(
    key_ptr, value_ptr,        # [num_tokens, num_kv_heads, head_dim]
    kv_cache_ptr,              # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,          # [num_tokens] int64
    stride_key_token, stride_key_head,
    stride_value_token, stride_value_head,
    stride_cache_kv, stride_cache_block, stride_cache_slot, stride_cache_head,
    block_size,
    NUM_KV_HEADS: tl.constexpr, NUM_KV_HEADS_PADDED: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)  # int64: big caches overflow int32
    if slot < 0:  # padding token: nothing to store
        return
    block = slot // block_size
    offset = slot % block_size

    # tl.arange needs a power of two, so pad both axes and mask the padding off.
    heads = tl.arange(0, NUM_KV_HEADS_PADDED)
    dims = tl.arange(0, HEAD_DIM_PADDED)
    mask = (heads < NUM_KV_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]

    key = tl.load(key_ptr + token * stride_key_token
                  + heads[:, None] * stride_key_head + dims[None, :], mask=mask)
    value = tl.load(value_ptr + token * stride_value_token
                    + heads[:, None] * stride_value_head + dims[None, :], mask=mask)

    cache_ptrs = (kv_cache_ptr + block * stride_cache_block + offset * stride_cache_slot
                  + heads[:, None] * stride_cache_head + dims[None, :])
    dtype = kv_cache_ptr.dtype.element_ty
    tl.store(cache_ptrs, key.to(dtype), mask=mask)                    # kv_cache[0]: keys
    tl.store(cache_ptrs + stride_cache_kv, value.to(dtype), mask=mask)  # kv_cache[1]: values


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store ``key``/``value [num_tokens, num_kv_heads, head_dim]`` at ``slot_mapping``
    in ``kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim]`` (in place)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache must be contiguous in head_dim (allocate it with torch.empty)")
    # The kernel addresses head_dim with stride 1; a rare strided view gets copied.
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    write_kv_kernel[(num_tokens,)](
        key, value, kv_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        kv_cache.shape[2],
        NUM_KV_HEADS=num_kv_heads, NUM_KV_HEADS_PADDED=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim, HEAD_DIM_PADDED=triton.next_power_of_2(head_dim),
    )
