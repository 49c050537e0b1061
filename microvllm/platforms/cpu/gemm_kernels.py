"""The CPU platform's GEMM kernels for decode-sized projections, and their weight packs.

    avx512_linear.cpp  float32, AVX-512: weights in panels of 48 output columns
    amx_linear.cpp     bfloat16, Intel AMX tiles: weights in 16 x 32 tiles

Each weight is packed once, at load time (``*_pack_weight``); every call then streams
the pack straight through the vector or matrix units (see each .cpp file's header).
``gemm.PackedGemm`` picks a kernel per call by dtype and row count.
"""

from __future__ import annotations

import torch

from microvllm.platforms.cpu import kernels

TILE_N, TILE_K = 16, 32          # an AMX weight tile: 16 output columns x 32 inputs
PANEL = 48      # AVX-512: output columns per panel (three 16-float vectors)
VECTOR = 16     # AVX-512: N must be a multiple of this: the last panel is 16 or 32 columns


def amx_status() -> str | None:
    """None if the AMX kernel is usable on this machine, else the reason it is not."""
    return kernels.status("amx_linear")


def avx512_status() -> str | None:
    """None if the AVX-512 kernel is usable on this machine, else the reason it is not."""
    return kernels.status("avx512_linear")


def amx_supports(weight: torch.Tensor) -> bool:
    """Whether this weight can go through the kernel here: bfloat16 on a CPU, a shape
    made of whole tiles, and the kernel usable on this machine."""
    n, k = weight.shape
    return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
            and n % TILE_N == 0 and k % TILE_K == 0 and amx_status() is None)


def amx_pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``W [N, K]`` -> ``[N/16, K/32, 16, 16, 2]``: one 1 KiB AMX tile per (n block,
    k block), whose row ``r`` holds inputs ``2r, 2r+1`` of the block's 16 columns
    ("VNNI" order, what ``tdpbf16ps`` reads)::

        packed[nb, kb, r, n, e] = W[16*nb + n, 32*kb + 2*r + e]
    """
    n, k = weight.shape
    if not amx_supports(weight):
        raise ValueError(f"cannot pack a {weight.dtype} [{n}, {k}] weight for AMX: it needs "
                         f"bfloat16, N % {TILE_N} == 0, K % {TILE_K} == 0 and an AMX CPU "
                         f"({amx_status() or 'this one has it'})")
    tiles = weight.detach().reshape(n // TILE_N, TILE_N, k // TILE_K, TILE_K // 2, 2)
    return tiles.permute(0, 2, 3, 1, 4).contiguous()


def amx_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ W.T (+ bias)`` in bfloat16, with ``packed = amx_pack_weight(W)``."""
    num_n_blocks, num_k_blocks = packed.shape[:2]
    n, k = num_n_blocks * TILE_N, num_k_blocks * TILE_K
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be bfloat16 [M, {k}], got {x.dtype} {list(x.shape)}")
    if packed.dtype != torch.bfloat16 or packed.shape[2:] != (TILE_K // 2, TILE_N, 2):
        raise ValueError("packed must come from amx_pack_weight")
    if bias is not None and (bias.dtype != torch.bfloat16 or bias.shape != (n,)):
        raise ValueError(f"bias must be bfloat16 [{n}], got {bias.dtype} {list(bias.shape)}")
    x = x.contiguous()
    for name, t in (("x", x), ("packed", packed), ("bias", bias)):
        if t is not None and (t.device.type != "cpu" or not t.is_contiguous()):
            raise ValueError(f"{name} must be a contiguous CPU tensor")
    out = torch.empty(x.shape[0], n, dtype=torch.bfloat16)
    if x.shape[0]:
        with kernels.profiled("microvllm::amx_linear"):
            kernels.load("amx_linear").amx_linear(x.data_ptr(), packed.data_ptr(),
                                  bias.data_ptr() if bias is not None else None, out.data_ptr(),
                                  x.shape[0], n, k)
    return out


def avx512_supports(weight: torch.Tensor) -> bool:
    """Whether this weight can go through the kernel here: float32 on a CPU, N a
    multiple of 16, and the kernel usable on this machine."""
    return (weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.dim() == 2
            and weight.shape[0] % VECTOR == 0 and avx512_status() is None)


def avx512_pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``W [N, K]`` -> a ``[N, K]`` tensor holding W's elements in panel order: panels of
    48 output columns one after another, each k-major (the last one 16 or 32 wide)::

        flat packed[48·K·p + w_p·k + j] = W[48·p + j, k]      w_p: panel p's width
    """
    n, k = weight.shape
    if not avx512_supports(weight):
        raise ValueError(f"cannot pack a {weight.dtype} [{n}, {k}] weight for the AVX-512 "
                         f"kernel: it needs float32, N % {VECTOR} == 0 and an AVX-512 CPU "
                         f"({avx512_status() or 'this one has it'})")
    full = n // PANEL * PANEL
    w = weight.detach()
    panels = [w[:full].reshape(n // PANEL, PANEL, k).transpose(1, 2).reshape(-1)]
    if full < n:
        panels.append(w[full:].t().reshape(-1))
    return torch.cat(panels).view(n, k)


def avx512_linear(x: torch.Tensor, packed: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ W.T (+ bias)`` in float32, with ``packed = avx512_pack_weight(W)``."""
    n, k = packed.shape
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be float32 [M, {k}], got {x.dtype} {list(x.shape)}")
    if packed.dtype != torch.float32 or n % VECTOR:
        raise ValueError("packed must come from avx512_pack_weight")
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != (n,)):
        raise ValueError(f"bias must be float32 [{n}], got {bias.dtype} {list(bias.shape)}")
    x = x.contiguous()
    for name, t in (("x", x), ("packed", packed), ("bias", bias)):
        if t is not None and (t.device.type != "cpu" or not t.is_contiguous()):
            raise ValueError(f"{name} must be a contiguous CPU tensor")
    out = torch.empty(x.shape[0], n, dtype=torch.float32)
    if x.shape[0]:
        with kernels.profiled("microvllm::avx512_linear"):
            kernels.load("avx512_linear").avx512_linear(x.data_ptr(), packed.data_ptr(),
                                        bias.data_ptr() if bias is not None else None,
                                        out.data_ptr(), x.shape[0], n, k)
    return out
