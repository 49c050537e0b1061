"""The batched LoRA update as a Triton kernel pair, ``lora_shrink`` and ``lora_expand``
(vLLM: ``vllm/lora/ops/triton_ops/lora_shrink_op.py``, ``lora_expand_op.py`` and their
metadata, ``lora_kernel_metadata.py``; Punica's SGMV: segmented gather matrix-vector).

Same meaning as ``torch_ops.bgmv_shrink`` / ``bgmv_expand_slice`` (the contract), computed
differently. The torch ops gather one weight matrix *per token*: a batch of 70 tokens
of one adapter reads that adapter's matrix 70 times. Here the tokens are first grouped
by adapter (only their indices move: :meth:`LoRAKernelMeta.prepare`), so that each
adapter's tokens form one *segment*, and a program multiplies a block of one segment's
tokens by that adapter's matrix: the weight is read once per block of tokens.

The metadata, for ``token_lora_mapping = [1, -1, 0, 1, 1, -1, 0]`` (T = 7)::

    token_indices_sorted_by_lora_ids  [ 1 5 | 2 6 | 0 3 4 ]    stable sort by adapter
    active_lora_ids                   [ -1  |  0  |  1    ]    one per segment (sorted)
    num_tokens_per_lora               [  2  |  2  |  3    ]
    lora_token_start_loc              [ 0     2     4     7 ]  where each segment starts

Both ops compute ``C[rows, cols] (+)= scale * A[rows, :] @ W[lora, cols, :].T``, the
same kernel with different shapes::

               A            W                      C                  scale    C before
    shrink     x [T, in]    lora_a [L, rank, in]   h [T, rank]        scaling  overwritten
    expand     h [T, rank]  lora_b [L, size, rank] y[:, off:off+size] 1        added to if add_inputs

    (L = max_loras; rank is max_rank: smaller adapters are zero-padded, and zero
    columns add nothing.) Shrink reduces over a long K (hidden) into a short N (rank);
    expand the reverse. ``y[:, off:off+size]``: a slice of a merged layer's output
    (q, k, v side by side), passed to the kernel as a strided view.

The grid and one program::

    grid = (cdiv(T, BLOCK_M), cdiv(N, BLOCK_N), number of segments)
             program (m, n, s)

    lora  = active_lora_ids[s]                      s = 2 above: adapter 1
    rows  = token_indices_sorted_by_lora_ids[start[s] + m * BLOCK_M ...][:BLOCK_M]
            (masked at the segment's end; a block past it returns at once)
    cols  = n * BLOCK_N ... + BLOCK_N               (masked at N)
    acc [BLOCK_M, BLOCK_N] = 0                      float32
    for each BLOCK_K slice of K:                    (masked at K)
        a = A[rows, slice]                          [BLOCK_M, BLOCK_K]  gathered rows
        w = W[lora, cols, slice].T                  [BLOCK_K, BLOCK_N]  one adapter: shared
        acc += a @ w                                tl.dot
    C[rows, cols] = scale * acc  (+ C[rows, cols])  scattered back to the tokens' rows

    lora == -1 (tokens without an adapter): no weight is read; the program writes what
    the reference writes: zeros where it overwrites (shrink, expand with
    add_inputs=False), nothing where it adds (expand with add_inputs=True).

The first grid axis is sized for the whole batch (T tokens), not the longest segment,
so that launching needs no look at the metadata's values (on a GPU that would wait for
it); most programs of a short segment return at once. Differences from vLLM: one slice
per call (vLLM launches every slice of a merged layer in one grid, axis 1, from lists
of weights), no split-K, no tuned block sizes, no grouped launch order; vLLM's shrink
zeroes its whole output first and both its kernels skip the -1 segment, while ours
write the -1 segment as above.

Importing this module imports triton. On a machine without CUDA, Triton can only run
the kernel in its CPU interpreter, which ``TRITON_INTERPRET=1`` switches on *before*
triton is imported: :func:`ensure_triton_can_run` below sets it, or says what to change.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from microvllm.attention.triton_kernels import ensure_triton_can_run, is_interpreted

ensure_triton_can_run()  # before `import triton`: sets TRITON_INTERPRET=1 on a CPU, or raises

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

# tl.dot needs at least 16 in each dimension. M: the tokens of one block.
BLOCK_M = 16


@dataclass
class LoRAKernelMeta:
    """The batch's tokens grouped by adapter (drawn in the module docstring). vLLM
    allocates these once (``LoRAKernelMeta.make``) and refills them every step
    (``prepare_tensors``), so that CUDA graphs see fixed buffers; here each batch gets
    fresh ones."""

    token_lora_mapping: torch.Tensor                # [T] adapter slot per token, -1: none
    token_indices_sorted_by_lora_ids: torch.Tensor  # [T] token indices, segment by segment
    active_lora_ids: torch.Tensor                   # [S] the adapter of each segment, sorted
    num_tokens_per_lora: torch.Tensor               # [S] its length
    lora_token_start_loc: torch.Tensor              # [S + 1] where it starts; [0] = 0, [S] = T

    @staticmethod
    def prepare(token_lora_mapping: torch.Tensor) -> LoRAKernelMeta:
        """Group the tokens by adapter: three torch ops, no Python loop over tokens."""
        if token_lora_mapping.dim() != 1:
            raise ValueError(f"token_lora_mapping must be 1-D (one adapter slot per token), "
                             f"got shape {tuple(token_lora_mapping.shape)}")
        mapping = token_lora_mapping.to(torch.int32)
        # stable: within a segment the tokens keep their batch order (any order would do,
        # but a deterministic one makes the metadata testable).
        sorted_indices = torch.sort(mapping, stable=True).indices.to(torch.int32)
        lora_ids, counts = torch.unique(mapping, sorted=True, return_counts=True)
        start_loc = torch.zeros(lora_ids.numel() + 1, dtype=torch.int32, device=mapping.device)
        start_loc[1:] = torch.cumsum(counts, dim=0)
        return LoRAKernelMeta(mapping, sorted_indices, lora_ids.to(torch.int32),
                              counts.to(torch.int32), start_loc)


@triton.jit
def _sgmv_kernel(
    a_ptr,                      # [T, K]     x (shrink) or h (expand)
    w_ptr,                      # [L, N, K]  lora_a or lora_b
    c_ptr,                      # [T, N]     h (shrink) or a slice of y (expand), strided
    token_indices_sorted_by_lora_ids, num_tokens_per_lora, lora_token_start_loc, lora_ids,
    N, K, scale,
    stride_am, stride_ak,
    stride_wl, stride_wn, stride_wk,
    stride_cm, stride_cn,
    ADD_INPUTS: tl.constexpr,       # C += result (expand into the base layer's output)
    DOT_IN_FLOAT32: tl.constexpr,   # True in Triton's CPU interpreter only (see the loop)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    segment = tl.program_id(2)

    segment_len = tl.load(num_tokens_per_lora + segment)
    first = pid_m * BLOCK_M
    if first >= segment_len:
        return  # the grid is sized for the whole batch; this segment is shorter

    offs = tl.arange(0, BLOCK_M)
    row_mask = offs < segment_len - first
    start = tl.load(lora_token_start_loc + segment)
    rows = tl.load(token_indices_sorted_by_lora_ids + start + first + offs, mask=row_mask, other=0)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    c_ptrs = c_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn
    c_mask = row_mask[:, None] & col_mask[None, :]

    # int64 so that lora * stride_wl cannot overflow for many large adapters.
    lora = tl.load(lora_ids + segment).to(tl.int64)
    if lora == -1:
        # Tokens without an adapter: as the reference, zeros where C is overwritten.
        if not ADD_INPUTS:
            tl.store(c_ptrs, tl.zeros((BLOCK_M, BLOCK_N), dtype=c_ptr.dtype.element_ty), mask=c_mask)
        return

    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + ks[None, :] * stride_ak
    w_ptrs = w_ptr + lora * stride_wl + ks[:, None] * stride_wk + cols[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        k_mask = ks < K - k_start           # the last slice may stick out past K
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        w = w.to(a.dtype)                   # as the reference: weights in the input's dtype
        if DOT_IN_FLOAT32:
            # The interpreter holds bfloat16 as raw 16-bit integers and its tl.dot would
            # multiply those; widening first gives what a GPU computes (bf16 and fp16
            # products are exact in float32, and acc is float32 anyway).
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        # "ieee": float32 inputs multiplied exactly, not rounded to TF32 on a GPU.
        acc = tl.dot(a, w, acc, input_precision="ieee")
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk

    acc = acc * scale
    if ADD_INPUTS:
        acc += tl.load(c_ptrs, mask=c_mask, other=0.0).to(tl.float32)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


def _block(size: int, largest: int) -> int:
    """A tile side for a dimension of ``size``: a power of two, 16 (tl.dot's least) to
    ``largest``, so that a rank of 1..64 is one tile and a hidden size a few."""
    return min(largest, max(16, triton.next_power_of_2(size)))


def _check(name: str, inputs: torch.Tensor, weights: torch.Tensor, output: torch.Tensor,
           meta: LoRAKernelMeta) -> None:
    if inputs.dim() != 2 or weights.dim() != 3 or output.dim() != 2:
        raise ValueError(f"{name}: want inputs [T, K], weights [max_loras, N, K], output [T, N]; "
                         f"got {tuple(inputs.shape)}, {tuple(weights.shape)}, {tuple(output.shape)}")
    if inputs.shape[1] != weights.shape[2]:
        raise ValueError(f"{name}: inputs have {inputs.shape[1]} columns but the weights' last "
                         f"dimension is {weights.shape[2]}: they must be equal")
    if not inputs.shape[0] == output.shape[0] == meta.token_lora_mapping.shape[0]:
        raise ValueError(f"{name}: inputs, output and LoRAKernelMeta.prepare(...) must cover the same "
                         f"tokens; got {inputs.shape[0]}, {output.shape[0]}, {meta.token_lora_mapping.shape[0]}")
    if meta.active_lora_ids.numel() and int(meta.active_lora_ids.max()) >= weights.shape[0]:
        raise ValueError(f"{name}: adapter slot {int(meta.active_lora_ids.max())} is out of range for "
                         f"{weights.shape[0]} slots (max_loras); slots are 0..max_loras-1, or -1 for none")


def _launch(inputs: torch.Tensor, weights: torch.Tensor, output: torch.Tensor, meta: LoRAKernelMeta,
            scale: float, add_inputs: bool, block_n: int, block_k: int) -> None:
    num_tokens, k = inputs.shape
    n = weights.shape[1]
    num_segments = meta.active_lora_ids.numel()
    if num_tokens == 0 or n == 0:
        return  # nothing to compute, nothing to write
    grid = (triton.cdiv(num_tokens, BLOCK_M), triton.cdiv(n, block_n), num_segments)
    _sgmv_kernel[grid](
        inputs, weights, output,
        meta.token_indices_sorted_by_lora_ids, meta.num_tokens_per_lora, meta.lora_token_start_loc,
        meta.active_lora_ids,
        n, k, scale,
        inputs.stride(0), inputs.stride(1),
        weights.stride(0), weights.stride(1), weights.stride(2),
        output.stride(0), output.stride(1),
        ADD_INPUTS=add_inputs,
        DOT_IN_FLOAT32=is_interpreted(_sgmv_kernel),
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
    )


def lora_shrink(inputs: torch.Tensor, lora_a_weights: torch.Tensor, output_tensor: torch.Tensor,
                meta: LoRAKernelMeta, scaling: float = 1.0) -> None:
    """``output_tensor[t] = scaling * lora_a_weights[slot[t]] @ inputs[t]`` (0 where slot is
    -1): ``torch_ops.bgmv_shrink``. ``inputs [T, in]``, ``lora_a_weights [max_loras, rank,
    in]``, ``output_tensor [T, rank]``; ``meta = LoRAKernelMeta.prepare(slots)``."""
    _check("lora_shrink", inputs, lora_a_weights, output_tensor, meta)
    rank = lora_a_weights.shape[1]
    _launch(inputs, lora_a_weights, output_tensor, meta, scaling, add_inputs=False,
            block_n=_block(rank, 64), block_k=32)


def lora_expand(inputs: torch.Tensor, lora_b_weights: torch.Tensor, output_tensor: torch.Tensor,
                meta: LoRAKernelMeta, offset_start: int = 0, add_inputs: bool = True) -> None:
    """``output_tensor[t, offset_start:offset_start + size] (+)= lora_b_weights[slot[t]] @
    inputs[t]``: ``torch_ops.bgmv_expand_slice`` (``bgmv_expand`` with ``offset_start=0`` and
    ``size`` the output's width). ``inputs [T, rank]``, ``lora_b_weights [max_loras, size,
    rank]``; where slot is -1, nothing is added (zeros written if not ``add_inputs``)."""
    size = lora_b_weights.shape[1] if lora_b_weights.dim() == 3 else 0
    if output_tensor.dim() != 2 or not 0 <= offset_start <= offset_start + size <= output_tensor.shape[1]:
        raise ValueError(f"lora_expand: the slice [{offset_start}, {offset_start + size}) does not fit in "
                         f"output_tensor of shape {tuple(output_tensor.shape)}")
    target = output_tensor[:, offset_start:offset_start + size]   # a strided view: no copy
    _check("lora_expand", inputs, lora_b_weights, target, meta)
    rank = lora_b_weights.shape[2]
    _launch(inputs, lora_b_weights, target, meta, 1.0, add_inputs=add_inputs,
            block_n=32, block_k=_block(rank, 64))
