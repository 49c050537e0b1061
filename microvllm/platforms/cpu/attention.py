"""Call the C++ paged-attention kernels for CPUs: decodes (``csrc/paged_attention.cpp``,
with ``write_kv``, which stores a step's new keys and values in the paged cache) and
prefill chunks (``csrc/prefill_attention.cpp``, on AVX-512 CPUs).

``kernels.load`` builds and loads them (``-march=native``, OpenMP from the runtime torch
already loaded). Tensors cross as raw pointers; ``check_inputs`` checks their dtypes,
shapes and contiguity first, because C++ cannot.

``kernel_status()`` says whether the decode kernel can be used here and, if not, why; the
CPU platform's ``"auto"`` backend is the torch one in that case.
"""

from __future__ import annotations

import functools

import torch

from microvllm.platforms.cpu import kernels
from microvllm.platforms.cpu.kernels import DTYPE_CODES


def load():
    """The decode kernel and ``write_kv`` (``paged_attention.cpp``), loaded once."""
    return kernels.load("paged_attention")


def kernel_status() -> str | None:
    """None if the decode kernel is usable on this machine, else the reason it is not."""
    return kernels.status("paged_attention")


@functools.lru_cache(maxsize=None)
def prefill_supported(head_dim: int) -> bool:
    """Whether the prefill kernel runs here for this head size (an AVX-512 build, head
    size 64 or 128); where not, prefill chunks go through SDPA."""
    if kernels.status("prefill_attention") is not None:
        return False
    return bool(kernels.load("prefill_attention").prefill_supported(head_dim))


def check_inputs(query, kv_cache, block_table, seq_lens, out, num_reqs: int | None = None) -> None:
    """What C++ cannot check, for both kernels: ``num_reqs`` requests (default: one per
    query row, as in a decode) with a ``block_table`` row and a ``seq_lens`` entry each."""
    if query.dtype not in DTYPE_CODES:
        raise TypeError(f"the CPU attention kernel supports {sorted(map(str, DTYPE_CODES))}, "
                        f"not {query.dtype}")
    if kv_cache.dtype != query.dtype or out.dtype != query.dtype:
        raise TypeError(f"query, kv_cache and out must share a dtype; got {query.dtype}, "
                        f"{kv_cache.dtype}, {out.dtype}")
    if block_table.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise TypeError("block_table and seq_lens must be int32")
    num_rows, num_heads, head_dim = query.shape
    num_reqs = num_rows if num_reqs is None else num_reqs
    if query.device.type != "cpu" or query.stride(2) != 1 or query.stride(1) != head_dim:
        raise ValueError("query must be a CPU tensor whose heads are contiguous within a row "
                         "(rows may be apart, as in a view of the QKV output)")
    for name, t in (("kv_cache", kv_cache), ("block_table", block_table),
                    ("seq_lens", seq_lens), ("out", out)):
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous CPU tensor")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[4] != head_dim:
        raise ValueError(f"kv_cache must be [2, num_blocks, block_size, num_kv_heads, {head_dim}], "
                         f"got {list(kv_cache.shape)}")
    if num_heads % kv_cache.shape[3]:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={kv_cache.shape[3]}")
    if block_table.shape[0] < num_reqs or seq_lens.shape[0] < num_reqs or out.shape != query.shape:
        raise ValueError("block_table, seq_lens and out must have a row per query")
    if num_reqs:
        longest, room = int(seq_lens[:num_reqs].max()), block_table.shape[1] * kv_cache.shape[2]
        if longest > room:  # the kernel would read past the table's row
            raise ValueError(f"seq_lens reach {longest} tokens but block_table holds {room}")


def paged_attention_decode(query: torch.Tensor, kv_cache: torch.Tensor,
                           block_table: torch.Tensor, seq_lens: torch.Tensor, *, scale: float,
                           sliding_window: int | None = None,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention straight from the paged cache (see ``paged_attention.cpp``).

    ``query [num_reqs, num_heads, head_dim]`` (heads contiguous within a row, rows may be
    apart: a view of the QKV output needs no copy): request ``i``'s one query token attends
    over its ``seq_lens[i]`` cached tokens, found through ``block_table[i]``. Positions
    in ``seq_lens`` must fit the table (checked) and the block ids in it must be valid
    (trusted, as every paged-attention kernel does).
    """
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype)   # contiguous, whatever query's strides
    check_inputs(query, kv_cache, block_table, seq_lens, out)
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    num_reqs, num_heads, _ = query.shape
    if num_reqs:
        with kernels.profiled("microvllm::paged_attention_decode"):
            load().paged_attention_decode(
                DTYPE_CODES[query.dtype], query.data_ptr(), query.stride(0), kv_cache.data_ptr(),
                block_table.data_ptr(), seq_lens.data_ptr(), out.data_ptr(), num_reqs, num_heads,
                num_kv_heads, head_dim, block_size, num_blocks, block_table.shape[1], scale,
                sliding_window or 0)
    return out


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """``kv_cache[0 / 1, slot // block_size, slot % block_size] = key / value[t]`` for every
    token ``t`` (``slot = slot_mapping[t]``), as ``torch_ref.write_kv_torch`` does, in one
    C++ call. ``key, value [T, num_kv_heads, head_dim]`` may be views of the fused QKV
    output (rows apart, heads contiguous within a row)."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    rows = (key.shape[0], num_kv_heads, head_dim)
    if key.shape != rows or value.shape != rows or slot_mapping.shape != (key.shape[0],):
        raise ValueError(f"key and value must be {list(rows)} and slot_mapping [{key.shape[0]}]; "
                         f"got {list(key.shape)}, {list(value.shape)}, {list(slot_mapping.shape)}")
    if kv_cache.device.type != "cpu" or not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be a contiguous CPU tensor")
    key, value = key.to(kv_cache.dtype), value.to(kv_cache.dtype)
    key, value = (t if t.stride(2) == 1 and t.stride(1) == head_dim else t.contiguous()
                  for t in (key, value))
    slots = slot_mapping.to(torch.int64).contiguous()
    if not key.shape[0]:
        return
    with kernels.profiled("microvllm::write_kv"):
        bad = load().write_kv(key.data_ptr(), value.data_ptr(), key.stride(0), value.stride(0),
                              kv_cache.data_ptr(), slots.data_ptr(), key.shape[0],
                              num_blocks * block_size, num_kv_heads * head_dim,
                              kv_cache.element_size())
    if bad >= 0:
        raise bad_slot_error(slots, bad, num_blocks * block_size)


def bad_slot_error(slots: torch.Tensor, bad: int, num_slots: int) -> IndexError:
    """The error for a slot ``write_kv``'s C function refused (it returns the token's index)."""
    return IndexError(f"slot_mapping[{bad}] = {int(slots[bad])} is outside the cache's "
                      f"{num_slots} slots (num_blocks x block_size)")


def paged_attention_prefill(query: torch.Tensor, kv_cache: torch.Tensor,
                            block_table: torch.Tensor, query_start_loc: torch.Tensor,
                            seq_lens: torch.Tensor, out: torch.Tensor, *, scale: float,
                            sliding_window: int | None = None) -> torch.Tensor:
    """Prefill attention straight from the paged cache (see ``prefill_attention.cpp``).

    Request ``r``'s queries are rows ``query_start_loc[r] .. query_start_loc[r+1]`` of
    ``query [num_tokens, num_heads, head_dim]`` (heads contiguous within a row); query
    ``i`` of a chunk of ``q`` sits at position ``seq_lens[r] - q + i`` and sees keys up to
    it. Their rows of ``out`` (contiguous, same shape) are written; other rows are left
    alone. Needs ``prefill_supported(head_dim)``.
    """
    num_reqs = seq_lens.shape[0]
    num_tokens, num_heads, head_dim = query.shape
    if not prefill_supported(head_dim):
        raise ValueError(f"the prefill kernel does not run here for head_dim={head_dim}: "
                         "check prefill_supported() first")
    check_inputs(query, kv_cache, block_table, seq_lens, out, num_reqs)
    if query_start_loc.dtype != torch.int32:
        raise TypeError("block_table, query_start_loc and seq_lens must be int32")
    if (query_start_loc.shape != (num_reqs + 1,) or not query_start_loc.is_contiguous()
            or query_start_loc.device.type != "cpu"):
        raise ValueError("query_start_loc must be a contiguous CPU tensor of num_reqs + 1 entries")
    if num_reqs:
        if int(query_start_loc[-1]) > num_tokens:
            raise ValueError(f"query_start_loc runs past the {num_tokens} query rows")
        _, num_blocks, block_size, num_kv_heads, _ = kv_cache.shape
        with kernels.profiled("microvllm::paged_attention_prefill"):
            kernels.load("prefill_attention").paged_attention_prefill(
                DTYPE_CODES[query.dtype], query.data_ptr(), query.stride(0), kv_cache.data_ptr(),
                block_table.data_ptr(), query_start_loc.data_ptr(), seq_lens.data_ptr(),
                out.data_ptr(), num_reqs, num_heads, num_kv_heads, head_dim, block_size,
                num_blocks, block_table.shape[1], scale, sliding_window or 0)
    return out
