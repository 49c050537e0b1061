"""The Triton kernel of step (c): one launch runs every expert's matmul
(vLLM: ``fused_moe_kernel`` in ``layers/fused_moe/fused_moe.py``, without its
quantization, autotuning and grouped launch order).

Importing this module imports triton (``fused_moe.py`` imports it only when
``fused_experts`` is first called). On a machine without CUDA, Triton can only run the
kernel in its CPU interpreter, which ``TRITON_INTERPRET=1`` switches on *before* triton
is imported: :func:`ensure_triton_can_run` below sets it, or says what to change.

The problem. ``P = T * k`` pairs (token, expert), each wanting one row of
``C = A @ B[expert].T``::

    A  [rows, K]       hidden [T, H] (first matmul: pair i reads token i // k)
                       or the intermediate [P, I] (second matmul: pair i reads row i)
    B  [E, N, K]       w13 [E, 2I, H] or w2 [E, H, I]: one weight matrix per expert
    C  [P, N]          row i belongs to pair i

``moe_align_block_size(topk_ids, BLOCK_SIZE_M, E)`` listed the pairs expert by expert,
each expert's run padded to a multiple of ``BLOCK_SIZE_M`` (padding = ``P``), so that a
block of ``BLOCK_SIZE_M`` entries of ``sorted_token_ids`` holds one expert's pairs only,
the expert ``expert_ids[block]``. That is what lets one program use one weight matrix::

    grid = (num_tokens_post_padded // BLOCK_SIZE_M,  cdiv(N, BLOCK_SIZE_N))
             program (m, n)

    sorted_token_ids  [ 1 2 5 6 | 3 6 6 6 | 0 4 6 6 ]     P = 6, BLOCK_SIZE_M = 4
    expert_ids        [ 0       | 1       | 2       ]
                                  ^ m = 1: pairs 3 (and padding), expert 1

    program (m, n):  rows   = sorted_token_ids[m * BLOCK_SIZE_M : (m + 1) * BLOCK_SIZE_M]
                     e      = expert_ids[m]
                     cols   = n * BLOCK_SIZE_N ... + BLOCK_SIZE_N             (masked at N)
                     acc [BLOCK_SIZE_M, BLOCK_SIZE_N] = 0                     (float32)
                     for each BLOCK_SIZE_K slice of K:                        (masked at K)
                         a = A[rows // top_k, slice]     [BLOCK_SIZE_M, BLOCK_SIZE_K]
                         b = B[e, cols, slice].T         [BLOCK_SIZE_K, BLOCK_SIZE_N]
                         acc += a @ b                    tl.dot, on the matrix units
                     acc *= topk_weight[rows]            (MUL_ROUTED_WEIGHT only)
                     C[rows, cols] = acc                 scattered: row i of C is pair i

Padding rows (index ``P``) are masked: never loaded, never stored. The rows of a block
are gathered from scattered rows of A and scattered back to C: the sort moved indices,
never data.
"""

from __future__ import annotations

import torch

from microvllm.attention.triton_kernels import ensure_triton_can_run, is_interpreted
from microvllm.layers.fused_moe.moe_align_block_size import AlignedRouting

ensure_triton_can_run()  # before `import triton`: sets TRITON_INTERPRET=1 on a CPU, or raises

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

# Fixed tile sizes, no autotuning (vLLM's untuned default uses the same N and K). tl.dot needs at
# least 16 in each dimension; the interpreter runs one program at a time, so wider N
# tiles (fewer programs) also keep it quicker. BLOCK_SIZE_M is the caller's block_size_m,
# the same number moe_align_block_size padded each expert's run to.
BLOCK_SIZE_N = 64
BLOCK_SIZE_K = 32


@triton.jit
def fused_moe_kernel(
    a_ptr,                      # [rows of A, K]
    b_ptr,                      # [E, N, K]
    c_ptr,                      # [num_pairs, N]
    topk_weights_ptr,           # [num_pairs] float32
    sorted_token_ids_ptr,       # [num_tokens_post_padded] pair indices, padding = num_pairs
    expert_ids_ptr,             # [num_tokens_post_padded // BLOCK_SIZE_M] one expert per block
    num_pairs, N, K,
    stride_am, stride_ak,
    stride_be, stride_bn, stride_bk,
    stride_cm, stride_cn,
    top_k: tl.constexpr,        # pair i reads row i // top_k of A (1: A has a row per pair)
    MUL_ROUTED_WEIGHT: tl.constexpr,
    DOT_IN_FLOAT32: tl.constexpr,   # True in Triton's CPU interpreter only (see the loop)
    BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
):
    block = tl.program_id(0)
    pid_n = tl.program_id(1)

    # This block's pairs, and which of them are real (padding is num_pairs).
    pairs = tl.load(sorted_token_ids_ptr + block * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M))
    pair_mask = pairs < num_pairs
    # One expert for the whole block: the alignment guarantees it. int64 so that
    # expert * stride_be cannot overflow for large weights.
    expert = tl.load(expert_ids_ptr + block).to(tl.int64)

    cols = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    col_mask = cols < N
    ks = tl.arange(0, BLOCK_SIZE_K)

    # Pointers to the first K slice: A's rows gathered by pair, B[expert] read transposed.
    a_ptrs = a_ptr + (pairs // top_k)[:, None] * stride_am + ks[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + ks[:, None] * stride_bk + cols[None, :] * stride_bn

    acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    for k_start in range(0, K, BLOCK_SIZE_K):
        k_mask = ks < K - k_start           # the last slice may stick out past K
        a = tl.load(a_ptrs, mask=pair_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        if DOT_IN_FLOAT32:
            # The interpreter holds bfloat16 as raw 16-bit integers and its tl.dot would
            # multiply those. Widening first gives the same numbers the GPU computes:
            # bf16 * bf16 products are exact in float32, and acc is float32 anyway.
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        # input_precision="ieee": float32 inputs are multiplied exactly rather than
        # rounded to TF32 (as in the attention kernels); it changes nothing for bf16/fp16.
        acc = tl.dot(a, b, acc, input_precision="ieee")
        a_ptrs += BLOCK_SIZE_K * stride_ak
        b_ptrs += BLOCK_SIZE_K * stride_bk

    if MUL_ROUTED_WEIGHT:
        # Weighted in float32, before the one rounding to C's dtype.
        weights = tl.load(topk_weights_ptr + pairs, mask=pair_mask, other=0.0)
        acc = acc * weights[:, None]

    c_ptrs = c_ptr + pairs[:, None] * stride_cm + cols[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=pair_mask[:, None] & col_mask[None, :])


def invoke_fused_moe_kernel(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                            topk_weights: torch.Tensor, routing: AlignedRouting,
                            top_k: int, mul_routed_weight: bool, block_size_m: int) -> None:
    """``c[i] = a[i // top_k] @ b[expert of pair i].T`` (times pair i's weight if
    ``mul_routed_weight``) for every pair in ``routing``; other rows of ``c`` untouched."""
    num_pairs, n = c.shape
    k = a.shape[1]
    num_blocks = routing.num_tokens_post_padded // block_size_m
    if num_blocks == 0:
        return  # no pair is routed to this rank's experts: nothing to launch
    grid = (num_blocks, triton.cdiv(n, BLOCK_SIZE_N))
    fused_moe_kernel[grid](
        a, b, c, topk_weights, routing.sorted_token_ids, routing.expert_ids,
        num_pairs, n, k,
        a.stride(0), a.stride(1),
        b.stride(0), b.stride(1), b.stride(2),
        c.stride(0), c.stride(1),
        top_k=top_k, MUL_ROUTED_WEIGHT=mul_routed_weight,
        DOT_IN_FLOAT32=is_interpreted(fused_moe_kernel),
        BLOCK_SIZE_M=block_size_m, BLOCK_SIZE_N=BLOCK_SIZE_N, BLOCK_SIZE_K=BLOCK_SIZE_K,
    )
