"""Call ``amx_linear.cpp``: bfloat16 projections on Intel AMX matrix units.

``PackedGemm`` (layers/linear.py) uses it for bfloat16 weights at decode sizes when
``amx_status()`` is None: the CPU has AMX, Linux lets the process use it, and a compiler
is present. Each weight is packed once, at load time, into AMX tiles
(``amx_pack_weight``); every call then streams it straight through the matrix units
(see the .cpp file's header).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from microvllm import cpp_extension
from microvllm.cpp_extension import KernelUnavailable

SOURCE = Path(__file__).with_name("amx_linear.cpp")
TILE_N, TILE_K = 16, 32          # a weight tile: 16 output columns x 32 inputs
REQUIRED_CPU_FLAGS = ("amx_tile", "amx_bf16", "avx512_bf16")


@functools.lru_cache(maxsize=None)
def load_amx() -> ctypes.CDLL:
    """Build (if needed) and load the AMX kernel, and get Linux's permission to use AMX."""
    lib = cpp_extension.load_library(
        SOURCE, {"amx_init": (ctypes.c_int, []),
                 "amx_linear": (None, [ctypes.c_void_p] * 4 + [ctypes.c_int] * 3)},
        cpu_needs=REQUIRED_CPU_FLAGS, otherwise=" (AMX): bfloat16 projections use oneDNN instead")
    if lib.amx_init() != 0:
        raise KernelUnavailable("Linux refused this process the AMX tile registers "
                                "(arch_prctl ARCH_REQ_XCOMP_PERM needs Linux 5.16 or newer)")
    return lib


@functools.lru_cache(maxsize=None)
def amx_status() -> str | None:
    """None if the AMX kernel is usable on this machine, else the reason it is not."""
    return cpp_extension.unavailable_reason(load_amx)


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
        with cpp_extension.profiled("microvllm::amx_linear"):
            load_amx().amx_linear(x.data_ptr(), packed.data_ptr(),
                                  bias.data_ptr() if bias is not None else None, out.data_ptr(),
                                  x.shape[0], n, k)
    return out
