"""Call ``avx512_linear.cpp``: float32 projections at decode sizes, on AVX-512.

``PackedGemm`` (layers/linear.py) uses it for float32 weights with up to
``AVX512_MAX_ROWS`` rows when ``avx512_status()`` is None: the CPU has AVX-512 and a
compiler is present. Each weight is packed once, at load time, into panels of 48 output
columns (``avx512_pack_weight``); every call streams them once, prefetching ahead of the
arithmetic (see the .cpp file's header).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from microvllm import cpp_extension

SOURCE = Path(__file__).with_name("avx512_linear.cpp")
PANEL = 48      # output columns per panel (three 16-float vectors)
VECTOR = 16     # N must be a multiple of this: the last panel is 16 or 32 columns
REQUIRED_CPU_FLAGS = ("avx512f",)


@functools.lru_cache(maxsize=None)
def load_avx512() -> ctypes.CDLL:
    """Build (if needed) and load the AVX-512 float32 linear kernel."""
    return cpp_extension.load_library(
        SOURCE, {"avx512_linear": (None, [ctypes.c_void_p] * 4 + [ctypes.c_int] * 3)},
        cpu_needs=REQUIRED_CPU_FLAGS, otherwise=": float32 projections use oneDNN and MKL instead")


@functools.lru_cache(maxsize=None)
def avx512_status() -> str | None:
    """None if the AVX-512 kernel is usable on this machine, else the reason it is not."""
    return cpp_extension.unavailable_reason(load_avx512)


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
        with cpp_extension.profiled("microvllm::avx512_linear"):
            load_avx512().avx512_linear(x.data_ptr(), packed.data_ptr(),
                                        bias.data_ptr() if bias is not None else None,
                                        out.data_ptr(), x.shape[0], n, k)
    return out
