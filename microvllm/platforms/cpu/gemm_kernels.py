"""The CPU platform's GEMM kernels for decode-sized projections, and their weight packs.

    vec_linear.cpp     float32, one vector source for AVX-512, AVX2 and NEON: weights in
                       panels of 3 vectors of output columns (48, 24 or 12)
    amx_linear.cpp     bfloat16, Intel AMX tiles: weights in 16 x 32 tiles
    dpbf16_linear.cpp  bfloat16 on AVX512-BF16 without AMX (vdpbf16ps, AMD Zen 4 and on):
                       weights in panels of 48 output columns, pairs of inputs side by side

Each weight is packed once, at load time (``*_pack_weight``); every call then streams
the pack straight through the vector or matrix units (see each .cpp file's header).
``gemm.PackedGemm`` picks a kernel per call by dtype and row count.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from microvllm import envs
from microvllm.platforms.cpu import kernels

TILE_N, TILE_K = 16, 32          # an AMX weight tile: 16 output columns x 32 inputs
PANEL_VECTORS = 3   # vec_linear: a panel is 3 vectors of output columns (vec_linear_panel())
DPBF16_PANEL = 48   # dpbf16_linear: output columns per panel (dpbf16_linear_panel() checks)


def amx_status() -> str | None:
    """None if the AMX kernel is usable on this machine, else the reason it is not."""
    return kernels.status("amx_linear")


def vec_status() -> str | None:
    """None if the float32 vector kernel is usable here, else the reason it is not (a
    portable build compiles it to stubs: no vector unit, no kernel)."""
    reason = kernels.status("vec_linear")
    if reason is None and vec_panel() == 0:
        return (f"this build has no vector unit (MICROVLLM_CPU_ISA={envs.cpu_isa()}): "
                f"{kernels.LIBRARIES['vec_linear'].otherwise}")
    return reason


@lru_cache(maxsize=None)
def vec_panel() -> int:
    """The vector kernel's panel width in output columns, as this build compiled it: 3
    vectors of 16 (AVX-512), 8 (AVX2) or 4 (NEON) floats; 0 when it has no vector unit."""
    return kernels.load("vec_linear").vec_linear_panel()


def vec_lanes() -> int:
    """Floats per vector in the vector kernel's build (N must be a multiple of it)."""
    return vec_panel() // PANEL_VECTORS


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
    packed_ok = packed.dtype == torch.bfloat16 and packed.shape[2:] == (TILE_K // 2, TILE_N, 2)
    return _run_linear("amx_linear", torch.bfloat16, x, packed, bias,
                       num_n_blocks * TILE_N, num_k_blocks * TILE_K, packed_ok)


def vec_supports(weight: torch.Tensor) -> bool:
    """Whether this weight can go through the vector kernel here: float32 on a CPU, N a
    multiple of the vector's lanes, and the kernel usable on this machine."""
    return (weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.dim() == 2
            and vec_status() is None and weight.shape[0] % vec_lanes() == 0)


def vec_pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``W [N, K]`` -> a ``[N, K]`` tensor holding W's elements in panel order: panels of
    P = ``vec_panel()`` output columns one after another, each k-major (the last one
    N % P wide: one or two vectors)::

        flat packed[P·K·p + w_p·k + j] = W[P·p + j, k]      w_p: panel p's width
    """
    n, k = weight.shape
    if not vec_supports(weight):
        lanes = vec_lanes() if vec_status() is None else "the vector's lanes"
        raise ValueError(f"cannot pack a {weight.dtype} [{n}, {k}] weight for the vector kernel: "
                         f"it needs float32, N % {lanes} == 0 and a vector unit "
                         f"({vec_status() or 'this build has one'})")
    panel = vec_panel()
    full = n // panel * panel
    w = weight.detach()
    panels = [w[:full].reshape(n // panel, panel, k).transpose(1, 2).reshape(-1)]
    if full < n:
        panels.append(w[full:].t().reshape(-1))
    return torch.cat(panels).view(n, k)


def vec_linear(x: torch.Tensor, packed: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ W.T (+ bias)`` in float32, with ``packed = vec_pack_weight(W)``."""
    n, k = packed.shape
    packed_ok = packed.dtype == torch.float32 and vec_status() is None and n % vec_lanes() == 0
    return _run_linear("vec_linear", torch.float32, x, packed, bias, n, k, packed_ok)


def dpbf16_status() -> str | None:
    """None if the AVX512-BF16 kernel is usable here, else the reason it is not."""
    return kernels.status("dpbf16_linear")


def dpbf16_supports(weight: torch.Tensor) -> bool:
    """Whether this weight can go through the AVX512-BF16 kernel here: bfloat16 on a CPU,
    N % 16 == 0, K even, and the kernel usable on this machine."""
    return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.dim() == 2
            and weight.shape[0] % 16 == 0 and weight.shape[1] % 2 == 0 and dpbf16_status() is None)


def dpbf16_pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``W [N, K]`` -> a ``[N, K]`` tensor holding W's elements in panels of P = 48 output
    columns, each panel pair-major: input pair ``kp``'s 48 columns one after another, each
    column's two inputs side by side (what ``vdpbf16ps`` multiplies); the last panel N % 48
    wide::

        flat packed[P·K·p + 2·w_p·kp + 2·j + e] = W[P·p + j, 2·kp + e]      w_p: panel p's width
    """
    n, k = weight.shape
    if not dpbf16_supports(weight):
        raise ValueError(f"cannot pack a {weight.dtype} [{n}, {k}] weight for the AVX512-BF16 kernel: "
                         f"it needs bfloat16, N % 16 == 0, K % 2 == 0 and a CPU with AVX512-BF16 "
                         f"({dpbf16_status() or 'this one has it'})")
    panel = DPBF16_PANEL
    full = n // panel * panel
    w = weight.detach()
    panels = [w[:full].reshape(n // panel, panel, k // 2, 2).permute(0, 2, 1, 3).reshape(-1)]
    if full < n:
        panels.append(w[full:].reshape(n - full, k // 2, 2).permute(1, 0, 2).reshape(-1))
    return torch.cat(panels).view(n, k)


def dpbf16_linear(x: torch.Tensor, packed: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ W.T (+ bias)`` in bfloat16, with ``packed = dpbf16_pack_weight(W)``."""
    n, k = packed.shape
    packed_ok = packed.dtype == torch.bfloat16 and dpbf16_status() is None and n % 16 == 0 and k % 2 == 0
    return _run_linear("dpbf16_linear", torch.bfloat16, x, packed, bias, n, k, packed_ok)


def _run_linear(name: str, dtype: torch.dtype, x: torch.Tensor, packed: torch.Tensor,
                bias: torch.Tensor | None, n: int, k: int, packed_ok: bool) -> torch.Tensor:
    """The checks every kernel's wrapper makes (C++ cannot), then kernel ``name`` (whose C
    function and library share its name) on ``x [M, k]``, returning ``[M, n]``."""
    kind = str(dtype).removeprefix("torch.")
    if x.dtype != dtype or x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be {kind} [M, {k}], got {x.dtype} {list(x.shape)}")
    if not packed_ok:
        raise ValueError(f"packed must come from {name.removesuffix('linear')}pack_weight")
    if bias is not None and (bias.dtype != dtype or bias.shape != (n,)):
        raise ValueError(f"bias must be {kind} [{n}], got {bias.dtype} {list(bias.shape)}")
    x = x.contiguous()
    for what, t in (("x", x), ("packed", packed), ("bias", bias)):
        if t is not None and (t.device.type != "cpu" or not t.is_contiguous()):
            raise ValueError(f"{what} must be a contiguous CPU tensor")
    out = torch.empty(x.shape[0], n, dtype=dtype)
    if x.shape[0]:
        with kernels.profiled(f"microvllm::{name}"):
            getattr(kernels.load(name), name)(x.data_ptr(), packed.data_ptr(),
                                              bias.data_ptr() if bias is not None else None,
                                              out.data_ptr(), x.shape[0], n, k)
    return out
